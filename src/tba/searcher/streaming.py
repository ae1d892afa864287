"""The streaming searcher (``generation.stream``): prompts enter the engine as others leave, groups
go on to scoring and the reference pass while the engine runs, and weights load between two engine
steps. What it shares with the batch searcher (weights, scoring, the reference pass, state) is
:class:`tba.searcher.base.Searcher`'s."""

from __future__ import annotations

import time
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor

from tba.generation.stream import Stream
from tba.models.loading import encode_prompts
from tba.scoring import ScoringPool
from tba.searcher.base import Searcher
from tba.types import RolloutGroup


class StreamingSearcher(Searcher):
    """A searcher that never waits for its slowest completion (``generation.stream``).

    The engine holds up to ``max_in_flight`` prompts (:mod:`tba.generation.stream`). A group that
    leaves the engine goes to a pool of ``reward_workers`` scoring threads
    (:class:`~tba.scoring.ScoringPool`, each call given up after ``reward_timeout`` seconds) while
    the engine goes on, then through the reference pass (on a thread of its own with
    ``reference_thread``, else on this one between engine steps); a new prompt takes its place in
    the engine at once. Each :meth:`step` returns as soon as ``min_groups_out`` groups are ready;
    the rest stay in flight for the next. With ``exact`` (the sync runtime) a step takes
    ``max_in_flight`` prompts at once and returns when every one of them is sent or dropped.

    New weights load between two engine steps (``weight_update``): ``in_flight`` lets the prompts in
    flight go on with them, so a group can hold tokens of two or more versions (``policy_version``
    is the oldest, ``newest_version`` the newest); ``drain`` finishes them with the old weights
    first. Every prompt taken is sent as a group, dropped and counted (``searcher/dropped_groups``),
    or still in flight (``searcher/in_flight``: in the engine, being scored, or in the reference
    pass)."""

    def __init__(
        self,
        *args,
        stream: Stream,
        max_in_flight: int,
        weight_update: str,
        min_groups_out: int = 1,
        reward_workers: int = 4,
        reference_thread: bool = False,
        exact: bool = False,
        **kwargs,
    ):
        super().__init__(*args, **kwargs)
        if max_in_flight < 1 or min_groups_out < 1:
            raise ValueError(f"max_in_flight and min_groups_out must be >= 1, got {max_in_flight}, {min_groups_out}")
        self.stream = stream
        self.max_in_flight = max_in_flight
        self.min_groups_out = min(min_groups_out, max_in_flight)
        self.weight_update = weight_update
        self.exact = exact  # the sync runtime's step: max_in_flight prompts taken together, all finished
        self.pool = ScoringPool(reward_workers, self.reward_timeout)
        self._ref_thread = ThreadPoolExecutor(1, thread_name_prefix="tba-reference") if reference_thread else None
        self._ref_job: Future | None = None  # the reference pass in flight
        self._scored: list = []  # (Finished, kept completions) scored, waiting for the reference pass
        self._out: list[tuple[RolloutGroup, tuple]] = []  # (group, its prompt's key), ready to send
        self._after_engine = 0  # prompts out of the engine, not yet sent or dropped
        self._aborted = 0  # prompts in the engine when it was closed
        self._kept_seen: list[list] = []  # usable completions of each group scored since the last step
        self.prompts_taken = self.groups_sent = 0
        self.last_versions_per_group = float("nan")
        self.latencies: deque[float] = deque(maxlen=512)  # taken → sent, seconds, of the latest groups
        self._taken_at: Counter[int] = Counter()  # weight version at submission of each prompt in flight

    def _load(self, state, version: int) -> None:
        self._submit(self.stream.load_weights(state, version, self.weight_update))

    def in_flight(self) -> int:
        """Prompts taken and neither sent nor dropped yet."""
        return self.stream.in_flight() + self._after_engine + self._aborted

    def oldest_version(self) -> int:
        """The version a prompt still in flight was submitted with, the oldest of them: groups
        finish out of order, so one sent later can be older than the weights held now."""
        return min([self.version, *+self._taken_at])  # unary +: the versions still counted

    def step(self) -> list[RolloutGroup]:
        self._begin_step()
        if self.exact:
            self._top_up()
        while True:
            if not self.exact:
                self._top_up()
            self._collect_scores(wait_s=0.0)
            self._reference(wait=False)
            if self.in_flight() == len(self._out) if self.exact else len(self._out) >= self.min_groups_out:
                break
            if self.stream.in_flight():
                start = time.perf_counter()
                finished = self.stream.advance()
                self.engine_s += time.perf_counter() - start
                self._submit(finished)
            elif self.pool.pending():  # the engine is empty because scoring lags: wait for it
                self._collect_scores(wait_s=0.05)
            elif self._ref_job is not None or self._scored:
                self._reference(wait=True)
            else:
                break
        out, self._out = self._out, []
        if self.exact:  # in the order taken, whatever order scoring finished in: a resumed run repeats it
            out.sort(key=lambda item: item[1][2])
        now = time.perf_counter()
        self.latencies.extend(now - key[2] for _, key in out)
        self._taken_at.subtract(key[3] for _, key in out)
        self._after_engine -= len(out)
        self.groups_sent += len(out)
        kept, self._kept_seen = self._kept_seen, []
        self._note_reward_mean(kept)
        return [group for group, _ in out]

    def _top_up(self) -> None:
        """New prompts into the engine while it has room, and while scoring keeps up (at most
        ``max_in_flight`` more prompts waiting after the engine)."""
        while self.stream.in_flight() < self.max_in_flight and self.in_flight() < 2 * self.max_in_flight:
            (prompt,) = self.task.sample_prompts(1, self.rng)
            self.drawn += 1
            ids = encode_prompts(self.tokenizer, [prompt], self.chat_template)[0]
            self.stream.submit((prompt, ids, time.perf_counter(), self.version, self.drawn - 1), ids)
            self._taken_at[self.version] += 1
            self.prompts_taken += 1

    def _submit(self, finished: list) -> None:
        """Groups out of the engine: counted, then to the scoring pool (those with anything to score)."""
        if not finished:
            return
        self._after_engine += len(finished)
        prompts = [f.key[0] for f in finished]
        kept, to_score = self._triage(prompts, [f.completions for f in finished])
        if to_score:
            args = self._reward_args(prompts, to_score)
            self.pool.submit((finished, kept, to_score), self._call_rewards, *args, self.reward_stats.fork())
        else:
            self._scored_groups(finished, kept)

    def _collect_scores(self, wait_s: float) -> None:
        done, expired = self.pool.collect(wait_s)
        for (finished, kept, to_score), (rewards, stats) in done:
            self.reward_stats.merge(stats)
            self._add_rewards(kept, to_score, rewards)
            self._scored_groups(finished, kept)
        for finished, kept, to_score in expired:  # their scored samples are lost, counted
            self.stats.reward_timeouts += len(to_score)
            self._scored_groups(finished, kept)

    def _scored_groups(self, finished, kept) -> None:
        for f, items in zip(finished, kept, strict=True):
            self._kept_seen.append(items)
            if len(items) < 2:
                self.stats.dropped_groups += 1
                self.dropped_draws.append(f.key[4])
                self._after_engine -= 1
                self._taken_at[f.key[3]] -= 1
            else:
                self._scored.append((f, items))

    def _reference(self, wait: bool) -> None:
        """The reference pass over the scored groups: on the reference thread whenever it is free,
        else here, once enough groups are scored for a step (or ``wait``)."""
        if self._ref_thread is None:
            if self._scored and (wait or len(self._out) + len(self._scored) >= self.min_groups_out):
                batch, self._scored = self._scored, []
                self._out += self._ref_pass(batch)
            return
        if self._ref_job is not None and (wait or self._ref_job.done()):
            job, self._ref_job = self._ref_job, None
            self._out += job.result()  # an exception of the pass is raised here
        if self._ref_job is None and self._scored:
            batch, self._scored = self._scored, []
            self._ref_job = self._ref_thread.submit(self._ref_pass, batch)

    def _ref_pass(self, batch) -> list[tuple[RolloutGroup, tuple]]:
        versions = [(f.oldest_version, f.newest_version) for f, _ in batch]
        keys = [f.key for f, _ in batch]
        groups = self._with_ref_logps(
            [k[0] for k in keys], [k[1] for k in keys], [items for _, items in batch], versions, [k[4] for k in keys]
        )
        self.last_versions_per_group = sum(b - a + 1 for a, b in versions) / len(versions)
        return list(zip(groups, [f.key for f, _ in batch], strict=True))

    def state_dict(self) -> dict:
        if self.in_flight():
            raise RuntimeError(
                f"{self.in_flight()} prompts in flight: a streaming searcher's state is saved between exact steps"
            )
        return {
            **super().state_dict(),
            "stream": {"prompts_taken": self.prompts_taken, "groups_sent": self.groups_sent},
        }

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        counts = state.get("stream", {})
        self.prompts_taken = counts.get("prompts_taken", 0)
        self.groups_sent = counts.get("groups_sent", 0)

    def close(self) -> None:
        """Stop the engine's requests and the threads; what was in flight stays counted in
        ``searcher/in_flight``."""
        super().close()
        self._aborted += len(self.stream.abort())
        self.stream.close()
        self.pool.close()
        if self._ref_thread is not None:
            self._ref_thread.shutdown(wait=False, cancel_futures=True)

    def metrics(self) -> dict[str, float]:
        lat = sorted(self.latencies)
        out = {
            **super().metrics(),
            "searcher/prompts_taken": float(self.prompts_taken),
            "searcher/groups_sent": float(self.groups_sent),
            "searcher/in_flight": float(self.in_flight()),
            "searcher/versions_per_group": self.last_versions_per_group,
        }
        if lat:
            out["searcher/group_latency_p50_s"] = lat[len(lat) // 2]
            out["searcher/group_latency_p95_s"] = lat[min(len(lat) - 1, int(0.95 * len(lat)))]
        return out
