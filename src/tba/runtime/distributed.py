"""The asynchronous runtime on Ray: the "A" of TBA.

    searcher actors (each its own process):     trainer (this process):
      loop: pull newest weights if any            wait once for min_groups of data
            generate, reward, reference logps     loop: drain what arrived into the buffer
            send groups to the inbox                    sample a batch → objective → step
                                                        every k steps publish weights

Neither loop waits for the other after the initial fill. Groups travel through a small ``Inbox``
actor (searchers append, the trainer takes everything at once), weights through a
``WeightBoard`` actor that holds a reference to the newest state dict in Ray's object store:
publishing is one ``ray.put`` and a tiny call, so a slow or dead searcher cannot block it.
Searchers check between two generation batches whether a newer version exists.

Without ``runtime.address`` a local Ray instance is started (dashboard off, bound to localhost)
and shut down at the end; with an address the run joins that cluster and places searchers by
their resources. torch thread counts follow the CPUs given to each process, so a 2-core machine
runs one trainer thread and one searcher thread instead of four fighting over two cores.

A searcher whose process dies is restarted (``tba.runtime.restarts``); one that raises ends the
run. A local instance is watched by ``tba.runtime.watchdog``, which stops this run's Ray
processes if ``tba train`` is killed outright; SIGTERM stops a run like Ctrl-C does.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import ray
import torch
from rich.console import Console

from tba import allocator
from tba.config import Config
from tba.console import RunDisplay
from tba.errors import interrupt_on_sigterm
from tba.evaluation import write_samples
from tba.metrics import MetricsLogger
from tba.models.loading import resolve_device
from tba.models.precision import PeakMemory
from tba.plots import plot_run
from tba.runtime import watchdog as watchdog_module
from tba.runtime.bounds import Starvation, StepGate
from tba.runtime.common import (
    eval_key,
    evaluate_policy,
    log_errors,
    open_run,
    print_summary,
    resume,
    save,
    write_summary,
)
from tba.runtime.components import Components, build_components, build_searcher, seed_everything
from tba.runtime.eval_actor import BackgroundEvaluation, Finished
from tba.runtime.gpus import actor_config, driver_device, gpu_shares, one_engine_at_a_time, searcher_gpu_ids
from tba.runtime.ranks import rank_cpus, searcher_cpus
from tba.runtime.restarts import SearcherPool
from tba.weights import to_host

# Counters that a restarted searcher starts again from zero: the inbox adds what its earlier
# incarnations had counted, so the run's totals keep growing.
_CUMULATIVE = (
    "searcher/completions",
    "searcher/empty_completions",
    "searcher/unfinished",
    "searcher/dropped_groups",
    "searcher/reward_errors",
    "searcher/reward_non_finite",
    "searcher/no_reward",
    "tokens",
    "elapsed_s",
)


@ray.remote(num_cpus=0)
class WeightBoard:
    """The newest published weights: a version and an object-store reference."""

    def __init__(self) -> None:
        self.version = -1
        self.ref = None

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def set(self, version: int, boxed_ref: list) -> None:
        if version > self.version:  # a list keeps Ray from resolving the reference on the way in
            self.version, self.ref = version, boxed_ref[0]

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def get_if_newer(self, version: int):
        return (self.version, [self.ref]) if self.version > version else None


class RayWeightStore:
    """The ``WeightStore`` interface over a ``WeightBoard`` actor, usable from any process."""

    def __init__(self, board) -> None:
        self.board = board

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        ref = ray.put(to_host(state_dict))
        ray.get(self.board.set.remote(version, [ref]))

    def latest_version(self) -> int:
        newest = ray.get(self.board.get_if_newer.remote(-1))
        return -1 if newest is None else newest[0]

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        newest = ray.get(self.board.get_if_newer.remote(newer_than))
        if newest is None:
            return None
        version, (ref,) = newest
        return version, ray.get(ref)


@ray.remote(num_cpus=0)
class Inbox:
    """Groups on their way from searchers to the trainer, and each searcher's latest counters."""

    def __init__(self) -> None:
        self.groups: list = []
        self.stats: dict[int, dict] = {}
        self.errors: list[str] = []  # kept until drained: a newer put must not overwrite them
        self.carried: dict[int, dict[str, float]] = {}  # counts of a searcher's earlier incarnations
        self.running = True

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def put(self, searcher_id: int, groups: list, stats: dict, errors: list[str]) -> bool:
        self.groups.extend(groups)
        last = self.stats.get(searcher_id)
        if last is not None and last["incarnation"] != stats["incarnation"]:  # a restarted searcher
            self.carried[searcher_id] = {k: last[k] for k in _CUMULATIVE if k in last}
        carried = self.carried.get(searcher_id, {})
        self.stats[searcher_id] = {**stats, **{k: stats[k] + v for k, v in carried.items() if k in stats}}
        self.errors.extend(errors)
        return self.running  # False tells the searcher to stop

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def drain(self) -> tuple[list, dict[int, dict], list[str]]:
        groups, self.groups = self.groups, []
        errors, self.errors = self.errors, []
        return groups, dict(self.stats), errors

    def stop(self) -> None:
        self.running = False


