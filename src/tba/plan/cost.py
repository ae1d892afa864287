"""A cost model of a layout: seconds per step, the trainer's busy fraction and the mean lag of a run,
predicted from measured parts before a model loads or a machine is rented.

Two levels. :func:`predict` composes the seconds of a step's parts (:class:`StepParts`: a searcher's
batch, a trainer step, a publication, a load) into a layout's step (:class:`Layout`: sync or ray, S
searchers, R trainer ranks, whether they share the trainer's GPU). :func:`gpu_parts` gives those
seconds for a model size on a GPU from the parts file (``parts.json``: each entry measured by a tba
benchmark with its machine, published by others, or assumed, and said which). On CPUs the parts
are measured per setting (``benchmarks/bench_parts.py``) and passed in directly.

What the composition assumes, in one place:

- **sync**: a step generates one searcher batch (``generation.prompts_per_batch`` prompts), trains
  on a batch from the buffer and loads the new weights in process, in turn.
- **ray**: the trainer steps when a step's data is there; with ``trainer.max_replay_ratio`` at 1 the
  searchers' data bounds it: step = max(trainer step, a step's completions / the searchers' rate).
  A searcher's batch starts with a load of new weights when a publication came since its last one.
- **A shared GPU** (searchers on the trainer's one GPU): each slows the other by the measured
  factors of ``shared_gpu``; on separate devices nothing is shared.
- **Shared cores** (a machine without GPUs, where every process of the run computes on the same
  ``cores``): each part's CPU seconds (every thread's, measured beside its wall seconds) say how
  many cores it keeps busy. A part's CPU seconds are the same with any number of threads, and each
  thread keeps as much of a core busy as it did when measured: with other threads, its seconds
  scale by the ratio. The trainer (``tba train``, nice 0) keeps the cores it uses: Ray starts its
  workers at nice 15 (``RAY_worker_niceness``), whose CFS weight is 36 against 1024. The searchers
  (which generate without pause, ``runtime.max_ahead`` unset) share the cores the trainer leaves
  while it steps, every core while it waits; where they ask for more, each batch is slowed by what
  they ask over what they get. Ray's own processes (its scheduler, the inbox actor) are not counted.
- **The lag bound** (``runtime.max_lag``): the trainer knows a searcher's weights from its last
  delivered batch, generated with the version it held a batch earlier, so it takes at most that many
  steps over two of a searcher's batches: a step lasts at least two batches' seconds over the bound
  (``benchmarks/results/scale/README.md`` holds it to 32 stand-in searchers under a bound of 32).
- **Lag** (in steps, of fresh data): a batch trained as it lands is as old as its generation took
  in steps, plus half a publication interval. Replay of older groups under a surplus is not
  modelled (the buffer's sampling decides it).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path

from tba.weights.transports import transport as transport_named

PARTS_FILE = Path(__file__).with_name("parts.json")


@lru_cache(maxsize=1)
def parts() -> dict:
    """The parts file (``parts.json`` beside this module)."""
    return json.loads(PARTS_FILE.read_text())


@dataclass(frozen=True)
class StepParts:
    """Seconds of a step's parts, each on the resources its process has, alone."""

    generate_s: float
    """A searcher's batch: generation, rewards, reference log-probs."""
    train_s: float
    """A trainer step (its ranks' communication included)."""
    load_s: float
    """A searcher's fetch and load of one publication."""
    publish_s: float = 0.0
    """A publication's seconds on the trainer's path (off it, by a background thread: about 0)."""
    overhead_s: float = 0.0
    """The runtime's own seconds in a trainer step (ingesting groups, the buffer, the board)."""
    generate_cpu_s: float = 0.0
    """A searcher's batch in CPU seconds, every thread's (0: not measured; only shared cores use it)."""
    train_cpu_s: float = 0.0
    """The trainer process's CPU seconds a step, every thread's, generation left out (0: not measured)."""
    generate_threads: int = 0
    """The torch threads a searcher's batch was measured with (0: not known)."""
    train_threads: int = 0
    """The torch threads the trainer's step was measured with (0: not known)."""


