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
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path

import ray
import torch
from rich.console import Console

from tba.config import Config, build_config
from tba.console import RunDisplay
from tba.metrics import MetricsLogger
from tba.plots import plot_run
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
from tba.runtime.components import Components, build_components, build_searcher, model_paths, seed_everything
from tba.runtime.errors import SearcherFailed


@ray.remote(num_cpus=0)
class WeightBoard:
    """The newest published weights: a version and an object-store reference."""

    def __init__(self) -> None:
        self.version = -1
        self.ref = None

    def set(self, version: int, boxed_ref: list) -> None:
        if version > self.version:  # a list keeps Ray from resolving the reference on the way in
            self.version, self.ref = version, boxed_ref[0]

    def get_if_newer(self, version: int):
        return (self.version, [self.ref]) if self.version > version else None


class RayWeightStore:
    """The ``WeightStore`` interface over a ``WeightBoard`` actor, usable from any process."""

    def __init__(self, board) -> None:
        self.board = board

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        ref = ray.put({k: v.detach().to("cpu", copy=True) for k, v in state_dict.items()})
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
        self.running = True

    def put(self, searcher_id: int, groups: list, stats: dict, errors: list[str]) -> bool:
        self.groups.extend(groups)
        self.stats[searcher_id] = stats
        self.errors.extend(errors)
        return self.running  # False tells the searcher to stop

    def drain(self) -> tuple[list, dict[int, dict], list[str]]:
        groups, self.groups = self.groups, []
        errors, self.errors = self.errors, []
        return groups, dict(self.stats), errors

    def stop(self) -> None:
        self.running = False


@ray.remote
class SearcherWorker:
    def __init__(self, cfg_data: dict, searcher_id: int, board, inbox, threads: int, driver_cwd: str = "") -> None:
        torch.set_num_threads(threads)
        if driver_cwd and os.path.isdir(driver_cwd) and driver_cwd not in sys.path:
            sys.path.insert(0, driver_cwd)  # reward functions named as pkg.module:fn import as they do in tba train
        cfg = build_config(cfg_data)
        seed_everything(cfg.run.seed + 1000 * (searcher_id + 1))
        self.searcher = build_searcher(cfg, RayWeightStore(board), searcher_id, log=lambda msg: None)
        self.inbox = inbox
        self.node = ray.get_runtime_context().get_node_id()

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
            }
            errors = self.searcher.new_errors()
            if not ray.get(self.inbox.put.remote(self.searcher.searcher_id, groups, stats, errors)):
                return batches


