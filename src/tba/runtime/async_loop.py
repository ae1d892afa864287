"""The asynchronous runtime on Ray: the "A" of TBA.

    searcher actors (each its own process):     trainer (this process):
      loop: pull newest weights if any            wait once for min_groups of data
            generate, reward, reference logps     loop: drain what arrived into the buffer
            send groups to the inbox                    sample a batch → objective → step
                                                        every k steps publish weights

Neither loop waits for the other after the initial fill. Groups travel through a small ``Inbox``
actor (searchers append, the trainer takes everything at once), weights through a
``WeightBoard`` actor that holds a reference to the newest state dict in Ray's object store:
publishing is one ``ray.put`` and a tiny call, on a thread of its own
(:class:`tba.weights.BackgroundPublisher`) while the trainer takes its next step, so neither the
copy nor a slow or dead searcher holds the trainer up. Searchers check between two generation
batches whether a newer version exists.

Threads and GPU shares are the run plan's (:mod:`tba.plan`); Ray: :mod:`tba.runtime.cluster`; the
actors: :mod:`tba.runtime.actors`; weights: :mod:`tba.weights.ray`. A searcher whose process dies is restarted
(:mod:`tba.runtime.restarts`); one that raises ends the run.
"""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path

import ray
import torch
from rich.console import Console

from tba import allocator
from tba.config import Config, absolute_paths
from tba.console import RunDisplay
from tba.evaluation import write_samples
from tba.machine import busy_cores
from tba.metrics import MetricsLogger
from tba.models.precision import PeakMemory
from tba.plan import Plan, actor_gpu_shares, plan_run
from tba.plan.placement import local_threads
from tba.runtime.actors import BackgroundEvaluation, Finished, SearcherWorker
from tba.runtime.bounds import Starvation, StepGate
from tba.runtime.build import Components, build_components
from tba.runtime.cluster import one_engine_at_a_time, ray_session
from tba.runtime.health import FallWatch, SlowdownWatch, remedy
from tba.runtime.inbox import Inbox
from tba.runtime.report import eval_key, evaluate_policy, finish, log_errors, say_event
from tba.runtime.restarts import SearcherPool
from tba.runtime.run_dir import open_run, resume, save
from tba.runtime.startup import StartUp
from tba.searcher.counters import combine
from tba.weights import BackgroundPublisher, Sender
from tba.weights.ray.channel import Channel, RankSender, channel_sender, open_channel


def run_ray(cfg: Config, console: Console | None = None) -> tuple[Path, dict]:
    """Train ``cfg`` in the ray runtime (``runtime.type`` ``ray``, or ``auto`` deciding so)."""
    return train_ray(*plan_run(absolute_paths(cfg), "ray"), console)


def train_ray(cfg: Config, plan: Plan, console: Console | None = None) -> tuple[Path, dict]:
    """Train with ``cfg`` and its ``plan`` (:func:`tba.plan.plan_run`) in the ray runtime."""
    console = console or Console(stderr=True)
    start = time.time()
    chatter = Console(quiet=True) if cfg.logging.quiet else console  # quiet: only errors and the summary
    log = lambda msg: chatter.print(msg, highlight=False)  # noqa: E731
    startup = StartUp(start)  # where the time before the first step goes (summary.json, startup_s)
    # builds the demo model on every core, before the split
    cfg, run_dir, prepared, plan = open_run(cfg, chatter, plan)
    startup.mark("checks and run directory")
    torch.set_num_threads(plan.trainer_threads)
    if cfg.generation.backend == "vllm" and not cfg.eval.async_:
        log(
            "evaluation: HF generate on the trainer's policy (the trainer holds no vLLM engine); "
            "eval.async=true evaluates on one in the evaluation actor"
        )
    actors, metrics, background = [], None, None
    inbox, c, weights = None, None, None
    with ray_session(cfg, plan) as started_ray:
        startup.mark("Ray")
        try:
            shared = started_ray and plan.shares_gpu  # (a Ray instance started here: the plan's GPUs)
            if cfg.runtime.address:  # a cluster's GPUs are known once joined
                shares = actor_gpu_shares(cfg, plan.device, ray.cluster_resources().get("GPU", 0.0), False)
                plan = plan.with_actor_shares(cfg, *shares)
                plan.save(run_dir)
            r = cfg.runtime
            run_id = uuid.uuid4().hex[:12]
            ahead = None if plan.max_ahead is None else plan.max_ahead * cfg.trainer.batch_prompts
            channel, _boards = open_channel(plan.transport, run_id, r.num_searchers)  # (kept for the run)
            names = (channel, f"tba-inbox-{run_id}")
            inbox = Inbox.options(name=names[1]).remote(ahead)
            weights = _sender(cfg, channel, lambda m: chatter.print(m, highlight=False, markup=False))
            # The searchers start first (imports, model loading: most of the start-up), while this
            # process loads the trainer's model, publishes and evaluates (the plan has the EOS ids
            # and the models' paths: no searcher builds the demo model).
            # trainer ranks take whole GPUs of their own: they start first, the searchers' shares then
            early = cfg.trainer.num_ranks == 1
            if early:
                background = _start_actors(cfg, plan, names, shared, actors)
                startup.mark("starting searchers")
            c = build_components(cfg, plan, log, weights=weights, with_searcher=False, prepared=prepared)
            startup.mark("trainer's model")
            if not early:
                background = _start_actors(cfg, plan, names, shared, actors)
                startup.mark("starting searchers")
            initial = {}
            resumed = cfg.run.resume and resume(c, run_dir, log)
            if resumed:  # each searcher goes on from its place in the checkpoint, not its epoch's start
                ray.get(inbox.resume_places.remote(c.ledger.places()))
            metrics = MetricsLogger(run_dir, cfg.logging, cfg.model_dump(mode="json", by_alias=True), start_time=start)
            c.trainer.publish()  # searchers start from the trainer's weights
            c.trainer.flush_publication()
            startup.mark("first publication")
            if background is not None and not resumed:  # logged at step 0 when done; training starts meanwhile
                background.submit(0, published_weights(c))
            elif background is None and not resumed:
                initial = evaluate_policy(c, cfg, run_dir, 0, metrics)
                metrics.log(0, initial)
            on_event = lambda m: say_event(run_dir, console.print, m)  # noqa: E731  (shown even when quiet)
            pool = SearcherPool(actors, r.max_searcher_restarts, r.restart_window_s, on_event)
            memory = "jemalloc" if allocator.loaded() else "the system allocator"
            startup.mark("evaluation at step 0")
            log(f"{r.num_searchers} searcher(s) started; trainer on {torch.get_num_threads()} thread(s), {memory}")
            extra = _train(c, cfg, run_dir, metrics, initial, inbox, pool, background, startup, log)
            c.trainer.flush_publication()  # the last publication lands while its searchers still listen
        finally:
            if inbox is not None:
                inbox.stop.remote()
            for actor in actors:
                ray.kill(actor)
            if c is None and weights is not None:  # (else c.close() closes it, after the searchers stopped)
                weights.close()
            if background is not None:
                background.stop()
            if metrics is not None:
                metrics.close()  # whatever happened, what was logged stays on disk
            if c is not None:
                c.close()
    return run_dir, finish(console, run_dir, c, cfg, start, extra)