@dataclass(frozen=True)
class Layout:
    runtime: str
    """``sync`` or ``ray``."""
    completions_per_step: int
    """``trainer.batch_prompts`` x ``generation.group_size``."""
    completions_per_batch: int
    """A searcher's batch: ``generation.prompts_per_batch`` x ``generation.group_size``."""
    searchers: int = 1
    ranks: int = 1
    shared: bool = False
    """The searchers share the trainer's GPU (one GPU for all)."""
    sync_interval: int = 1
    lag_bound: int | None = None
    """``runtime.max_lag`` resolved (None: no bound)."""
    cores: int | None = None
    """The cores every process of the run shares (a machine without GPUs); None: each has its own."""
    trainer_threads: int | None = None
    """The trainer process's torch threads (None: as many as it had when its parts were measured)."""
    searcher_threads: int | None = None
    """Each searcher process's torch threads (None: as many as when its parts were measured)."""


@dataclass(frozen=True)
class Prediction:
    step_s: float
    trainer_busy: float
    """The fraction of the step the trainer computes (1 in sync, where it also generates)."""
    lag_mean: float
    """Mean age in steps of the data trained (fresh data; see the module's assumptions)."""
    bound: str
    """What sets the pace: ``trainer``, ``searchers``, ``lag`` (the lag bound holds the trainer while
    a batch is generated) or ``turns`` (sync)."""
    parts: dict[str, float] = field(default_factory=dict)

    @property
    def steps_per_s(self) -> float:
        return 1.0 / self.step_s

    def describe(self) -> str:
        return (
            f"{self.step_s:.3g} s a step ({self.bound}-bound), trainer busy {self.trainer_busy:.2f}, "
            f"mean lag {self.lag_mean:.2g} step(s)"
        )


def predict(p: StepParts, layout: Layout, shared_gpu: dict | None = None) -> Prediction:
    """The step of ``layout`` with the seconds of ``p``; ``shared_gpu`` (default: the parts file's)
    gives how much a searcher and the trainer slow each other on one GPU."""
    c_step, c_batch, k = layout.completions_per_step, layout.completions_per_batch, layout.sync_interval
    if layout.runtime == "sync":  # one batch a step, whatever the trainer's batch draws from the buffer
        generate, train = p.generate_s, p.train_s
        if layout.cores:  # generation and training on the process's threads
            generate = _threaded(p.generate_s, p.generate_cpu_s, p.generate_threads, layout.trainer_threads)[0]
            train = _threaded(p.train_s, p.train_cpu_s, p.train_threads, layout.trainer_threads)[0]
        step = generate + train + p.overhead_s + (p.publish_s + p.load_s) / k
        info = {"generate_s": generate, "train_s": train, "load_s": p.load_s / k}
        return Prediction(step, 1.0, (k - 1) / 2, "turns", info)
    slow = shared_gpu or parts()["shared_gpu"]
    gen_slow, train_slow = (1 / slow["generation"], slow["trainer"]) if layout.shared else (1.0, 1.0)
    trainer = (p.train_s + p.publish_s / k) * train_slow + p.overhead_s
    generate, on, off = p.generate_s * gen_slow, 1.0, 1.0
    if layout.cores and p.generate_cpu_s > 0 and p.train_cpu_s > 0:
        trainer, generate, on, off = _on_shared_cores(p, layout, trainer)
    batches = c_step / (layout.searchers * c_batch)  # each searcher's batches a step
    # a batch starts with a load when a publication came since the last: at most every batch
    batch, step = generate * on + p.load_s, trainer
    for _ in range(200):  # the fraction of batches that load depends on the step: a fixed point
        loads = min(1.0, batch / (k * step))
        new_batch = generate * on + p.load_s * loads
        # the searchers make a step's data at their share of the cores beside the trainer's step,
        # and, for what is left when it ends, at their share alone
        made = trainer / new_batch
        data = new_batch * batches
        if made < batches:
            data = trainer + (generate * off + p.load_s * loads) * (batches - made)
        held = 2 * new_batch / layout.lag_bound if layout.lag_bound else 0.0
        new = max(trainer, data, held)
        settled = abs(new - step) < 1e-12 * new and abs(new_batch - batch) < 1e-12 * new_batch
        batch, step = new_batch, new
        if settled:
            break
    loads = min(1.0, batch / (k * step))
    bound = max((trainer, "trainer"), (data, "searchers"), (held, "lag"))[1]
    info = {"generate_s": batch, "train_s": trainer, "data_s": data, "loads_per_batch": loads}
    return Prediction(step, min(1.0, trainer / step), batch / step + (k - 1) / 2, bound, info)


