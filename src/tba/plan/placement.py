"""Where each process of a run sits: the CPU threads and GPU shares of the trainer, its ranks, the
searchers and the evaluation actor, and whether together they ask for more cores than the machine
has. The run plan (:func:`tba.plan.core.make_plan`) calls these; they load nothing but a resumed
run's saved plan.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tba.config import Config, ConfigError
from tba.hardware import Hardware


def searcher_cpus(cfg: Config) -> float:
    """The CPUs that the ray runtime reserves for its searchers and its evaluation actor."""
    r = cfg.runtime
    return r.num_searchers * r.searcher_cpus + (cfg.eval.eval_cpus if cfg.eval.async_ else 0)


def rank_cpus(cfg: Config, cpus: int) -> float:
    """``runtime.rank_cpus``, by default the ``cpus`` that searchers and evaluation leave (one kept
    for the ``tba train`` process in the sync runtime, which generates), split over the ranks."""
    r = cfg.runtime
    if r.rank_cpus is not None:
        return r.rank_cpus
    taken = searcher_cpus(cfg) if r.type == "ray" else 1
    return round(max(1.0, cpus - taken) / cfg.trainer.num_ranks, 4)


def trainer_threads(cfg: Config, cpus: int) -> int:
    """The ray runtime's trainer: ``runtime.trainer_cpus``, else the local cores the searchers (and
    ranks) leave; joining a cluster, every local core (the searchers may be elsewhere)."""
    if cfg.runtime.trainer_cpus:
        return cfg.runtime.trainer_cpus
    if cfg.runtime.address:
        return cpus
    taken = searcher_cpus(cfg)
    if cfg.trainer.num_ranks > 1:  # the ranks train; this process evaluates and saves
        taken += cfg.trainer.num_ranks * rank_cpus(cfg, cpus)
    return max(1, int(cpus - taken))


def planned_threads(cfg: Config, hw: Hardware, ray_runtime: bool) -> tuple[int | None, str | None]:
    """The torch threads of the ``tba train`` process (None: torch's default, every usable core) and
    why, where the plan chose them. ``run.threads`` if set. A resumed run keeps the threads it
    started with (:func:`started_threads`): the count changes how sums round, and so every number
    after. The ray runtime's trainer gets the cores that its searchers leave (:func:`trainer_threads`).
    Cores that other processes keep busy at the start are left to them: beside a busy process,
    threads on its core wait on each other through its time slices
    (``benchmarks/results/load/README.md`` measures it)."""
    if cfg.run.threads:
        return cfg.run.threads, None
    known, started = started_threads(cfg)
    if known:
        return started, "as the run started: a resumed run keeps its threads, which decide how its sums round"
    busy, free = hw.busy_cpus, max(1, hw.cpus - hw.busy_cpus)
    others = f"the {busy} kept busy by other processes at the start" if busy else ""
    if ray_runtime:
        if cfg.runtime.trainer_cpus:
            return cfg.runtime.trainer_cpus, None
        if cfg.runtime.address:
            less = f", less {others}" if busy else ""
            return trainer_threads(cfg, free), f"the {hw.cpus} local core(s){less}: searchers may run elsewhere"
        less = f"the searchers' {searcher_cpus(cfg):g}" + (f" and {others}" if busy else "")
        return trainer_threads(cfg, free), f"the {hw.cpus} core(s) less {less}"
    if not busy:
        return None, None
    return (
        free,
        f"the {hw.cpus} core(s) less {others}: threads that share a core with another process wait on each other",
    )


def started_threads(cfg: Config) -> tuple[bool, int | None]:
    """With ``run.resume``, whether its run directory's plan says which threads the run started
    with, and those (None: torch's default); ``(False, None)`` for a new run or a directory
    without a plan."""
    if not cfg.run.resume:
        return False, None
    try:
        saved = json.loads((Path(cfg.run.output_dir).expanduser() / cfg.run.name / "plan.json").read_text())
    except (OSError, ValueError):
        return False, None
    return "trainer_threads" in saved, saved.get("trainer_threads")


def share_of(actors: int, gpus: float, with_trainer: bool) -> float:
    """One actor's share when ``actors`` share ``gpus`` GPUs (and the trainer too, on the only GPU,
    when ``with_trainer``): a whole GPU each if there are enough, else 1/n of one with n per GPU."""
    if with_trainer:
        return 1.0 / (actors + 1)
    per_gpu = math.ceil(actors / int(gpus))
    return 1.0 if per_gpu == 1 else 1.0 / per_gpu


def actor_gpu_shares(cfg: Config, device: str, ray_gpus: float, trainer_gpu_shared: bool) -> tuple[float, float]:
    """(``runtime.searcher_gpus``, ``eval.eval_gpus``): as given, else derived from the GPUs Ray has
    (``ray_gpus``; ``trainer_gpu_shared``: they are the trainer's one GPU). A CPU run gives actors no
    GPU. Raises :class:`ConfigError` for a CUDA run whose actors would get none."""
    r, e = cfg.runtime, cfg.eval
    searcher, evaluation = r.searcher_gpus, e.eval_gpus
    if not device.startswith("cuda"):
        return searcher or 0.0, evaluation or 0.0
    wanted = [("runtime.searcher_gpus", searcher)] + ([("eval.eval_gpus", evaluation)] if e.async_ else [])
    for key, value in wanted:
        if value == 0:
            raise ConfigError(
                f"{key}=0 on a CUDA run (run.device={cfg.run.device}): Ray gives an actor that asks for no GPU "
                "none of its own (it sees no GPU, or all of them uncounted, by Ray's version). Give it a share "
                f"(e.g. {key}=0.5) or leave it unset"
            )
    actors = (r.num_searchers if searcher is None else 0) + (1 if e.async_ and evaluation is None else 0)
    if actors:
        free = ray_gpus - (cfg.trainer.num_ranks if cfg.trainer.num_ranks > 1 else 0)
        if free < 1:
            raise ConfigError(
                f"run.device={cfg.run.device}: Ray has {ray_gpus:g} GPU(s) and the trainer ranks take "
                f"{cfg.trainer.num_ranks}, leaving none for the searchers{' and evaluation' if e.async_ else ''}; "
                "set runtime.searcher_gpus (and eval.eval_gpus) to share theirs, or lower trainer.num_ranks"
            )
        share = share_of(actors, free, trainer_gpu_shared and cfg.trainer.num_ranks == 1)
        searcher = share if searcher is None else searcher
        evaluation = share if evaluation is None and e.async_ else evaluation
    return searcher, evaluation or 0.0


def driver_holds_gpu(cfg: Config, device: str) -> bool:
    """Whether the ``tba train`` process uses a GPU that Ray must not hand out: it trains (and in the
    sync runtime with ranks, generates and keeps the policy copy) on ``device``; the ray runtime
    with trainer ranks keeps its copy on the CPU."""
    return device.startswith("cuda") and not (cfg.runtime.type == "ray" and cfg.trainer.num_ranks > 1)


def local_ray_gpus(cfg: Config, device: str, hardware: Hardware) -> tuple[int, bool]:
    """The GPUs a local Ray instance gets, and whether they are the trainer's own one: every GPU
    but the trainer's when there are several (see :mod:`tba.runtime.cluster`)."""
    total = hardware.gpus * hardware.nodes  # (a described cluster's: every node's)
    if driver_holds_gpu(cfg, device) and total >= 2:
        return total - 1, False
    return total, total == 1


def local_threads(cfg: Config, trainer: int, searcher: int, rank_threads: int | None) -> list[tuple[str, int]]:
    """The ray runtime's CPU threads on this machine, as (what, how many): the trainer's, and on a
    local Ray instance its searchers', evaluation's and ranks' (joining a cluster they may run
    elsewhere). ``trainer``, ``searcher``, ``rank_threads``: each process's threads, as the plan gives them."""
    parts = [(f"the trainer's {trainer}", trainer)]
    if cfg.runtime.address:
        return parts
    searchers = cfg.runtime.num_searchers * searcher
    parts.append((f"the searchers' {searchers}", searchers))
    if cfg.eval.async_:
        evaluation = max(1, int(cfg.eval.eval_cpus))
        parts.append((f"evaluation's {evaluation}", evaluation))
    if rank_threads and cfg.trainer.num_ranks > 1:
        ranks = cfg.trainer.num_ranks * rank_threads
        parts.append((f"the ranks' {ranks}", ranks))
    return parts


def oversubscription(cfg: Config, cpus: int, trainer: int, searcher: int, rank_threads: int | None) -> str | None:
    """A warning when the ray runtime's processes on this machine ask for more CPU threads than it
    has cores (``trainer``, ``searcher``, ``rank_threads``: the threads of the trainer, of each
    searcher and of each rank, as the plan gives them), else None; the caller asks for the ray
    runtime only. Not an error, as a user may mean it; but a trainer given every core beside a
    searcher slows that searcher's weight load into vLLM many times over
    (``benchmarks/results/layouts/README.md``). Joining a cluster, the searchers may run elsewhere: no
    warning."""
    if cfg.runtime.address:
        return None
    parts = local_threads(cfg, trainer, searcher, rank_threads)
    total = sum(n for _, n in parts)
    if total <= cpus:
        return None
    names = [name for name, _ in parts]
    asked = ", ".join(names[:-1]) + f" and {names[-1]}"
    return (
        f"{asked} threads ask for {total} of this machine's {cpus} core(s), and processes that share cores "
        "slow each other; lower runtime.trainer_cpus (or run.threads) and runtime.searcher_cpus, or leave "
        "runtime.type=auto to generate and train in turns"
    )