def _sender(cfg: Config, channel: Channel, log) -> Sender:
    """The trainer's side of the run's weight channel: on a thread of its own while the trainer
    steps; with trainer ranks, rank 0 opens it in its process and publishes after the gather."""
    if cfg.trainer.num_ranks > 1:
        return RankSender(channel)
    return BackgroundPublisher(channel_sender(channel, log))


def _start_actors(cfg: Config, plan: Plan, names: tuple[Channel, str], shared: bool, actors: list):
    """Start the searcher actors (appended to ``actors`` as they start, for the caller's clean-up)
    and the evaluation actor (``eval.async``; returned, else None). vLLM engines that share a GPU
    start one at a time, before the trainer uses it: each sizes its KV cache from the memory the GPU
    has free while it profiles, which another process's allocations would take from it (or, freed
    meanwhile, make vLLM's profiling fail)."""
    r = cfg.runtime
    cfg_data, plan_data = cfg.model_dump(mode="json"), plan.to_dict()
    alone = one_engine_at_a_time(cfg, plan, shared)
    for i in range(r.num_searchers):
        actors.append(
            SearcherWorker.options(
                num_cpus=r.searcher_cpus,
                num_gpus=plan.searcher_gpus,
                resources=dict(r.searcher_resources),
                max_restarts=-1 if r.max_searcher_restarts else 0,  # SearcherPool enforces the limit
            ).remote(cfg_data, plan_data, i, names, os.getcwd())
        )
        if alone:  # (a searcher that fails to start is reported by the pool, as always)
            ray.wait([actors[-1].__ray_ready__.remote()], timeout=None)
    if not cfg.eval.async_:
        return None
    background = BackgroundEvaluation(cfg, plan)
    if alone:
        ray.wait([background.actor.__ray_ready__.remote()], timeout=None)
    return background


def published_weights(c: Components) -> dict | ray.ObjectRef:
    """The trainer's current weights for the evaluation actor: the object-store copy of their
    publication when this version was published (no second copy), else a state dict."""
    t = c.trainer
    t.flush_publication()
    ref = t.weights.object_ref(t.version)
    return ref if ref is not None else t.published_state()


def _drain(
    c: Components, inbox, run_dir: Path, gate: StepGate, consumed: int | None = None, waiting: bool = False
) -> dict[int, dict]:
    groups, stats, errors = ray.get(inbox.drain.remote(consumed, waiting))
    c.ledger.record(groups, stats)
    c.trainer.ingest(groups)
    gate.add_arrivals(sum(g.size for g in groups))
    log_errors(run_dir, errors)
    return stats


def _generated(stats: dict[int, dict]) -> float:
    """Completions the searchers have generated so far (kept or dropped), by their latest stats."""
    return sum(s["searcher/completions"] for s in stats.values())


