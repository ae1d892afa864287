"""LoRA policies through PEFT (``model.lora``): the base model stays frozen and only a low-rank
adapter trains, as the red-teaming paper trains its attacker (rank 32, alpha 16).

Three consequences shape the rest of the code:

- **The reference is the base model**: the policy with its adapter switched off
  (:class:`ReferenceView`), so no second copy of the weights is loaded. This is exact only while
  the base weights never change, which is why biases never train and the reference never follows
  the policy (``objective.ref_reset_every`` is rejected).
- **Publishing sends the adapter only** (:func:`published_state`, :func:`load_published_state`):
  a few megabytes instead of the whole model.
- **Checkpoints are PEFT adapters** (``adapter_config.json``, ``adapter_model.safetensors``), which
  ``PeftModel.from_pretrained(base, path)`` loads; :func:`merged_copy` gives the full model.

``peft`` is optional and imported only when a function here needs it.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
import warnings
from pathlib import Path

import torch

from tba.config import ConfigError, LoraConfig, ModelConfig, ObjectiveConfig
from tba.errors import MissingDependency
from tba.objectives.needs import needs

PEFT_MISSING = "model.lora needs the peft package: pip install 'tba[lora]' (or pip install peft)"
ADAPTER_NAME = "default"  # PEFT's name for a model's only adapter


def require_peft():
    """The ``peft`` module, or an ImportError that says how to install it."""
    try:
        import peft
    except ImportError as err:
        raise MissingDependency(PEFT_MISSING) from err
    return peft


def check_lora_config(m: ModelConfig, objective: ObjectiveConfig) -> None:
    """Reject ``model`` settings that LoRA's reference (the base model, adapter off) cannot honour
    with ``objective``; check that PEFT is installed. Raises before any model is loaded."""
    if m.lora is None:
        return
    if m.reference is not None and m.reference != m.policy:
        raise ConfigError(
            f"model.lora uses the policy with its adapter switched off as the reference, so model.reference "
            f"({m.reference!r}) must be unset or equal model.policy ({m.policy!r})"
        )
    if needs(objective).moves_reference(objective):
        raise ConfigError(
            "objective.ref_reset_every (TBA′) moves the reference to the current policy, but with model.lora the "
            "reference is the frozen base model; unset objective.ref_reset_every or model.lora"
        )
    if importlib.util.find_spec("peft") is None:
        raise MissingDependency(PEFT_MISSING)


def add_adapter(model: torch.nn.Module, cfg: LoraConfig) -> torch.nn.Module:
    """``model`` wrapped by PEFT with a fresh adapter (B = 0, so it starts equal to the base model);
    only the adapter's parameters require gradients."""
    peft = require_peft()
    lora = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        bias="none",  # a trained bias would change the base model, which is the reference
        task_type="CAUSAL_LM",
        # GPT-2-style models store linear weights transposed (transformers' Conv1D); PEFT would
        # find out and warn for every layer
        fan_in_fan_out=any(type(m).__name__ == "Conv1D" for m in model.modules()),
    )
    with warnings.catch_warnings():  # PEFT calls a transformers method that transformers 5 deprecates
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        return peft.get_peft_model(model, lora, adapter_name=ADAPTER_NAME)


def is_lora(model: torch.nn.Module) -> bool:
    """Whether ``model`` is a PEFT model (without importing PEFT when nothing loaded it)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def published_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """What the trainer publishes: the adapter's tensors for a LoRA policy, else the full state dict.
    ``state``: the model's state dict (or its trainable part, :func:`policy_state`), gathered by
    whoever holds the weights (trainer ranks); default ``model.state_dict()``."""
    if is_lora(model):
        return require_peft().get_peft_model_state_dict(model, state_dict=state, adapter_name=ADAPTER_NAME)
    return model.state_dict() if state is None else state


def policy_state(model: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The part of the policy's state dict that training changes, by full parameter name: every
    entry for a full model, the adapter's parameters for a LoRA policy (its base is the reference,
    loaded from ``model.policy``). ``state``: the model's whole state dict, if it was gathered elsewhere."""
    state = model.state_dict() if state is None else state
    if not is_lora(model):
        return state
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    return {k: v for k, v in state.items() if k in trainable}


