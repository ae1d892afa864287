"""The run plan: every decision a run takes from its config and the machine, resolved once at start.

A config says what the user asked for, with ``auto`` wherever the machine or another setting should
decide. :func:`make_plan` decides those once, before any model loads, from the config and a
:class:`Hardware` description (detected, or written by hand in a test): the device, the dtypes and
the trainer's precision, where the models come from, the runtime and how weights reach the
searchers, the kind of generation stream, the lag bound and the other staleness settings, and the
CPU threads and GPU shares of each process. ``tba train`` prints it (:meth:`Plan.lines`) and saves it
in the run directory (``plan.json``); the builders, the trainer ranks and the Ray actors read it
rather than resolving the config again. The one thing it learns after loading is the set of token
ids that end a completion (:meth:`Plan.with_eos`), which needs the tokenizer.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tba.config import ArithmeticTaskConfig, Config, ConfigError, with_values
from tba.hardware import DTYPES, Hardware, resolve_device_name, resolve_dtype_name, resolve_precision_name
from tba.models.builtin import BUILTIN_PREFIX, TOOL_MODEL, builtin_location
from tba.objectives.needs import needs
from tba.plan.auto import (
    flat_weight,
    grad_clip,
    lag_bound,
    needs_sampler_logps,
    replay_window,
    stale_by_design,
    tb_trust_region,
)
from tba.plan.generation import sampling_line, searcher_sampling, stream_kind, stream_sizes, vllm_engines
from tba.plan.layout import resolve as resolve_layout
from tba.plan.placement import (
    actor_gpu_shares,
    driver_holds_gpu,
    local_ray_gpus,
    oversubscription,
    planned_threads,
    rank_cpus,
)
from tba.weights.transports import transport, weight_transport

__all__ = ["Hardware", "Plan", "make_plan", "plan_run"]

PLAN_FILE = "plan.json"


@dataclass(frozen=True)
class Plan:
    """A run's resolved decisions (see the module docstring). ``why`` says, for the decisions an
    ``auto`` took, what took them."""

    hardware: Hardware
    device: str
    """``cpu``, ``cuda`` or ``cuda:N``: where the trainer (and in the sync runtime, generation) runs."""
    dtype: str
    """Weights dtype of the searchers, the reference and evaluation (``model.dtype`` resolved)."""
    precision: str
    """The trainer's: ``fp32``, ``bf16-mixed`` or ``bf16`` (``trainer.precision`` resolved)."""
    policy: str
    """``model.policy`` as a loadable id or folder (a built-in model's folder, built or not yet)."""
    reference: str
    runtime: str
    objective: str
    transport: str
    """How published weights reach the searchers: ``in_process`` (sync), ``object_store`` or
    ``broadcast`` or ``ipc`` (ray; ``runtime.weight_transport``)."""
    stream: str
    """``batch`` (a ``generate`` call per batch), or a stream: ``vllm``, ``hf_continuous``, ``hf_refill``."""
    exact_stream: bool
    """A stream takes each step's batch of prompts and finishes every one of them (the sync runtime:
    a step equals a batch's); otherwise it keeps ``generation.max_in_flight`` prompts going."""
    lag_bound: int | None
    """The ray runtime's bound on staleness in versions (``runtime.max_lag`` resolved; None: none)."""
    extra_lag: int
    flat_weight: float
    trust_region: float | None
    grad_clip: float | None
    sampler_logprobs: str
    """``none``, ``sampling_pass`` (HF, taken while sampling), ``teacher_forced`` (HF, a second pass) or
    ``engine`` (vLLM's raw log-probs)."""
    trainer_threads: int | None
    """torch threads of the ``tba train`` process (None: torch's default, every core)."""
    searcher_threads: int
    rank_threads: int | None
    rank_cpus: float | None
    searcher_gpus: float | None
    eval_gpus: float | None
    shares_gpu: bool
    """The ray runtime's actors share the trainer's one GPU (a local Ray instance on one GPU)."""
    engines: dict[str, dict] = field(default_factory=dict)
    """vLLM engines' settings by role (``searcher``, ``evaluation``): ``gpu_memory_utilization`` and
    ``sleep``, from each role's share of its GPU (:func:`vllm_engines`); empty with HF generation."""
    eos_ids: tuple[int, ...] = ()
    why: dict[str, str] = field(default_factory=dict)
    max_ahead: int | None = None
    """The ray runtime's cap on what searchers run ahead of the trainer, in steps (``runtime.max_ahead``)."""
    replay_window: int | None = None
    """The ray runtime's steps over which ``trainer.max_replay_ratio`` holds (:func:`tba.plan.auto.replay_window`)."""
    warnings: tuple[str, ...] = ()
    """What the plan allows but advises against (processes asking for more cores than there are)."""
    min_groups: int = 1
    """Groups the buffer holds before the first step (``buffer.min_groups``; default one batch)."""
    samples_per_prompt: int = 1
    """Completions a searcher samples a prompt (``generation.samples_per_prompt``; default ``group_size``)."""
    max_in_flight: int | None = None
    """A stream's prompts in its engine (``generation.max_in_flight``; default ``prompts_per_batch``,
    exactly that in the sync runtime); None: batch generation."""
    refill: int | None = None
    """Prompts a stream adds at a time (``generation.refill``; default a quarter of those in flight,
    all of them in the sync runtime); None: batch generation."""
    driver_gpu: bool = False
    """The ``tba train`` process uses its GPU where Ray must not hand it out (:func:`driver_holds_gpu`)."""
    eval_actor: bool = False
    """Evaluation runs in an actor of its own, beside the trainer (``eval.async`` in the ray runtime)."""
    sampling: tuple[dict, ...] = ()
    """Each searcher's temperature, top-p and exploring range (:func:`tba.plan.generation.searcher_sampling`)."""
    explore_prob: float = 0.0
    """The share of a searcher's batches that explore (``generation.explore_prob``)."""
    ref_reset_every: int | None = None
    """TBA′: steps between two resets of the reference to the policy (``objective.ref_reset_every``), or None."""

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.device)

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def with_eos(self, ids) -> Plan:
        return dataclasses.replace(self, eos_ids=tuple(sorted(ids)))

    def in_actor(self, gpu_ids: list) -> Plan:
        """The plan as a Ray actor sees it: given GPUs (``ray.get_gpu_ids()``), Ray numbers them from
        0, so ``cuda:N`` becomes ``cuda``."""
        if gpu_ids and self.device.startswith("cuda:"):
            return dataclasses.replace(self, device="cuda")
        return self

    def with_actor_shares(self, cfg: Config, searcher_gpus: float, eval_gpus: float) -> Plan:
        """The plan with the actors' GPU shares of a cluster joined (known once joined), and its
        engines' settings for them."""
        engines = vllm_engines(cfg, self.device, searcher_gpus, eval_gpus)
        return dataclasses.replace(self, searcher_gpus=searcher_gpus, eval_gpus=eval_gpus, engines=engines)

    def to_dict(self) -> dict:
        data = dataclasses.asdict(self)
        data["eos_ids"] = list(self.eos_ids)
        data["warnings"] = list(self.warnings)
        data["sampling"] = list(self.sampling)
        return data

    @classmethod
    def from_dict(cls, data: dict) -> Plan:
        data = dict(data)
        data["hardware"] = Hardware(**data["hardware"])
        data["eos_ids"] = tuple(data.get("eos_ids", ()))
        data["warnings"] = tuple(data.get("warnings", ()))
        data["sampling"] = tuple(data.get("sampling", ()))
        return cls(**data)

    def save(self, run_dir: Path) -> Path:
        path = Path(run_dir) / PLAN_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, run_dir: Path) -> Plan:
        return cls.from_dict(json.loads((Path(run_dir) / PLAN_FILE).read_text()))

    def lines(self) -> list[str]:
        """The plan as ``tba train`` prints it at start."""
        ref = "the policy" if self.reference == self.policy else self.reference
        out = [
            f"plan: {self.runtime} runtime on {self.device} ({self.hardware.describe()}); "
            f"weights {self.dtype}, trainer {self.precision}",
            f"  policy {self.policy}; reference {ref}",
        ]
        if self.runtime == "ray":
            gpus = f", {self.searcher_gpus:g} GPU each" if self.searcher_gpus else ""
            threads = "torch's default" if self.trainer_threads is None else self.trainer_threads
            out.append(
                f"  searchers: {self.searcher_threads} thread(s){gpus}; trainer: {threads} thread(s); "
                f"weights by {self.transport.replace('_', ' ')}; lag bound {self.lag_bound}"
                + (f"; searchers at most {self.max_ahead} step(s) ahead" if self.max_ahead else "")
            )
        elif self.extra_lag:
            out.append(f"  searcher weights exactly {self.extra_lag} step(s) old (runtime.extra_lag)")
        if self.runtime == "sync" and self.trainer_threads:
            out.append(f"  threads: {self.trainer_threads} (generation and training in turns)")
        band = self.objective
        if needs(self.objective).balance:
            band = "plain TB" if self.trust_region is None else f"TB with the sequence band {self.trust_region:g}"
        out.append(sampling_line(self.sampling, self.explore_prob))
        if self.max_in_flight is not None:
            out.append(f"  stream: {self.max_in_flight} prompt(s) in flight, refilled {self.refill} at a time")
        out.append(
            f"  generation: {self.stream.replace('_', ' ')}, {self.samples_per_prompt} sample(s) a prompt; "
            f"sampler log-probs: {self.sampler_logprobs.replace('_', ' ')}; "
            f"buffer flat weight {self.flat_weight:g}, first step after {self.min_groups} group(s); {band}; "
            + ("no gradient clipping" if self.grad_clip is None else f"gradient norm clipped at {self.grad_clip:g}")
        )
        out += [f"  {key}: {reason}" for key, reason in self.why.items()]
        out += [f"  warning: {text}" for text in self.warnings]
        return out