@ray.remote
class SearcherWorker:
    def __init__(self, cfg_data: dict, searcher_id: int, names: tuple[str, str], threads: int, driver_cwd: str = ""):
        # The board and the inbox are found by name: an actor handle among the constructor's
        # arguments makes Ray warn on every run that a restart might fail (ray-project/ray#53727).
        board, inbox = (ray.get_actor(name) for name in names)
        torch.set_num_threads(threads)
        if driver_cwd and os.path.isdir(driver_cwd) and driver_cwd not in sys.path:
            sys.path.insert(0, driver_cwd)  # reward functions named as pkg.module:fn import as they do in tba train
        cfg = actor_config(cfg_data, ray.get_gpu_ids())
        seed_everything(cfg.run.seed + 1000 * (searcher_id + 1))
        self.searcher = build_searcher(cfg, RayWeightStore(board), searcher_id, log=lambda msg: None)
        self.inbox = inbox
        self.node = ray.get_runtime_context().get_node_id()
        self.incarnation = uuid.uuid4().hex  # a restart after a crash is a new incarnation

    def run(self) -> int:
        """Generate until the trainer says stop; returns the number of batches generated."""
        start, batches = time.perf_counter(), 0
        while True:
            groups = self.searcher.step()
            batches += 1
            s = self.searcher.stats
            stats = {
                **self.searcher.metrics(),
                "tokens": s.tokens,
                "elapsed_s": time.perf_counter() - start,
                "node": self.node,
                "incarnation": self.incarnation,
            }
            errors = self.searcher.new_errors()
            if not ray.get(self.inbox.put.remote(self.searcher.searcher_id, groups, stats, errors)):
                return batches


def _init_ray(cfg: Config, trainer_device: torch.device | None = None) -> bool:
    """Join the configured cluster, or start a local instance; True if we started it. A local
    instance gets every GPU but the trainer's when the machine has several (:func:`tba.runtime.gpus.searcher_gpu_ids`):
    Ray hands GPUs out without knowing that this process trains on one."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if cfg.runtime.address:
        ray.init(address=cfg.runtime.address, **quiet)
        return True  # our connection; ray.shutdown() disconnects without stopping the cluster
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count() if trainer_device is not None and trainer_device.type == "cuda" else 0
    others = searcher_gpu_ids(trainer_device or torch.device("cpu"), visible, count)
    if others is not None:  # Ray's node manager reads the variable when it starts; this process keeps its own
        os.environ["CUDA_VISIBLE_DEVICES"] = others
    try:  # "local": a new instance even when another runs on this machine (Ray would join the latest)
        ray.init(address="local", num_cpus=os.cpu_count(), _node_ip_address="127.0.0.1", **quiet)
    finally:
        if others is not None:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return True


def _start_watchdog(cfg: Config) -> subprocess.Popen | None:
    """The watchdog of a local Ray instance this run is about to start (none when joining a cluster)."""
    if cfg.runtime.address or ray.is_initialized() or not sys.platform.startswith("linux"):
        return None
    proc = subprocess.Popen(
        [sys.executable, watchdog_module.__file__, "--pid", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,  # a signal to our process group leaves it running to clean up after us
    )
    proc.stdout.readline()  # "ready": it knows which processes existed before Ray's
    return proc


def _stop_watchdog(proc: subprocess.Popen | None) -> None:
    """Closing its stdin ends the run for the watchdog: it stops what Ray's shutdown left, then exits."""
    if proc is not None:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def _trainer_threads(cfg: Config) -> int:
    if cfg.runtime.trainer_cpus:
        return cfg.runtime.trainer_cpus
    if cfg.runtime.address:  # searchers may be elsewhere: use this machine
        return os.cpu_count() or 1
    taken = searcher_cpus(cfg)
    if cfg.trainer.num_ranks > 1:  # the ranks train; this process evaluates and saves
        taken += cfg.trainer.num_ranks * rank_cpus(cfg)
    return max(1, int((os.cpu_count() or 1) - taken))