def load_policy_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what :func:`policy_state` returned into a model of the same kind."""
    result = model.load_state_dict(state, strict=not is_lora(model))
    if result.unexpected_keys:
        raise ValueError(f"policy state does not fit this model: unexpected keys {result.unexpected_keys[:3]}")


def load_published_state(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Load what :func:`published_state` produced into a sampler of the same kind."""
    if not is_lora(model):
        model.load_state_dict(state)
        return
    result = require_peft().set_peft_model_state_dict(model, state, adapter_name=ADAPTER_NAME)
    missing = [k for k in result.missing_keys if "lora_" in k]
    if result.unexpected_keys or missing:
        raise ValueError(
            f"published weights do not fit this LoRA sampler ({len(result.unexpected_keys)} unexpected keys, "
            f"e.g. {result.unexpected_keys[:2]}; {len(missing)} adapter tensors missing, e.g. {missing[:2]}): "
            "trainer and searchers must use the same model.policy and model.lora"
        )


class ReferenceView(torch.nn.Module):
    """The reference of a LoRA policy: the same module, called with its adapter switched off.

    Any code that takes a reference model (sequence log-probs, KL at evaluation) can take this; it
    holds no weights of its own. Calls must not overlap with calls of the policy itself."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def get_base_model(self) -> torch.nn.Module:
        """The transformers model under the adapter (what :func:`~tba.models.logprobs.accepts_logits_to_keep` reads)."""
        return self.model.get_base_model()

    def forward(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)


def copy_sharing_frozen(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy whose frozen parameters are the original's tensors, not copies: a sampler beside
    a LoRA policy in one process costs an adapter, not a second base model. (Frozen weights never
    change, so sharing them is safe; everything trainable is copied.)"""
    memo = {id(p): p for p in model.parameters() if not p.requires_grad}
    return copy.deepcopy(model, memo)


def merged_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A plain ``transformers`` model on the CPU with the adapter merged into its weights. The copy is
    made tensor by tensor straight to the CPU (no second model on the accelerator), and the policy is
    left as it is: merging in place and back would perturb the base weights, which are the reference."""
    memo: dict[int, object] = {
        id(p): torch.nn.Parameter(p.detach().to("cpu", copy=True), requires_grad=False) for p in model.parameters()
    }
    memo.update({id(b): b.detach().to("cpu", copy=True) for b in model.buffers()})
    return copy.deepcopy(model, memo).merge_and_unload()


def merged_weights(model: torch.nn.Module):
    """The LoRA policy ``model``'s full weights with the adapter merged, as ``(name, tensor)`` pairs
    named as the plain ``transformers`` model names them (what an engine that holds no adapter
    loads). Merged tensors are made one at a time (W + PEFT's own delta for each adapted layer, in
    W's dtype); every other tensor is the model's own, not a copy. The model is left unchanged."""
    peft = require_peft()
    base = model.get_base_model()
    adapted = {
        name: module
        for name, module in base.named_modules()
        if isinstance(module, peft.tuners.lora.LoraLayer) and ADAPTER_NAME in module.lora_A
    }
    for key, tensor in base.state_dict().items():
        if ".lora_" in key:
            continue
        module_name, _, leaf = key.rpartition(".")
        owner = module_name.removesuffix(".base_layer")
        name = f"{owner}.{leaf}" if owner else leaf
        if leaf == "weight" and module_name.endswith(".base_layer") and owner in adapted:
            with torch.no_grad():
                delta = adapted[owner].get_delta_weight(ADAPTER_NAME)
                tensor = tensor + delta.to(tensor.dtype)
        yield name, tensor


def load_adapter_checkpoint(model: torch.nn.Module, path: Path) -> None:
    """Load the adapter saved in ``path`` (PEFT's format) into the LoRA policy ``model``."""
    saved = json.loads((Path(path) / "adapter_config.json").read_text())
    current = model.peft_config[ADAPTER_NAME]
    for key in ("r", "lora_alpha", "target_modules"):
        theirs, ours = saved.get(key), getattr(current, key)
        if isinstance(ours, (set, list)):  # saved as a list, held as a set
            theirs, ours = sorted(theirs or []), sorted(ours)
        if theirs != ours:
            raise ValueError(
                f"the checkpoint {path} holds an adapter with {key}={theirs}, but this run has "
                f"{key}={ours}; resume with the run's original model.lora settings"
            )
    from safetensors.torch import load_file

    device = next(model.parameters()).device
    load_published_state(model, load_file(Path(path) / "adapter_model.safetensors", device=str(device)))
