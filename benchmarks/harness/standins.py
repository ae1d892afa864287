"""Stand-ins for the model work in the real ray runtime (``bench_scale.py``, ``bench_scale_faults.py``):
searcher actors whose batches are waits, and a trainer update that is a wait. Nothing here is in
``src/``: a user's run never meets them."""

from __future__ import annotations

import os
import time

import ray
import torch


def stand_in_searcher(batch_s: float, tokens: int, load_s: float, plays: int = 1):
    """A Ray actor class with :class:`tba.runtime.actors.SearcherWorker`'s constructor and ``run``,
    whose batches cost ``batch_s`` seconds of waiting and no CPU. Its prompts are numbered (its
    draws): it reports its place with each batch and goes on from the inbox's, as a real searcher.
    ``plays``: searchers one process plays (actor ``i`` is searchers ``i * plays`` to ``i * plays +
    plays - 1``): each batch, one fetch of new weights and one load, then a put of a batch, a report
    and a place for each of them, so that the inbox and the trainer see ``plays`` times the actors'
    searchers from that many fewer processes. Made in a function so that Ray ships the class itself
    to the actors' processes (they do not import the benchmarks)."""
    import random

    from tba.config import build_config
    from tba.searcher.counters import COUNTERS
    from tba.types import RolloutGroup, SearcherReport
    from tba.weights.ray.channel import channel_receiver

    @ray.remote
    class StandInSearcher:
        def __init__(self, cfg_data: dict, plan_data: dict, searcher_id: int, names, driver_cwd: str = ""):
            entered = time.time()
            cfg = build_config(cfg_data)
            self.ids, self.inbox = [searcher_id * plays + j for j in range(plays)], ray.get_actor(names[1])
            self.incarnation = f"{searcher_id}-{os.getpid()}"
            self.weights = channel_receiver(names[0], searcher_id, self.incarnation)
            self.prompts, self.k = cfg.generation.prompts_per_batch, cfg.generation.group_size
            self.version, self.rng = -1, random.Random(searcher_id)
            self.completions = [[self.rng.randrange(3, 100) for _ in range(tokens)] for _ in range(self.k)]
            self.capped = cfg.runtime.max_ahead is not None
            self.started = {"entered": entered, "ready": time.time()}
            self.node = ray.get_runtime_context().get_node_id()

        def run(self) -> int:
            start, cpu, batches = time.perf_counter(), time.process_time(), 0
            fetch_s = 0.0
            drawn, done = {}, {}
            for i in self.ids:  # an earlier process's place, or a checkpoint's
                place = ray.get(self.inbox.place.remote(i))
                drawn[i], done[i] = (place["drawn"] if place else 0), 0
            while True:
                t = time.perf_counter()
                new = self.weights.fetch(self.version)
                fetch_s = time.perf_counter() - t
                if new is not None:
                    self.version = new[0]
                    time.sleep(load_s)  # an engine's load of the weights
                time.sleep(batch_s)
                batches += 1
                self.started.setdefault("first_batch", time.time())
                for i in self.ids:
                    groups = self.batch(i, drawn[i])
                    drawn[i] += self.prompts
                    done[i] += self.prompts * self.k
                    report = self.report(i, drawn[i], done[i], fetch_s, start, cpu)
                    if not ray.get(self.inbox.put.remote(groups, report, [])):
                        return batches
                while self.capped and ray.get(self.inbox.ahead.remote()):
                    time.sleep(0.02)

        def batch(self, i: int, drawn: int) -> list:
            return [
                RolloutGroup(
                    prompt_id=f"{i}-{drawn + j}",
                    prompt_ids=[1] * 16,
                    completions=self.completions,  # (made once: a stand-in spends no CPU on tokens)
                    rewards=[float(self.rng.random() < 0.5) for _ in range(self.k)],
                    ref_logps=[-float(tokens)] * self.k,
                    policy_version=max(self.version, 0),
                    searcher_id=i,
                    finished=[True] * self.k,
                    draw=drawn + j,
                )
                for j in range(self.prompts)
            ]

        def report(self, i: int, drawn: int, done: int, fetch_s: float, start: float, cpu: float) -> SearcherReport:
            """Searcher ``i``'s report after its batch; its CPU seconds a share of the process's."""
            metrics = {c.key: 0.0 for c in COUNTERS if not c.optional}
            metrics.update(
                {
                    "searcher/completions": float(done),
                    "searcher/version": float(self.version),
                    "searcher/reward_mean": 0.5,
                    "weights/fetch_s": fetch_s,
                    "weights/load_s": load_s,
                    "tokens": float(done * tokens),
                    "elapsed_s": time.perf_counter() - start,
                    "cpu_s": (time.process_time() - cpu) / plays,
                }
            )
            return SearcherReport(
                i,
                metrics,
                place={"drawn": drawn, "in_flight": 0},
                oldest_version=self.version,
                incarnation=f"{i}-{self.incarnation}",
                node=self.node,
                started=dict(self.started),
            )

    return StandInSearcher


class StandInUpdates:
    """The trainer's update path (:mod:`tba.trainer.updates`) with the update replaced by a wait of
    ``step_s`` and the published state by ``payload`` (the real path's everything else)."""

    def __init__(self, real, step_s: float, payload: dict[str, torch.Tensor]):
        self.real, self.step_s, self.payload = real, step_s, payload

    def __getattr__(self, name):
        return getattr(self.real, name)

    def update(self, batch, version: int) -> dict[str, float]:
        time.sleep(self.step_s)
        tokens = float(sum(len(r.completion) for r in batch.rollouts))
        return {"train/loss": 0.0, "train/grad_norm": 0.0, "train/lr": 0.0, "train/tokens": tokens}

    def published_state(self, dtype) -> dict[str, torch.Tensor]:
        return self.payload

    def publish(self, weights, version: int, dtype) -> None:
        weights.publish(self.payload, version, aliases=True)  # staged off the trainer's path, as the policy's


def payload_of(params: int) -> dict[str, torch.Tensor]:
    """``params`` bf16 parameters in tensors of at most 64M (a model's layers), at least one."""
    chunk, out, left = 64 * 2**20, {}, max(params, 1)
    while left > 0:
        n = min(chunk, left)
        out[f"layer{len(out)}.weight"] = torch.ones(n, dtype=torch.bfloat16)
        left -= n
    return out