def builtin_setting(name: str, task) -> ArithmeticTaskConfig | None:
    """The arithmetic setting a built-in model (``builtin:...``) is warm-started on: the run's task
    (``task``, its config) when it is arithmetic, else the model's default one; None for a model
    that is not built in."""
    if not name.startswith(BUILTIN_PREFIX):
        return None
    if name == TOOL_MODEL:  # warm-started on calculator traces of the arithmetic task's setting
        return task if task.name == "arithmetic" else ArithmeticTaskConfig(digits=3, operators="*")
    if name == "builtin:tiny-arithmetic":
        return task if task.name == "arithmetic" else ArithmeticTaskConfig()
    raise ConfigError(
        f"unknown built-in model {name!r}; the built-in models are builtin:tiny-arithmetic and {TOOL_MODEL}"
    )


def model_location(name: str, cfg: Config) -> str:
    """Where ``name`` (``model.policy`` or ``model.reference``) loads from, without loading or
    building anything: a hub id or path as given; a built-in model's shipped or cached folder."""
    warm = builtin_setting(name, cfg.task)
    return name if warm is None else str(builtin_location(name, warm, cfg.model.cache_dir))


def choose_runtime(cfg: Config, hardware: Hardware) -> tuple[str, str]:
    """``runtime.type: auto`` on ``hardware``: (``sync`` or ``ray``, why). Asynchrony pays where the
    searchers get devices of their own. Where they would share the trainer's one device, the two
    take turns at least as fast as they run side by side, and sync pays no staleness
    (``benchmarks/results/layouts/README.md``: 2 CPU cores; ``benchmarks/results/gpu/README.md``:
    one GPU with HF generation). On one GPU with vLLM searchers ray can be faster
    (``benchmarks/results/gpu_vllm/README.md``), but it holds the engine's memory beside the
    trainer's where sync's engine sleeps: one GPU stays sync until the plan weighs that."""
    r, e = cfg.runtime, cfg.eval
    if e.async_:
        return "ray", "eval.async evaluates in a Ray actor beside the trainer"
    if r.extra_lag or cfg.buffer.fresh_only:
        return "sync", "runtime.extra_lag / buffer.fresh_only set staleness in the sync runtime"
    if r.weight_transport != "auto" and transport(r.weight_transport).primary:
        return "ray", f"runtime.weight_transport={r.weight_transport} sends weights to searcher processes"
    if r.address:
        return "ray", f"joining the Ray cluster at {r.address}: searchers may run on other machines"
    if r.searcher_resources:
        return "ray", "runtime.searcher_resources places the searchers on chosen nodes"
    device = resolve_device_name(cfg.run.device, hardware)
    trainer_gpus = 1 if cfg.trainer.num_ranks == "auto" else cfg.trainer.num_ranks
    if device.startswith("cuda") and hardware.gpus > trainer_gpus:
        return "ray", f"{hardware.gpus - trainer_gpus} GPU(s) beyond the trainer's {trainer_gpus} for the searchers"
    shared = (
        f"the trainer's {'GPU' if hardware.gpus == 1 else f'{trainer_gpus} GPUs'}"
        if device.startswith("cuda")
        else f"this machine's {hardware.cpus} CPU core(s)"
    )
    return "sync", (
        f"searchers would share {shared} with the trainer, where generating and training in turns is "
        "faster (set runtime.type=ray to run them side by side anyway)"
    )