NICE_SHARE = 36 / 1024
"""A nice-15 thread's CFS weight against a nice-0 one's: what a searcher gets of a core the trainer computes on."""


def _threaded(wall_s: float, cpu_s: float, measured: int, threads: int | None) -> tuple[float, float]:
    """A part's seconds alone and the cores it keeps busy with ``threads`` torch threads, from its
    seconds and CPU seconds measured with ``measured`` threads: the same CPU seconds, each thread
    as busy as it was (unknown threads: as measured)."""
    busy = cpu_s / wall_s if wall_s > 0 else 0.0
    if not (measured and threads) or measured == threads:
        return wall_s, busy
    return wall_s * measured / threads, busy * threads / measured


def _on_shared_cores(p: StepParts, layout: Layout, trainer_s: float) -> tuple[float, float, float, float]:
    """The trainer's step and a searcher's batch alone with the layout's threads, and how much
    slower a searcher's batch is on ``layout.cores`` while the trainer steps (``on``: the cores it
    leaves) and while it waits (``off``: every core)."""
    trainer, trainer_cores = _threaded(trainer_s, p.train_cpu_s, p.train_threads, layout.trainer_threads)
    generate, searcher_cores = _threaded(p.generate_s, p.generate_cpu_s, p.generate_threads, layout.searcher_threads)
    asked = layout.searchers * searcher_cores
    left = cores_left(layout.cores, trainer_cores)
    return trainer, generate, max(1.0, asked / left), max(1.0, asked / layout.cores)


def cores_left(cores: float, trainer_cores: float) -> float:
    """The cores the searchers get while the trainer computes on ``trainer_cores`` of ``cores``:
    the rest, and a nice-15 share of the trainer's."""
    return max(cores - trainer_cores, 0.0) + min(trainer_cores, cores) * NICE_SHARE


# ---- parts on a GPU, from the parts file ---------------------------------------------------------


@dataclass(frozen=True)
class Workload:
    """What a step asks of the devices: the model's size and the tokens of its sequences."""

    params: float
    layers: int
    prompt_tokens: float
    completion_tokens: float
    completions_per_batch: int
    completions_per_step: int
    engine: str = "vllm"
    """``vllm`` or ``hf``: the searchers' generation (eager: the measured engines ran eager)."""

    @property
    def weight_gb(self) -> float:
        return 2 * self.params / 1e9  # published in bf16


def device_parts(name: str) -> dict:
    devices = parts()["devices"]
    if name not in devices:
        raise KeyError(f"no parts for the device {name!r}; the parts file has {', '.join(sorted(devices))}")
    return devices[name]


def _nearest(entries: list[dict], device: str, **match) -> dict:
    """The entry measured on ``device`` that matches, else one measured elsewhere (scaled by the
    caller by the devices' published figures)."""
    found = [e for e in entries if all(e.get(k) == v for k, v in match.items())]
    if not found:
        raise KeyError(f"no measured part for {match}")
    same = [e for e in found if e["device"] == device]
    return (same or found)[0]


def train_mfu(device: str, params: float | None = None) -> float:
    """The fraction of ``device``'s peak a trainer step reaches (6 FLOPs a parameter a token): the
    measured step's (a device with no measurement takes the nearest measured one's), rising in
    log(parameters) to ``train_at_scale``'s published figure at its size (larger matrices keep the
    device busier), and no further."""
    e = _nearest(parts()["train"], device)
    measured = 6 * e["params"] * e["tokens"] / (e["step_s"] * device_parts(e["device"])["bf16_tflops"] * 1e12)
    if params is None or params <= e["params"]:
        return measured
    top = parts()["train_at_scale"]
    reach = min(1.0, math.log(params / e["params"]) / math.log(top["params"] / e["params"]))
    return measured + (max(top["mfu"], measured) - measured) * reach