def _searcher_versions(stats: dict[int, dict], pool: SearcherPool, key: str = "searcher/version") -> list[int | None]:
    """The weight version each searcher holds, by its latest report (``searcher/oldest_version``:
    the oldest a group it sends from now on can start from); None while it restarts."""
    return [None if i in pool.waiting else int(stats[i][key]) for i in sorted({*stats, *pool.waiting})]


def _log_evaluations(
    finished: list[Finished],
    run_dir: Path,
    metrics: MetricsLogger,
    display: RunDisplay,
    step: int,
    watch: FallWatch,
    say,
) -> None:
    """Results of the evaluation actor, each logged at the step whose weights it evaluated."""
    for f in finished:
        write_samples(run_dir, f.step, f.samples)
        metrics.log_samples(f.step, f.samples)
        if message := watch.observe(f.step, f.metrics):
            say(message)
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
    startup: StartUp | None = None,
    log=print,
) -> dict:
    trainer, batch = c.trainer, cfg.trainer.batch_prompts
    startup = startup or StartUp(time.time())
    t = cfg.trainer
    lag = c.plan.lag_bound
    gate = StepGate(batch * cfg.generation.group_size, t.max_replay_ratio, c.plan.replay_window, lag)
    starved = Starvation()
    min_groups = cfg.buffer.min_groups or batch
    last_stats: dict[int, dict] = {}
    while c.buffer.num_prompts < min_groups or not c.buffer.can_sample(batch):  # the initial fill
        pool.check()
        last_stats = _drain(c, inbox, run_dir, gate, waiting=True) or last_stats
        time.sleep(0.05)
    startup.mark("waiting for the first batch")
    startup.searcher(last_stats)
    loop_start, busy_s, paused_s, samples, wait_total_s = time.perf_counter(), 0.0, 0.0, 0, 0.0
    longest_pause_s, step_end = 0.0, loop_start  # the widest gap between two trainer steps
    key = eval_key(c)
    watch = FallWatch.start(key, initial, run_dir, remedy(c.plan.objective, c.plan.trust_region))
    here = local_threads(cfg, c.plan.trainer_threads, c.plan.searcher_threads, c.plan.rank_threads)
    slowdown = SlowdownWatch(c.plan.hardware, sum(n for _, n in here), busy_cores, side_by_side=True)
    peak = PeakMemory(trainer.device)
    with RunDisplay.from_config(cfg.logging, cfg.trainer.steps, key) as display:
        display.update(trainer.version, initial)
        first = trainer.version  # (a resumed run's: the inbox counts from its start)
        while trainer.version < cfg.trainer.steps:
            consumed = (trainer.version - first) * batch  # what searchers may run ahead of (runtime.max_ahead)
            last_stats = _drain(c, inbox, run_dir, gate, consumed) or last_stats
            pool.check()
            wait_start = time.perf_counter()
            starved.begin(wait_start, gate.arrived, _generated(last_stats))
            # the bounds: wait for data; a restarting searcher (None) does not count
            while gate.blocked(
                trainer.version,
                [v for v in _searcher_versions(last_stats, pool, "searcher/oldest_version") if v is not None],
            ):
                time.sleep(0.02)
                pool.check()
                last_stats = _drain(c, inbox, run_dir, gate, consumed, waiting=True) or last_stats
                if message := starved.check(time.perf_counter(), gate.arrived, _generated(last_stats)):
                    pool.log(message)  # on the console even when quiet, and in errors.log
            t0 = time.perf_counter()
            wait_s = t0 - wait_start
            wait_total_s += wait_s
            longest_pause_s = max(longest_pause_s, t0 - step_end - wait_s)
            replay_ratio = gate.replay_ratio()
            record = trainer.step()
            if not startup.done:
                startup.mark("first step")
                log(startup.line())
            gate.stepped()
            busy_s += time.perf_counter() - t0
            samples += batch * cfg.generation.group_size
            step = trainer.version
            active_s = time.perf_counter() - loop_start - paused_s
            record.update(combine(list(last_stats.values())))  # every searcher's counters (tba.searcher.counters)
            record.update(c.ledger.metrics())
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
                    finished += background.submit(step, published_weights(c))
                    record["trainer/eval_wait_s"] = background.waited_s
                else:
                    record.update(evaluate_policy(c, cfg, run_dir, step, metrics))
            # the pace: a step and its wait for data (searchers slowed by the same load)
            for message in (watch.observe(step, record), slowdown.observe(t1 - wait_start)):
                if message:
                    pool.log(message)  # on the console even when quiet, and in errors.log
            if step % cfg.logging.every == 0 or key in record:
                record["train/peak_memory_gb"] = peak.read()  # since the previous log
                metrics.log(step, record)  # before the checkpoint: a resume from it finds this step logged
            every = cfg.trainer.checkpoint_every
            if (every and step % every == 0) or step == cfg.trainer.steps:
                if background:  # its results belong before the checkpoint, like the step's own
                    finished += background.finish()
                save(c, run_dir)  # (with the prompt ledger: each searcher's place, as of the groups taken in)
            _log_evaluations(finished, run_dir, metrics, display, step, watch, pool.log)
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
        "startup_s": startup.summary(),
    }