def _resolve_runtime(cfg: Config, hardware: Hardware) -> tuple[Config, dict[str, str]]:
    """``cfg`` with ``runtime.type: auto`` decided for ``hardware`` and the settings that follow the
    runtime (the TB band's ``auto``) validated again, then the split of the GPUs
    (:func:`tba.plan.layout.resolve`); with the reasons, for the plan's ``why``."""
    why: dict[str, str] = {}
    if cfg.runtime.type == "auto":
        kind, reason = choose_runtime(cfg, hardware)
        try:
            cfg = with_values(cfg, {"runtime.type": kind})
        except ConfigError as err:  # a rule of the chosen runtime: say what auto chose
            raise ConfigError(f"runtime.type=auto chose {kind} ({reason}); then: {err}") from None
        why["runtime"] = f"auto: {reason}"
    cfg, layout = resolve_layout(cfg, hardware, lambda: model_location(cfg.model.policy, cfg))
    return cfg, {**why, **layout}


def plan_run(cfg: Config, runtime: str | None = None, hardware: Hardware | None = None) -> tuple[Config, Plan]:
    """The config a run trains with and its plan: ``runtime.type: auto`` decided (by
    :func:`make_plan`'s rule, the one place it is), so that the objective, the buffer and the
    trainer read the runtime that runs. Given ``runtime`` (``sync`` or ``ray``: the entry point that
    was called), a config that names, or resolves to, the other runtime is refused."""
    hw = hardware or Hardware.detect(load=True)  # (a run's threads leave busy cores alone)
    resolved, why = _resolve_runtime(cfg, hw)
    if runtime is not None and resolved.runtime.type != runtime:
        how = (
            f"runtime.type=auto chose {resolved.runtime.type} ({why['runtime'].removeprefix('auto: ')})"
            if cfg.runtime.type == "auto"
            else (f"runtime.type={cfg.runtime.type}")
        )
        raise ConfigError(
            f"{how}, and this is the {runtime} runtime's entry point; set runtime.type={runtime} or run the other"
        )
    return resolved, _plan(resolved, hw, why)