def _init_ray(cfg: Config) -> bool:
    """Join the configured cluster, or start a local instance; True if we started it."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if cfg.runtime.address:
        ray.init(address=cfg.runtime.address, **quiet)
        return True  # our connection; ray.shutdown() disconnects without stopping the cluster
    ray.init(num_cpus=os.cpu_count(), _node_ip_address="127.0.0.1", **quiet)
    return True


def _trainer_threads(cfg: Config) -> int:
    if cfg.runtime.trainer_cpus:
        return cfg.runtime.trainer_cpus
    if cfg.runtime.address:  # searchers may be elsewhere: use this machine
        return os.cpu_count() or 1
    taken = cfg.runtime.num_searchers * cfg.runtime.searcher_cpus
    return max(1, int((os.cpu_count() or 1) - taken))


def run_ray(cfg: Config, console: Console | None = None) -> tuple[Path, dict]:
    console = console or Console(stderr=True)
    start = time.time()
    log = lambda msg: console.print(msg, highlight=False)  # noqa: E731
    cfg, run_dir, prepared = open_run(cfg, console)
    model_paths(cfg, log)  # builds the demo model on first use, on every core, before the split
    torch.set_num_threads(cfg.run.threads or _trainer_threads(cfg))
    started_ray = _init_ray(cfg)
    actors, metrics = [], None
    inbox = None
    try:
        board, inbox = WeightBoard.remote(), Inbox.remote()
        c = build_components(cfg, log, weights=RayWeightStore(board), with_searcher=False, prepared=prepared)
        resumed = cfg.run.resume and resume(c, run_dir, log)
        metrics = MetricsLogger(run_dir, cfg.logging.tensorboard, start_time=start)
        r = cfg.runtime
        threads = max(1, int(r.searcher_cpus))
        cfg_data = cfg.model_dump(mode="json")
        # Searcher processes start (imports, model loading) while this one publishes and
        # evaluates; the model paths are resolved by now, so none of them builds the demo model.
        actors = [
            SearcherWorker.options(
                num_cpus=r.searcher_cpus, num_gpus=r.searcher_gpus, resources=dict(r.searcher_resources)
            ).remote(cfg_data, i, board, inbox, threads, os.getcwd())
            for i in range(r.num_searchers)
        ]
        c.trainer.publish()  # searchers start from the trainer's weights
        initial = {}
        if not resumed:
            initial = evaluate_policy(c, cfg, run_dir, 0)
            metrics.log(0, initial)
        runs = [a.run.remote() for a in actors]
        log(f"{r.num_searchers} searcher(s) started; trainer on {torch.get_num_threads()} thread(s)")
        extra = _train(c, cfg, run_dir, metrics, initial, inbox, runs)
    finally:
        if inbox is not None:
            inbox.stop.remote()
        for actor in actors:
            ray.kill(actor)
        if metrics is not None:
            metrics.close()  # whatever happened, what was logged stays on disk
        if started_ray:
            ray.shutdown()
    summary = write_summary(run_dir, c, cfg, start, extra)
    plot_run(run_dir, eval_key(c))
    print_summary(console, summary, cfg, run_dir)
    return run_dir, summary


def _check_searchers(runs: list) -> None:
    done, _ = ray.wait(runs, num_returns=len(runs), timeout=0)
    for ref in done:
        try:
            ray.get(ref)
        except ray.exceptions.RayError as err:
            raise SearcherFailed(f"a searcher failed; the run stops.\n{err}") from None
        raise SearcherFailed("a searcher stopped unexpectedly; the run stops")


def _drain(c: Components, inbox, run_dir: Path) -> dict[int, dict]:
    groups, stats, errors = ray.get(inbox.drain.remote())
    c.trainer.ingest(groups)
    log_errors(run_dir, errors)
    return stats


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


def _train(c: Components, cfg: Config, run_dir: Path, metrics: MetricsLogger, initial: dict, inbox, runs: list) -> dict:
    trainer, batch = c.trainer, cfg.trainer.batch_prompts
    min_groups = cfg.buffer.min_groups or batch
    while c.buffer.num_prompts < min_groups or not c.buffer.can_sample(batch):  # the only wait
        _check_searchers(runs)
        _drain(c, inbox, run_dir)
        time.sleep(0.05)
    loop_start, busy_s, paused_s, samples, last_stats = time.perf_counter(), 0.0, 0.0, 0, {}
    key = eval_key(c)
    with RunDisplay(cfg.trainer.steps, cfg.logging.progress, eval_key=key) as display:
        display.update(trainer.version, initial)
        while trainer.version < cfg.trainer.steps:
            last_stats = _drain(c, inbox, run_dir) or last_stats
            _check_searchers(runs)
            t0 = time.perf_counter()
            record = trainer.step()
            busy_s += time.perf_counter() - t0
            samples += batch * cfg.generation.group_size
            step = trainer.version
            active_s = time.perf_counter() - loop_start - paused_s
            record.update(_searcher_metrics(last_stats))
            record["trainer/busy_fraction"] = busy_s / max(active_s, 1e-9)
            record["trainer/samples_per_s"] = samples / max(active_s, 1e-9)
            t1 = time.perf_counter()  # evaluation and checkpoints pause training: not counted
            if step % cfg.eval.every == 0 or step == cfg.trainer.steps:
                record.update(evaluate_policy(c, cfg, run_dir, step))
            every = cfg.trainer.checkpoint_every
            if (every and step % every == 0) or step == cfg.trainer.steps:
                save(c, run_dir)
            paused_s += time.perf_counter() - t1
            if step % cfg.logging.every == 0 or key in record:
                metrics.log(step, record)
            display.update(step, record)
    active_s = time.perf_counter() - loop_start - paused_s
    nodes = sorted({s["node"] for s in last_stats.values()})
    return {"trainer_busy_fraction": round(busy_s / max(active_s, 1e-9), 4), "searcher_nodes": nodes}