@contextlib.contextmanager
def ray_session(cfg: Config):
    """Ray for a runtime that needs it only for its trainer ranks (the sync runtime with
    ``trainer.num_ranks`` > 1): join ``runtime.address`` or start a local instance (watched, like the
    ray runtime's), SIGTERM unwinding the run; shut down at the end."""
    watchdog = _start_watchdog(cfg)
    started, old_sigterm = False, None
    try:
        # this process generates and keeps the policy copy on its device: Ray must not give it to a rank
        started = _init_ray(cfg, driver_device(cfg, resolve_device(cfg.run.device)))
        old_sigterm = interrupt_on_sigterm()  # after ray.init, which installs its own handler
        yield
    finally:
        if started:
            ray.shutdown()
        _stop_watchdog(watchdog)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)


def run_ray(cfg: Config, console: Console | None = None) -> tuple[Path, dict]:
    console = console or Console(stderr=True)
    start = time.time()
    chatter = Console(quiet=True) if cfg.logging.quiet else console  # quiet: only errors and the summary
    log = lambda msg: chatter.print(msg, highlight=False)  # noqa: E731
    cfg, run_dir, prepared = open_run(cfg, chatter)  # builds the demo model on every core, before the split
    torch.set_num_threads(cfg.run.threads or _trainer_threads(cfg))
    if cfg.generation.backend == "vllm" and not cfg.eval.async_:
        log(
            "evaluation: HF generate on the trainer's policy (the trainer holds no vLLM engine); "
            "eval.async=true evaluates on one in the evaluation actor"
        )
    watchdog = _start_watchdog(cfg)
    started_ray, old_sigterm = False, None
    actors, metrics, background = [], None, None
    inbox, c = None, None
    try:
        # the trainer's own GPU is kept from Ray, unless ranks train (they get theirs from Ray)
        device = resolve_device(cfg.run.device)
        started_ray = _init_ray(cfg, driver_device(cfg, device))
        shared = started_ray and not cfg.runtime.address and torch.cuda.device_count() == 1
        cfg = gpu_shares(cfg, device, ray.cluster_resources().get("GPU", 0.0), trainer_gpu_shared=shared)
        # after ray.init, which installs its own SIGTERM handler (it logs and exits at once)
        old_sigterm = interrupt_on_sigterm()
        run_id = uuid.uuid4().hex[:12]
        names = (f"tba-weights-{run_id}", f"tba-inbox-{run_id}")
        board, inbox = WeightBoard.options(name=names[0]).remote(), Inbox.options(name=names[1]).remote()
        c = build_components(cfg, log, weights=RayWeightStore(board), with_searcher=False, prepared=prepared)
        resumed = cfg.run.resume and resume(c, run_dir, log)
        metrics = MetricsLogger(run_dir, cfg.logging, cfg.model_dump(mode="json", by_alias=True), start_time=start)
        r = cfg.runtime
        threads = max(1, int(r.searcher_cpus))
        cfg_data = cfg.model_dump(mode="json")
        # Searcher processes start (imports, model loading) while this one publishes and
        # evaluates; the model paths are resolved by now, so none of them builds the demo model.
        # vLLM engines that share a GPU start one at a time, before the trainer uses it: each sizes its
        # KV cache from the memory the GPU has free while it profiles, which another process's
        # allocations would take from it (or, freed meanwhile, make vLLM's profiling fail).
        alone = one_engine_at_a_time(cfg, device, shared)
        for i in range(r.num_searchers):
            actors.append(
                SearcherWorker.options(
                    num_cpus=r.searcher_cpus,
                    num_gpus=r.searcher_gpus,
                    resources=dict(r.searcher_resources),
                    max_restarts=-1 if r.max_searcher_restarts else 0,  # SearcherPool enforces the limit
                ).remote(cfg_data, i, names, threads, os.getcwd())
            )
            if alone:  # (a searcher that fails to start is reported by the pool, as always)
                ray.wait([actors[-1].__ray_ready__.remote()], timeout=None)
        initial = {}
        if cfg.eval.async_:
            background = BackgroundEvaluation(cfg)
            if alone:
                ray.wait([background.actor.__ray_ready__.remote()], timeout=None)
        c.trainer.publish()  # searchers start from the trainer's weights
        if background is not None and not resumed:  # logged at step 0 when done; training starts meanwhile
            background.submit(0, c.trainer.published_state())
        elif background is None and not resumed:
            initial = evaluate_policy(c, cfg, run_dir, 0, metrics)
            metrics.log(0, initial)
        on_event = lambda m: _event(run_dir, console.print, m)  # noqa: E731  (shown even when quiet)
        pool = SearcherPool(actors, r.max_searcher_restarts, r.restart_window_s, on_event)
        memory = "jemalloc" if allocator.loaded() else "the system allocator"
        log(f"{r.num_searchers} searcher(s) started; trainer on {torch.get_num_threads()} thread(s), {memory}")
        extra = _train(c, cfg, run_dir, metrics, initial, inbox, pool, background)
    finally:
        if inbox is not None:
            inbox.stop.remote()
        for actor in actors:
            ray.kill(actor)
        if background is not None:
            background.stop()
        if metrics is not None:
            metrics.close()  # whatever happened, what was logged stays on disk
        if c is not None:
            c.close()
        if started_ray:
            ray.shutdown()
        _stop_watchdog(watchdog)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
    summary = write_summary(run_dir, c, cfg, start, extra)
    plot_run(run_dir, eval_key(c))
    print_summary(console, summary, cfg, run_dir)
    return run_dir, summary


