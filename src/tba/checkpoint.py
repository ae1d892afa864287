"""Checkpoints: ``<run>/checkpoints/step_<N>/`` holds the policy as a Hugging Face checkpoint
(``from_pretrained`` loads it directly) plus what resuming needs (optimizer, LR schedule, step,
replay buffer, searcher state, random states) as data, never as code:

- ``trainer_state.json``: the structure, numbers and strings;
- ``trainer_state.safetensors``: its tensors and arrays, referenced from the JSON by name.

Nothing is pickled, so loading a checkpoint from elsewhere cannot run code. Checkpoints of older
versions (``trainer_state.pt``, a pickle) are refused rather than unpickled.

A LoRA policy (``model.lora``) is saved as a PEFT adapter (``adapter_config.json``,
``adapter_model.safetensors``; ``PeftModel.from_pretrained(base, path)`` loads it) and, with
``merged=True``, also as a full model with the adapter merged in ``merged/``.

Crash safety: a checkpoint is written to ``step_<N>.tmp`` and renamed into place, so a
``step_<N>`` directory is complete or absent; a leftover ``*.tmp`` is ignored by
:func:`latest_checkpoint` and removed by the next save. Pruning (``keep``) renames a directory to
``*.tmp`` before deleting it, so a crash there leaves a leftover, never half a checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from tba.errors import UserError
from tba.models.lora import is_lora, load_adapter_checkpoint, merged_copy

STATE_JSON = "trainer_state.json"
STATE_TENSORS = "trainer_state.safetensors"
LEGACY_STATE = "trainer_state.pt"  # a pickle, written by tba before checkpoints became data
FORMAT = 1
_STEP_DIR = re.compile(r"step_(\d+)")


class CheckpointError(UserError, ValueError):
    """A checkpoint that cannot be loaded; the message says why and what to do."""


def save_checkpoint(
    run_dir: Path,
    model,
    tokenizer,
    trainer_state: dict,
    buffer_state: dict,
    extra: dict | None = None,
    merged: bool = False,
    keep: int | None = None,
) -> Path:
    """Write ``step_<N>/`` atomically (N is ``trainer_state["version"]``); ``merged`` adds a LoRA
    policy's merged full model in ``merged/``; ``keep`` then deletes all but the newest ``keep``
    checkpoints (None keeps all). ``extra`` may hold tensors (a searcher's reference weights)."""
    step = trainer_state["version"]
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    _remove_leftovers(root)
    final = root / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    tmp.mkdir()
    model.save_pretrained(tmp)  # a LoRA policy saves its adapter only
    tokenizer.save_pretrained(tmp)
    if merged and is_lora(model):
        merged_copy(model).save_pretrained(tmp / "merged")
        tokenizer.save_pretrained(tmp / "merged")
    state = {"trainer": trainer_state, "buffer": buffer_state, "rng": _global_rng_state(), "extra": extra or {}}
    write_state(tmp, state)
    old = None
    if final.exists():  # the same step saved again: os.replace cannot overwrite a directory
        old = final.with_name(final.name + ".old.tmp")
        os.replace(final, old)
    os.replace(tmp, final)  # a checkpoint directory is complete or absent, never half-written
    if old is not None:
        shutil.rmtree(old)
    if keep is not None:
        prune_checkpoints(root, keep, newest=step)
    return final


def prune_checkpoints(root: Path, keep: int, newest: int) -> None:
    """Delete ``step_*`` directories older than ``newest`` beyond the newest ``keep`` in all
    (``step_<newest>`` itself always stays)."""
    if keep < 1:
        raise ValueError(f"keep must be >= 1 checkpoint, got {keep}")
    older = sorted(step for step, _ in _step_dirs(root) if step < newest)
    for step in older[: max(len(older) - (keep - 1), 0)]:
        doomed = root / f"step_{step}.tmp"  # not a checkpoint any more, even if the deletion is cut short
        if doomed.exists():
            shutil.rmtree(doomed)
        os.replace(root / f"step_{step}", doomed)
        shutil.rmtree(doomed)


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The newest complete ``step_<N>`` directory (older-format ones included, so that resuming
    one says why it cannot load); None if there is none."""
    root = Path(run_dir) / "checkpoints"
    steps = [(step, p) for step, p in _step_dirs(root) if (p / STATE_JSON).is_file() or (p / LEGACY_STATE).is_file()]
    return max(steps)[1] if steps else None


def read_trainer_state(checkpoint: Path) -> dict:
    """The state that :func:`save_checkpoint` wrote: ``trainer``, ``buffer``, ``rng``, ``extra``."""
    checkpoint = Path(checkpoint)
    meta_path = checkpoint / STATE_JSON
    if not meta_path.is_file():
        if (checkpoint / LEGACY_STATE).is_file():
            raise CheckpointError(
                f"{checkpoint} was written by an older tba; not loadable safely (its {LEGACY_STATE} is a pickle, "
                "which can run code). Resume it with the tba version that wrote it, or start a new run "
                "(model.policy may point at this checkpoint to start from its weights)"
            )
        raise CheckpointError(f"{checkpoint} holds no {STATE_JSON}: it is not a tba checkpoint")
    meta = json.loads(meta_path.read_text())
    if meta.get("format") != FORMAT:
        raise CheckpointError(
            f"{meta_path} has format {meta.get('format')!r}; this tba reads format {FORMAT}: "
            "resume with the tba version that wrote it"
        )
    tensors_path = checkpoint / STATE_TENSORS
    tensors = load_file(tensors_path) if tensors_path.is_file() else {}
    return _decode(meta["state"], tensors)


def restore_global_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    name, keys, pos, has_gauss, gauss = rng["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(rng["torch"])
    if rng.get("cuda") and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


def write_state(directory: Path, state: dict) -> None:
    """``state`` as ``trainer_state.json`` + ``trainer_state.safetensors`` in ``directory``."""
    tensors: dict[str, torch.Tensor] = {}
    encoded = _encode(state, tensors)
    save_file(tensors, Path(directory) / STATE_TENSORS)
    (Path(directory) / STATE_JSON).write_text(json.dumps({"format": FORMAT, "state": encoded}))


def load_policy_weights(model, checkpoint: Path) -> None:
    """Load a checkpoint's policy weights into ``model``: the adapter for a LoRA policy, else the full model."""
    checkpoint = Path(checkpoint)
    has_adapter = (checkpoint / "adapter_config.json").is_file()
    if has_adapter != is_lora(model):
        held, wanted = ("a LoRA adapter", "a full model") if has_adapter else ("a full model", "a LoRA adapter")
        raise ValueError(
            f"{checkpoint} holds {held} but this run trains {wanted}; resume with the run's original model.lora setting"
        )
    if has_adapter:
        load_adapter_checkpoint(model, checkpoint)
        return
    from transformers import AutoModelForCausalLM

    saved = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=next(model.parameters()).dtype)
    model.load_state_dict(saved.state_dict())


