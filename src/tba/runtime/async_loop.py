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
from contextlib import ExitStack
from pathlib import Path

import ray
import torch
from rich.console import Console

from tba import allocator
from tba.config import Config, RuntimeConfig, absolute_paths
from tba.machine import busy_cores
from tba.metrics import MetricsLogger
from tba.plan import Plan, actor_gpu_shares, plan_run
from tba.plan.placement import local_threads
from tba.runtime.actors import BackgroundEvaluation, SearcherWorker
from tba.runtime.bounds import StepGate
from tba.runtime.build import Components, build_components
from tba.runtime.cluster import one_engine_at_a_time, ray_session
from tba.runtime.health import SlowdownWatch
from tba.runtime.inbox import Inbox
from tba.runtime.observers import BackgroundEvaluations
from tba.runtime.report import evaluate_policy, finish, say_event
from tba.runtime.restarts import SearcherPool
from tba.runtime.run_dir import open_run, resume
from tba.runtime.sources import InboxSource
from tba.runtime.startup import StartUp
from tba.runtime.steps import LoopSections, train_steps
from tba.weights import BackgroundPublisher, Sender
from tba.weights.ray.channel import Channel, RankSender, channel_sender, open_channel


def run_ray(cfg: Config, console: Console | None = None, plan: Plan | None = None) -> tuple[Path, dict]:
    """Train ``cfg`` in the ray runtime (``runtime.type`` ``ray``, or ``auto`` deciding so); with
    ``plan``, ``cfg`` is the config :func:`tba.plan.plan_run` returned with it (``tba train``)."""
    if plan is None:
        cfg, plan = plan_run(absolute_paths(cfg), "ray")
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
    say = lambda m: say_event(run_dir, console.print, m)  # noqa: E731  (shown even when quiet)
    # clean-up in reverse order: the metrics, the evaluation actor, the searchers, the inbox, then
    # the parts (the weights' sender among them: no searcher listens any more), Ray
    with ExitStack() as closing:
        started_ray = closing.enter_context(ray_session(cfg.runtime, plan))
        startup.mark("Ray")
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
        weights = _sender(cfg.trainer.num_ranks, channel, lambda m: chatter.print(m, highlight=False, markup=False))
        c = None  # the parts close the sender with the rest, once built; once the searchers are stopped
        closing.callback(lambda: (c if c is not None else weights).close())
        inbox = Inbox.options(name=names[1]).remote(ahead)
        closing.callback(inbox.stop.remote)
        actors: list = []
        closing.callback(lambda: [ray.kill(a) for a in actors])
        # The searchers start first (imports, model loading: most of the start-up), while this
        # process loads the trainer's model, publishes and evaluates (the plan has the EOS ids
        # and the models' paths: no searcher builds the demo model).
        # trainer ranks take whole GPUs of their own: they start first, the searchers' shares then
        early = cfg.trainer.num_ranks == 1
        cfg_data, eval_cpus = cfg.model_dump(mode="json", by_alias=True), cfg.eval.eval_cpus
        if early:
            background = _start_actors(r, cfg_data, plan, names, shared, actors, eval_cpus)
            startup.mark("starting searchers")
        c = build_components(cfg, plan, log, weights=weights, with_searcher=False, prepared=prepared)
        startup.mark("trainer's model")
        if not early:
            background = _start_actors(r, cfg_data, plan, names, shared, actors, eval_cpus)
            startup.mark("starting searchers")
        if background is not None:
            closing.callback(background.stop)
        initial = {}
        resumed = cfg.run.resume and resume(c, run_dir, log)
        if resumed:  # each searcher goes on from its place in the checkpoint, not its epoch's start
            ray.get(inbox.resume_places.remote(c.ledger.places()))
        metrics = MetricsLogger(run_dir, cfg.logging, cfg.model_dump(mode="json", by_alias=True), start_time=start)
        closing.callback(metrics.close)  # whatever happened, what was logged stays on disk
        c.trainer.publish()  # searchers start from the trainer's weights
        c.trainer.flush_publication()
        startup.mark("first publication")
        if background is not None and not resumed:  # logged at step 0 when done; training starts meanwhile
            background.submit(0, published_weights(c))
        elif background is None and not resumed:
            initial = evaluate_policy(c, run_dir, 0, metrics)
            metrics.log(0, initial)
        pool = SearcherPool(actors, r.max_searcher_restarts, r.restart_window_s, say)
        memory = "jemalloc" if allocator.loaded() else "the system allocator"
        startup.mark("evaluation at step 0")
        log(f"{r.num_searchers} searcher(s) started; trainer on {torch.get_num_threads()} thread(s), {memory}")
        here = local_threads(cfg, plan.trainer_threads, plan.searcher_threads, plan.rank_threads)
        slowdown = SlowdownWatch(plan.hardware, sum(n for _, n in here), busy_cores, side_by_side=True)
        sections = LoopSections(cfg.trainer, cfg.buffer, cfg.generation, cfg.logging, cfg.eval.every, r.num_searchers)
        extra = _train(c, sections, run_dir, metrics, initial, inbox, pool, background, startup, slowdown, log, say)
        c.trainer.flush_publication()  # the last publication lands while its searchers still listen
    return run_dir, finish(console, run_dir, c, start, extra)


def _sender(num_ranks: int, channel: Channel, log) -> Sender:
    """The trainer's side of the run's weight channel: on a thread of its own while the trainer
    steps; with trainer ranks (``trainer.num_ranks``), rank 0 opens it in its process and publishes
    after the gather."""
    if num_ranks > 1:
        return RankSender(channel)
    return BackgroundPublisher(channel_sender(channel, log))


def _start_actors(
    r: RuntimeConfig,
    cfg_data: dict,
    plan: Plan,
    names: tuple[Channel, str],
    shared: bool,
    actors: list,
    eval_cpus: float,
):
    """Start the searcher actors of ``runtime`` settings, each building its part from the run's
    config as data (appended to ``actors`` as they start, for the caller's clean-up), and the
    evaluation actor (the plan's ``eval_actor``, on ``eval.eval_cpus``; returned, else None). vLLM
    engines that share a GPU start one at a time, before the trainer uses it: each sizes its KV
    cache from the memory the GPU has free while it profiles, which another process's allocations
    would take from it (or, freed meanwhile, make vLLM's profiling fail)."""
    plan_data = plan.to_dict()
    alone = one_engine_at_a_time(plan, shared)
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
    if not plan.eval_actor:
        return None
    background = BackgroundEvaluation(cfg_data, eval_cpus, plan)
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


def _train(
    c: Components,
    sections: LoopSections,
    run_dir: Path,
    metrics: MetricsLogger,
    initial: dict,
    inbox,
    pool: SearcherPool,
    background: BackgroundEvaluation | None,
    startup: StartUp,
    slowdown: SlowdownWatch,
    log,
    say,
) -> dict:
    """The steps of a ray run (:func:`tba.runtime.steps.train_steps`) from the inbox of its searchers."""
    t, plan = sections.trainer, c.plan
    batch = t.batch_prompts * sections.generation.group_size
    gate = StepGate(batch, t.max_replay_ratio, plan.replay_window, plan.lag_bound)
    source = InboxSource(c, inbox, pool, run_dir, gate, t.batch_prompts, startup, log)
    evaluations = None
    if background is not None:
        evaluations = BackgroundEvaluations(background, lambda: published_weights(c), sections.eval_every, t.steps)
    return train_steps(c, sections, run_dir, metrics, initial, source, slowdown, say, evaluations, log)