def _event(run_dir: Path, log, message: str) -> None:
    """A searcher's death or return: on the console and in ``errors.log``."""
    log(message)
    log_errors(run_dir, [f"{time.strftime('%Y-%m-%d %H:%M:%S')} {message}"])


def _drain(c: Components, inbox, run_dir: Path, gate: StepGate) -> dict[int, dict]:
    groups, stats, errors = ray.get(inbox.drain.remote())
    c.trainer.ingest(groups)
    gate.add_arrivals(sum(g.size for g in groups))
    log_errors(run_dir, errors)
    return stats


def _generated(stats: dict[int, dict]) -> float:
    """Completions the searchers have generated so far (kept or dropped), by their latest stats."""
    return sum(s["searcher/completions"] for s in stats.values())


def _searcher_metrics(stats: dict[int, dict]) -> dict[str, float]:
    if not stats:
        return {}
    completions = sum(s["searcher/completions"] for s in stats.values())
    tokens = sum(s["tokens"] for s in stats.values())
    elapsed = max(s["elapsed_s"] for s in stats.values())
    rewards = [s["searcher/reward_mean"] for s in stats.values() if math.isfinite(s["searcher/reward_mean"])]
    out = {
        "searcher/completions": float(completions),
        "searcher/completions_per_s": completions / max(elapsed, 1e-9),
        "searcher/tokens_per_s": tokens / max(elapsed, 1e-9),
        "searcher/version_min": float(min(s["searcher/version"] for s in stats.values())),
        "searcher/reward_errors": float(sum(s["searcher/reward_errors"] for s in stats.values())),
        "searcher/empty_completions": float(sum(s["searcher/empty_completions"] for s in stats.values())),
        "searcher/no_reward": float(sum(s.get("searcher/no_reward", 0.0) for s in stats.values())),
        "searcher/unfinished": float(sum(s.get("searcher/unfinished", 0.0) for s in stats.values())),
        "searcher/dropped_groups": float(sum(s.get("searcher/dropped_groups", 0.0) for s in stats.values())),
    }
    per_fn: dict[str, list[float]] = {}
    for s in stats.values():
        for key, value in s.items():
            if key.startswith("reward/") and value is not None and math.isfinite(value):
                per_fn.setdefault(key, []).append(value)
    out.update({key: sum(v) / len(v) for key, v in per_fn.items()})
    if rewards:
        out["searcher/reward_mean"] = sum(rewards) / len(rewards)
    return out


def _searcher_versions(stats: dict[int, dict], pool: SearcherPool) -> list[int | None]:
    """The weight version each searcher holds, by its latest report; None while it restarts."""
    return [None if i in pool.waiting else int(stats[i]["searcher/version"]) for i in sorted({*stats, *pool.waiting})]


def _log_evaluations(
    finished: list[Finished], run_dir: Path, metrics: MetricsLogger, display: RunDisplay, step: int
) -> None:
    """Results of the evaluation actor, each logged at the step whose weights it evaluated."""
    for f in finished:
        write_samples(run_dir, f.step, f.samples)
        metrics.log_samples(f.step, f.samples)
        metrics.log(f.step, f.metrics)
        display.update(step, f.metrics)  # the display stays at the trainer's step