def make_plan(cfg: Config, hardware: Hardware | None = None) -> Plan:
    """The plan of ``cfg`` on ``hardware`` (default: this machine's). Loads nothing; raises
    :class:`ConfigError` for a device the machine does not have. ``runtime.type: auto`` is decided
    here; a run trains with the config that decision gives (:func:`plan_run`), as every part reads
    the runtime from the config."""
    hw = hardware or Hardware.detect()
    resolved, why = _resolve_runtime(cfg, hw)
    return _plan(resolved, hw, why)


def _plan(cfg: Config, hw: Hardware, why: dict[str, str]) -> Plan:
    """The plan of ``cfg``, resolved for ``hw`` already, with the reasons the resolution gave."""
    why = dict(why)
    device = resolve_device_name(cfg.run.device, hw)
    o, r, g = cfg.objective, cfg.runtime, cfg.generation
    ray_runtime = r.type == "ray"
    searcher_gpus, eval_gpus, shares_gpu = r.searcher_gpus, cfg.eval.eval_gpus, False
    if ray_runtime and not r.address:  # a cluster's GPUs are known once joined (run_ray fills them in then)
        ray_gpus, shared = local_ray_gpus(cfg, device, hw)
        shares_gpu = shared
        searcher_gpus, eval_gpus = actor_gpu_shares(cfg, device, ray_gpus, shared)
        if device.startswith("cuda") and r.searcher_gpus is None:
            whose = "the trainer shares its one GPU" if shared else f"{ray_gpus} GPU(s) for the actors"
            why["searcher_gpus"] = f"{searcher_gpus:g} of a GPU each: {whose}"
        chosen = transport(r.weight_transport) if r.weight_transport != "auto" else None
        if chosen is not None and chosen.same_gpu and device.startswith("cuda") and not shared:
            raise ConfigError(
                f"runtime.weight_transport={chosen.name} needs searchers on the trainer's GPU, and on "
                f"{hw.gpus} GPUs the searchers get GPUs of their own; set runtime.weight_transport=broadcast "
                "(or object_store)"
            )
    band = tb_trust_region(o, stale_by_design(cfg))
    if needs(o).balance and o.tb_trust_region == "auto":
        why["trust_region"] = (
            "the sequence band, as the searchers' weights lag by design"
            if band is not None
            else "plain TB: the searcher's weights are the newest in the sync runtime"
        )
    if ray_runtime and r.max_lag == "auto":
        why["lag_bound"] = f"4 x trainer.sync_interval ({cfg.trainer.sync_interval})"
    threads, why["trainer_threads"] = planned_threads(cfg, hw, ray_runtime)
    if why["trainer_threads"] is None:
        del why["trainer_threads"]
    ranks = cfg.trainer.num_ranks > 1
    rank_share = rank_cpus(cfg, hw.cpus) if ranks else None
    rank_threads = max(1, int(rank_share)) if rank_share else None
    searcher_threads = max(1, int(r.searcher_cpus))
    crowded = oversubscription(cfg, hw.cpus, threads, searcher_threads, rank_threads) if ray_runtime else None
    if not needs_sampler_logps(o, band):
        logprobs = "none"
    elif g.backend == "vllm":
        logprobs = "engine"  # the engine's raw log-probs of what it sampled
    else:
        # TB's corrections take the sampling pass's; a ratio must start at 1: a second, teacher-forced pass
        logprobs = "sampling_pass" if needs(o).balance else "teacher_forced"
    policy = model_location(cfg.model.policy, cfg)  # (a shipped model's weights are hashed: once)
    stream = stream_kind(cfg, device, exact=not ray_runtime)
    return Plan(
        hardware=hw,
        device=device,
        dtype=resolve_dtype_name(cfg.model.dtype, device, hw),
        precision=resolve_precision_name(cfg.trainer.precision, device, hw),
        policy=policy,
        reference=model_location(cfg.model.reference, cfg) if cfg.model.reference else policy,
        runtime=r.type,
        objective=o.type,
        transport=weight_transport(r.weight_transport, ray_runtime),
        stream=stream,
        exact_stream=not ray_runtime,
        lag_bound=lag_bound(r, cfg.trainer.sync_interval) if ray_runtime else None,
        extra_lag=r.extra_lag,
        flat_weight=flat_weight(cfg.buffer, r.type),
        trust_region=band,
        grad_clip=grad_clip(cfg.trainer, o),
        sampler_logprobs=logprobs,
        trainer_threads=threads,
        searcher_threads=searcher_threads,
        rank_threads=rank_threads,
        rank_cpus=rank_share,
        searcher_gpus=searcher_gpus,
        eval_gpus=eval_gpus,
        shares_gpu=shares_gpu,
        engines=vllm_engines(cfg, device, searcher_gpus, eval_gpus),
        why=why,
        max_ahead=r.max_ahead if ray_runtime else None,
        replay_window=replay_window(cfg) if ray_runtime else None,
        warnings=(crowded,) if crowded else (),
        min_groups=cfg.buffer.min_groups or cfg.trainer.batch_prompts,
        samples_per_prompt=g.samples_per_prompt or g.group_size,
        **stream_sizes(cfg, stream),
        driver_gpu=driver_holds_gpu(cfg, device),
        eval_actor=ray_runtime and cfg.eval.async_,
        sampling=searcher_sampling(cfg),
        explore_prob=g.explore_prob,
        ref_reset_every=o.ref_reset_every if needs(o).moves_reference(o) else None,
    )