def decode_step_s(device: str, w: Workload, in_flight: int, share: int = 1) -> float:
    """Seconds of one decode step of ``in_flight`` sequences, with ``share`` engines on the GPU.

    A step takes the longer of the host's work and the device's. The host launches each layer's
    kernels (a floor per layer, taken from the measured point, where the host sets the pace: so it
    is the eager engine's) and schedules and samples each sequence (``decode_per_sequence_s``); the
    device reads the weights once (2 bytes a parameter, at its memory's bandwidth) and computes
    each sequence's matrix products (at ``decode_mfu`` of its peak), for every engine on the GPU."""
    dev = device_parts(device)
    m = _nearest(parts()["decode"], device, engine=w.engine)
    per_seq = parts()["decode_per_sequence_s"]["value"]
    mfu = parts()["decode_mfu"]["value"]
    floor_per_layer = (m["in_flight"] / m["tokens_per_s"] - m["in_flight"] * per_seq) / m["layers"]
    host = floor_per_layer * w.layers + in_flight * per_seq
    weights = 2 * w.params / (dev["memory_tb_s"] * 1e12)
    compute = 2 * w.params / (mfu * dev["bf16_tflops"] * 1e12)
    return max(host, share * (weights + in_flight * compute))


def gpu_parts(
    device: str,
    w: Workload,
    transport: str,
    ranks: int = 1,
    searchers_per_gpu: int = 1,
    remote: float = 0.0,
    remote_nodes: int = 0,
) -> StepParts:
    """The seconds of a step's parts for ``w`` on ``device`` GPUs: a searcher's batch on its GPU
    (``searchers_per_gpu`` engines sharing it), the trainer step on ``ranks`` GPUs of one node (FSDP:
    the step split, the weights gathered twice and the gradients reduced once over NVLink), and
    ``transport``'s publication and load, over the network for the ``remote`` fraction of the
    searchers that run on other nodes: each of the ``remote_nodes`` (at least one) fetches one copy
    of a publication (the object store keeps one a node), through the trainer node's one link,
    which they share."""
    dev, p = device_parts(device), parts()
    peak = dev["bf16_tflops"] * 1e12
    mfu = train_mfu(device, w.params)
    n = w.completions_per_batch
    decode = w.completion_tokens * decode_step_s(device, w, n, searchers_per_gpu)
    # prefill and the reference model's log-probs: forward passes (2 FLOPs a parameter a token)
    forwards = n * (w.prompt_tokens + (w.prompt_tokens + w.completion_tokens)) * 2 * w.params / (mfu * peak)
    generate = decode + forwards * searchers_per_gpu
    tokens = w.completions_per_step * (w.prompt_tokens + w.completion_tokens)
    train = tokens * 6 * w.params / (mfu * peak) / ranks
    if ranks > 1:
        train += 3 * w.weight_gb * (ranks - 1) / ranks / p["interconnect_gb_s"]["nvlink"]
    t = p["weights"][transport]
    load = t.get("fixed_s", 0.0) + w.weight_gb * t["load_s_per_gb"]
    load += remote * max(1, remote_nodes) * w.weight_gb / p["weights"]["network_gb_s"]["value"]
    overhead = w.completions_per_step * p["runtime"]["trainer_s_per_completion"]
    # what a publication costs the trainer's own step: nothing where the searcher reads its copy in place
    on_path = p["weights"]["on_trainer_path_s"]["value"] if transport_named(transport).to_processes else 0.0
    return StepParts(generate, train, load, publish_s=on_path, overhead_s=overhead)


def trainer_fits(device: str, params: float, ranks: int) -> bool:
    """Whether the trainer's state (``trainer_bytes_per_param``, sharded over ``ranks``) takes at
    most 70% of a GPU's memory, leaving the rest for activations."""
    per = parts()["trainer_bytes_per_param"]["value"]
    return per * params / ranks <= 0.7 * device_parts(device)["memory_gb"] * 1e9


def searchers_fit(device: str, params: float, per_gpu: int) -> bool:
    """Whether ``per_gpu`` searchers' engines and reference models take at most half a GPU's
    memory (the rest their KV caches)."""
    per = parts()["searcher_bytes_per_param"]["value"]
    return per_gpu * per * params <= 0.5 * device_parts(device)["memory_gb"] * 1e9


def gpu_kind(name: str) -> str | None:
    """The parts file's device for a GPU's name as CUDA reports it (``NVIDIA H100 80GB HBM3``):
    None for a GPU it has no parts for."""
    low = name.lower()
    for key in parts()["devices"]:
        if key in low:
            return key
    return None