def _train(
    c: Components,
    cfg: Config,
    run_dir: Path,
    metrics: MetricsLogger,
    initial: dict,
    inbox,
    pool: SearcherPool,
    background: BackgroundEvaluation | None = None,
) -> dict:
    trainer, batch = c.trainer, cfg.trainer.batch_prompts
    t = cfg.trainer
    lag = cfg.runtime.lag_bound(t.sync_interval)
    gate = StepGate(batch * cfg.generation.group_size, t.max_replay_ratio, t.replay_window, lag)
    starved = Starvation()
    min_groups = cfg.buffer.min_groups or batch
    last_stats: dict[int, dict] = {}
    while c.buffer.num_prompts < min_groups or not c.buffer.can_sample(batch):  # the initial fill
        pool.check()
        last_stats = _drain(c, inbox, run_dir, gate) or last_stats
        time.sleep(0.05)
    loop_start, busy_s, paused_s, samples, wait_total_s = time.perf_counter(), 0.0, 0.0, 0, 0.0
    longest_pause_s, step_end = 0.0, loop_start  # the widest gap between two trainer steps
    key = eval_key(c)
    peak = PeakMemory(trainer.device)
    with RunDisplay.from_config(cfg.logging, cfg.trainer.steps, key) as display:
        display.update(trainer.version, initial)
        while trainer.version < cfg.trainer.steps:
            last_stats = _drain(c, inbox, run_dir, gate) or last_stats
            pool.check()
            wait_start = time.perf_counter()
            starved.begin(wait_start, gate.arrived, _generated(last_stats))
            # the bounds: wait for data; a restarting searcher (None) does not count
            while gate.blocked(trainer.version, [v for v in _searcher_versions(last_stats, pool) if v is not None]):
                time.sleep(0.02)
                pool.check()
                last_stats = _drain(c, inbox, run_dir, gate) or last_stats
                if message := starved.check(time.perf_counter(), gate.arrived, _generated(last_stats)):
                    pool.log(message)  # on the console even when quiet, and in errors.log
            t0 = time.perf_counter()
            wait_s = t0 - wait_start
            wait_total_s += wait_s
            longest_pause_s = max(longest_pause_s, t0 - step_end - wait_s)
            replay_ratio = gate.replay_ratio()
            record = trainer.step()
            gate.stepped()
            busy_s += time.perf_counter() - t0
            samples += batch * cfg.generation.group_size
            step = trainer.version
            active_s = time.perf_counter() - loop_start - paused_s
            record.update(_searcher_metrics(last_stats))
            record["train/replay_ratio"] = replay_ratio
            record["trainer/wait_s"] = wait_s
            record["trainer/wait_total_s"] = wait_total_s
            record["trainer/busy_fraction"] = busy_s / max(active_s, 1e-9)
            record["trainer/samples_per_s"] = samples / max(active_s, 1e-9)
            record["trainer/longest_pause_s"] = longest_pause_s
            record["searcher/restarts"] = float(pool.restarts)
            t1 = time.perf_counter()  # evaluation and checkpoints pause training: not counted
            finished = background.poll() if background else []
            if step % cfg.eval.every == 0 or step == cfg.trainer.steps:
                if background:
                    finished += background.submit(step, c.trainer.published_state())
                    record["trainer/eval_wait_s"] = background.waited_s
                else:
                    record.update(evaluate_policy(c, cfg, run_dir, step, metrics))
            if step % cfg.logging.every == 0 or key in record:
                record["train/peak_memory_gb"] = peak.read()  # since the previous log
                metrics.log(step, record)  # before the checkpoint: a resume from it finds this step logged
            every = cfg.trainer.checkpoint_every
            if (every and step % every == 0) or step == cfg.trainer.steps:
                if background:  # its results belong before the checkpoint, like the step's own
                    finished += background.finish()
                save(c, run_dir)
            _log_evaluations(finished, run_dir, metrics, display, step)
            paused_s += time.perf_counter() - t1
            step_end = time.perf_counter()  # evaluation and checkpoints are not pauses of the loop
            display.update(step, record, _searcher_versions(last_stats, pool))
    active_s = time.perf_counter() - loop_start - paused_s
    nodes = sorted({s["node"] for s in last_stats.values()})
    return {
        "trainer_busy_fraction": round(busy_s / max(active_s, 1e-9), 4),
        "searcher_nodes": nodes,
        "searcher_restarts": pool.restarts,
        "trainer_longest_pause_s": round(longest_pause_s, 3),
        "trainer_wait_s": round(wait_total_s, 3),
        "replay_ratio": round(gate.trained / max(gate.arrived, 1), 4),  # over the whole run
    }
