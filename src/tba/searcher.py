"""The searcher role: turn the newest published policy into scored rollout groups.

One call of :meth:`Searcher.step` is one generation batch:

    pull newest weights if any → take prompts → generate K each → reward → reference log-probs
    → return groups (the runtime sends them to the trainer)

Each group is tagged with the version of the weights that generated it. Rewards come from one
batched call of the task for the whole generation batch. Per-sample problems (a reward function
that raises or returns NaN, a sample no function scored, an empty completion) drop that
completion and are counted; a group left with fewer than two completions carries no learning
signal for trajectory balance and is dropped too.

For a LoRA policy (``model.lora``) the published weights are the adapter's only, and the
reference is the sampler itself with its adapter switched off (``tba.models.lora.ReferenceView``).
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch

from tba.generation.base import Generator, SamplingParams
from tba.models.loading import encode_prompts
from tba.models.logprobs import sequence_logprobs
from tba.rewards import RewardStats
from tba.tasks.base import Prompt, Task
from tba.types import RolloutGroup
from tba.weights import WeightStore


@dataclass
class SearcherStats:
    completions: int = 0
    tokens: int = 0
    empty: int = 0
    unfinished: int = 0
    dropped_groups: int = 0
    weight_updates: int = 0


class Searcher:
    def __init__(
        self,
        task: Task,
        tokenizer,
        generator: Generator,
        reference: torch.nn.Module,
        weights: WeightStore,
        params: SamplingParams,
        prompts_per_batch: int,
        eos_ids: set[int],
        searcher_id: int = 0,
        seed: int = 0,
        chat_template: bool | None = None,
        unfinished_reward: float | None = None,
        ref_micro_batch: int | None = None,
        ref_max_tokens: int | None = None,
        ref_reset_every: int | None = None,
    ):
        self.task = task
        self.tokenizer = tokenizer
        self.generator = generator
        self.reference = reference
        self.weights = weights
        self.params = params
        self.prompts_per_batch = prompts_per_batch
        self.eos_ids = eos_ids
        self.searcher_id = searcher_id
        self.rng = random.Random(seed * 1000 + searcher_id)
        self.chat_template = chat_template
        self.unfinished_reward = unfinished_reward
        self.ref_micro_batch = ref_micro_batch  # sequences per reference forward pass
        self.ref_max_tokens = ref_max_tokens  # padded tokens per reference forward pass
        self.ref_reset_every = ref_reset_every  # TBA′: the reference follows the policy every ρ steps
        self.ref_epoch = 0
        self.version = -1  # no weights loaded yet
        self.last_reward_mean = float("nan")
        self.stats = SearcherStats()
        self.reward_stats = RewardStats()

    def pull_weights(self) -> bool:
        """Load the newest published weights if they are newer than ours."""
        newest = self.weights.fetch(newer_than=self.version)
        if newest is None:
            return False
        version, state = newest
        self._load(state, version)
        self.version = version
        if self.ref_reset_every and version // self.ref_reset_every > self.ref_epoch:
            self.reference.load_state_dict(state)  # data already in the buffer keeps its old ref_logps
            self.ref_epoch = version // self.ref_reset_every
        self.stats.weight_updates += 1
        return True

    def _load(self, state, version: int) -> None:
        self.generator.load_weights(state, version)

    def reload_weights(self) -> None:
        """Load the newest published weights again, whatever the generator holds now: after the
        generator was lent out (the sync runtime evaluates the trainer's policy on the searcher's
        vLLM engine), so what it generates next is tagged with the weights it really has."""
        held, self.version = self.version, -1
        if not self.pull_weights():
            self.version = held  # nothing published yet: the first step's pull loads the first version

    def step(self) -> list[RolloutGroup]:
        self.pull_weights()
        if self.version < 0:
            raise RuntimeError("searcher has no policy weights: the trainer must publish before searching")
        prompts = self.task.sample_prompts(self.prompts_per_batch, self.rng)
        prompt_ids = encode_prompts(self.tokenizer, prompts, self.chat_template)
        outputs = self.generator.generate(prompt_ids, self.params)
        kept = self._score(prompts, outputs)
        self._note_reward_mean(kept)
        return self._with_ref_logps(prompts, prompt_ids, kept)

    def _note_reward_mean(self, kept) -> None:
        """Mean reward of what was just sampled (before the buffer deduplicates anything): the
        plainest measure of how the sampling policy is doing."""
        rewards = [item[1] for items in kept for item in items]
        self.last_reward_mean = sum(rewards) / len(rewards) if rewards else float("nan")

    def _score(self, prompts: list[Prompt], outputs) -> list[list[tuple[list[int], float, bool, list[float] | None]]]:
        """Per prompt, (token ids, reward, finished, sampler token log-probs) of its usable completions.

        Empty completions are dropped; unfinished ones get ``unfinished_reward`` when it is set;
        everything else is scored in one batched call of the task."""
        kept: list[list] = [[] for _ in prompts]
        to_score = []  # (prompt index, completion)
        for i, outs in enumerate(outputs):
            for out in outs:
                self.stats.completions += 1
                self.stats.tokens += len(out.token_ids)
                if not any(t not in self.eos_ids for t in out.token_ids):
                    self.stats.empty += 1
                    continue
                if not out.finished:
                    self.stats.unfinished += 1
                    if self.unfinished_reward is not None:
                        kept[i].append((out.token_ids, self.unfinished_reward, False, out.token_logps))
                        continue
                to_score.append((i, out))
        if to_score:
            content = [[t for t in out.token_ids if t not in self.eos_ids] for _, out in to_score]
            texts = self.tokenizer.batch_decode(content, skip_special_tokens=True)
            batch_prompts = [prompts[i] for i, _ in to_score]
            rewards = self.task.rewards(batch_prompts, texts, [out.token_ids for _, out in to_score], self.reward_stats)
            for (i, out), reward in zip(to_score, rewards, strict=True):
                if reward is not None:
                    kept[i].append((out.token_ids, reward, out.finished, out.token_logps))
        return kept

    @torch.no_grad()
    def _with_ref_logps(self, prompts, prompt_ids, kept, versions=None) -> list[RolloutGroup]:
        """Groups of the kept completions (two or more per prompt) with their reference log-probs;
        ``versions``: each prompt's (oldest, newest) policy version, default this searcher's."""
        flat_prompts, flat_completions = [], []
        for ids, items in zip(prompt_ids, kept, strict=True):
            if len(items) < 2:
                continue
            flat_prompts += [ids] * len(items)
            flat_completions += [item[0] for item in items]
        ref = []
        if flat_completions:
            ref = sequence_logprobs(
                self.reference,
                flat_prompts,
                flat_completions,
                self.tokenizer.pad_token_id,
                self.eos_ids,
                micro_batch=self.ref_micro_batch,
                max_tokens=self.ref_max_tokens,
            ).tolist()
        groups, i = [], 0
        versions = versions or [(self.version, self.version)] * len(prompts)
        for prompt, ids, items, (oldest, newest) in zip(prompts, prompt_ids, kept, versions, strict=True):
            if len(items) < 2:
                self.stats.dropped_groups += 1
                continue
            n = len(items)
            groups.append(
                RolloutGroup(
                    prompt_id=prompt.id,
                    prompt_ids=ids,
                    completions=[item[0] for item in items],
                    rewards=[item[1] for item in items],
                    ref_logps=ref[i : i + n],
                    policy_version=oldest,
                    searcher_id=self.searcher_id,
                    finished=[item[2] for item in items],
                    sampler_logps=[sum(item[3]) for item in items] if self.params.logprobs else None,
                    sampler_token_logps=[item[3] for item in items] if self.params.logprobs else None,
                    newest_version=newest if newest != oldest else None,
                )
            )
            i += n
        return groups

    def metrics(self) -> dict[str, float]:
        s = self.stats
        out = {
            "searcher/completions": float(s.completions),
            "searcher/empty_completions": float(s.empty),
            "searcher/unfinished": float(s.unfinished),
            "searcher/dropped_groups": float(s.dropped_groups),
            "searcher/version": float(self.version),
            "searcher/reward_mean": self.last_reward_mean,
        }
        out.update(self.reward_stats.metrics())
        return out

    def state_dict(self) -> dict:
        """What a resumed run needs to continue as if never stopped: the weight version, the random
        states (prompt sampling, exploration), the task's place in its prompt order, the counters,
        and the reference where TBA′ moved it (its weights: older policies are gone by then)."""
        state = {
            "searcher_id": self.searcher_id,
            "version": self.version,
            "rng": list(self.rng.getstate()),
            "task": self.task.sampler_state(),
            "ref_epoch": self.ref_epoch,
            "stats": asdict(self.stats),
            "reward_stats": {
                "errors": self.reward_stats.errors,
                "non_finite": self.reward_stats.non_finite,
                "no_reward": self.reward_stats.no_reward,
                "reported": sorted(self.reward_stats.reported),
            },
        }
        explore_rng = getattr(self.generator, "rng", None)  # an ExploringGenerator's draws
        if isinstance(explore_rng, random.Random):
            state["generator"] = {"rng": list(explore_rng.getstate()), "explored": self.generator.explored}
        if self.ref_epoch > 0:
            state["reference"] = self.reference.state_dict()
        return state

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict`. The sampler's weights are not part of it: the runtime
        republishes the weights of ``state["version"]`` (or newer), which :meth:`pull_weights` loads."""
        if state["searcher_id"] != self.searcher_id:
            raise ValueError(f"state of searcher {state['searcher_id']} given to searcher {self.searcher_id}")
        self.version = state["version"]
        version, internal, gauss = state["rng"]
        self.rng.setstate((version, tuple(internal), gauss))
        self.task.load_sampler_state(state["task"])
        self.ref_epoch = state["ref_epoch"]
        if "reference" in state:
            self.reference.load_state_dict(state["reference"])
        self.stats = SearcherStats(**state["stats"])
        r = state["reward_stats"]
        self.reward_stats.errors, self.reward_stats.non_finite = r["errors"], r["non_finite"]
        self.reward_stats.no_reward, self.reward_stats.reported = r["no_reward"], set(r["reported"])
        if "generator" in state:
            version, internal, gauss = state["generator"]["rng"]
            self.generator.rng.setstate((version, tuple(internal), gauss))
            self.generator.explored = state["generator"]["explored"]

    def new_errors(self) -> list[str]:
        """First traceback of each failing reward function, each returned once (for ``errors.log``)."""
        return [
            f"searcher {self.searcher_id}, policy version {self.version}: {e}"
            for e in self.reward_stats.take_new_errors()
        ]