# ---------------------------------------------------------------- helpers


def _step_dirs(root: Path) -> list[tuple[int, Path]]:
    if not root.is_dir():
        return []
    return [(int(m.group(1)), p) for p in root.iterdir() if p.is_dir() and (m := _STEP_DIR.fullmatch(p.name))]


def _remove_leftovers(root: Path) -> None:
    """``*.tmp`` directories: writes or deletions that a crash cut short."""
    for p in root.glob("step_*.tmp"):
        shutil.rmtree(p)


def _global_rng_state() -> dict:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    state = {
        "python": random.getstate(),
        "numpy": (name, keys.tolist(), pos, has_gauss, gauss),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


# JSON has no tuples, no tensors and no non-string keys: such values become one-key objects whose
# key starts with "__" (a dict with such a key of its own is stored as a list of pairs).


def _encode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if obj is None or isinstance(obj, bool | int | float | str):
        return obj
    if isinstance(obj, torch.Tensor):
        return {"__tensor__": _put(tensors, obj.detach().to("cpu", copy=True).contiguous())}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": _put(tensors, torch.from_numpy(np.array(obj, copy=True, order="C")))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, list):
        return [_encode(x, tensors) for x in obj]
    if isinstance(obj, tuple):
        return {"__tuple__": [_encode(x, tensors) for x in obj]}
    if isinstance(obj, dict):
        if all(isinstance(k, str) and not k.startswith("__") for k in obj):
            return {k: _encode(v, tensors) for k, v in obj.items()}
        return {"__items__": [[_encode(k, tensors), _encode(v, tensors)] for k, v in obj.items()]}
    raise TypeError(
        f"a checkpoint holds numbers, strings, lists, tuples, dicts, tensors and numpy arrays; "
        f"got a {type(obj).__name__}: convert it in the state_dict() that returned it"
    )


def _put(tensors: dict[str, torch.Tensor], tensor: torch.Tensor) -> str:
    name = f"t{len(tensors)}"
    tensors[name] = tensor
    return name


def _decode(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, list):
        return [_decode(x, tensors) for x in obj]
    if not isinstance(obj, dict):
        return obj
    if len(obj) == 1:
        ((key, value),) = obj.items()
        if key == "__tensor__":
            return tensors[value]
        if key == "__ndarray__":
            return tensors[value].numpy()
        if key == "__tuple__":
            return tuple(_decode(x, tensors) for x in value)
        if key == "__items__":
            return {_decode(k, tensors): _decode(v, tensors) for k, v in value}
    return {k: _decode(v, tensors) for k, v in obj.items()}