class StreamingSearcher(Searcher):
    """A searcher that never waits for its slowest completion (``generation.stream``).

    The engine holds up to ``max_in_flight`` prompts (:mod:`tba.generation.stream`): each
    :meth:`step` tops it up with new prompts, runs it until at least ``min_groups_out`` groups have
    finished, and returns those groups scored and with their reference log-probs, while the rest
    stay in flight. New weights load between two engine steps (``weight_update``): ``in_flight``
    lets the prompts in flight go on with them, so a group can hold tokens of two or more versions
    (``policy_version`` is the oldest, ``newest_version`` the newest); ``drain`` finishes them with
    the old weights first. Every prompt taken is sent as a group, dropped and counted
    (``searcher/dropped_groups``), or still in flight (``searcher/in_flight``)."""

    def __init__(self, *args, stream, max_in_flight: int, weight_update: str, min_groups_out: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        if max_in_flight < 1 or min_groups_out < 1:
            raise ValueError(f"max_in_flight and min_groups_out must be >= 1, got {max_in_flight}, {min_groups_out}")
        self.stream = stream
        self.max_in_flight = max_in_flight
        self.min_groups_out = min(min_groups_out, max_in_flight)
        self.weight_update = weight_update
        self._ready: list = []  # groups that left the engine while weights loaded (drain)
        self.prompts_taken = self.groups_sent = 0
        self.last_versions_per_group = float("nan")

    def _load(self, state, version: int) -> None:
        self._ready += self.stream.load_weights(state, version, self.weight_update)

    def in_flight(self) -> int:
        return self.stream.in_flight() + len(self._ready)

    def step(self) -> list[RolloutGroup]:
        self.pull_weights()
        if self.version < 0:
            raise RuntimeError("searcher has no policy weights: the trainer must publish before searching")
        while self.stream.in_flight() < self.max_in_flight:
            (prompt,) = self.task.sample_prompts(1, self.rng)
            ids = encode_prompts(self.tokenizer, [prompt], self.chat_template)[0]
            self.stream.submit((prompt, ids), ids)
            self.prompts_taken += 1
        finished, self._ready = self._ready, []
        while len(finished) < self.min_groups_out and self.stream.in_flight():
            finished += self.stream.advance()
        prompts = [f.key[0] for f in finished]
        kept = self._score(prompts, [f.completions for f in finished])
        self._note_reward_mean(kept)
        versions = [(f.oldest_version, f.newest_version) for f in finished]
        if versions:
            self.last_versions_per_group = sum(b - a + 1 for a, b in versions) / len(versions)
        groups = self._with_ref_logps(prompts, [f.key[1] for f in finished], kept, versions)
        self.groups_sent += len(groups)
        return groups

    def metrics(self) -> dict[str, float]:
        return {
            **super().metrics(),
            "searcher/prompts_taken": float(self.prompts_taken),
            "searcher/groups_sent": float(self.groups_sent),
            "searcher/in_flight": float(self.in_flight()),
            "searcher/versions_per_group": self.last_versions_per_group,
        }
