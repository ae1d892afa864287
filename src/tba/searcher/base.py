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
import time

import torch

from tba.generation.base import Generator, SamplingParams
from tba.generation.turns import ConversationSource, reply_texts, with_conversation
from tba.models.loading import encode_prompts
from tba.models.packing import Passes
from tba.models.packing_choice import choose_packing
from tba.rewards import RewardStats
from tba.scoring import ScoringPool
from tba.searcher.state import Resumable, SearcherStats
from tba.tasks.base import Prompt, Task
from tba.types import LoggedError, RolloutGroup
from tba.weights import Receiver


class Searcher(Resumable):
    def __init__(
        self,
        task: Task,
        tokenizer,
        generator: Generator,
        reference: torch.nn.Module,
        weights: Receiver,
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
        reward_timeout: float | None = None,
        ref_packing: bool = False,
        ref_row_tokens: int | str = "auto",
        conversations: ConversationSource | None = None,
    ):
        self.task = task
        self.conversations = conversations  # multi-turn rollouts (task.tools or task.environment)
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
        self.ref_max_tokens = ref_max_tokens  # positions a reference forward pass computes, padding included
        self.ref_passes = Passes()  # padded
        if ref_packing:  # once: TBA′ moves the reference's weights, never its architecture
            self.ref_passes = choose_packing(
                reference, ref_row_tokens, "trainer.reference_packing", "the reference", "its passes pad instead"
            )
        self.ref_tokens = 0  # tokens through the reference passes so far
        self.ref_s = 0.0  # and the seconds they took
        self.ref_reset_every = ref_reset_every  # TBA′: the reference follows the policy every ρ steps
        self.ref_epoch = 0
        self.reward_timeout = reward_timeout  # seconds per reward call; None: no limit
        self._timer = ScoringPool(1, reward_timeout) if reward_timeout is not None else None
        self.engine_s = 0.0  # seconds spent generating
        self.started: float | None = None  # first step
        self.fetch_s = self.load_s = 0.0  # the latest weight update's: fetched from the store, loaded
        self.last_reward_mean = float("nan")
        self.stats = SearcherStats()
        self.reward_stats = RewardStats()
        self.drawn = 0  # prompts drawn so far (with a resumed place: in the run so far)
        self.dropped_draws: list[int] = []  # the draws of groups dropped since the last report

    @property
    def version(self) -> int:
        """The version of the weights the searcher generates with: its generator's, the one owner
        (-1 before the first load)."""
        return self.generator.version

    @version.setter
    def version(self, value: int) -> None:
        self.generator.version = value

    def pull_weights(self) -> bool:
        """Load the newest published weights if they are newer than ours."""
        start = time.perf_counter()
        newest = self.weights.fetch(newer_than=self.version)
        if newest is None:
            return False
        version, state = newest
        fetched = time.perf_counter()
        self._load(state, version)  # the generator now holds ``version``
        self.fetch_s, self.load_s = fetched - start, time.perf_counter() - fetched
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
        self._begin_step()
        prompts = self.task.sample_prompts(self.prompts_per_batch, self.rng)
        draws = list(range(self.drawn, self.drawn + len(prompts)))
        self.drawn += len(prompts)
        if self.conversations is not None:
            prompt_ids, outputs = self.conversations.rollout(self.generator, prompts, self.params)
            self.engine_s += self.conversations.take_generate_s()
            self.stats.add_turns(self.conversations.take_counts())
        else:
            prompt_ids = encode_prompts(self.tokenizer, prompts, self.chat_template)
            start = time.perf_counter()
            outputs = self.generator.generate(prompt_ids, self.params)
            self.engine_s += time.perf_counter() - start
        kept = self._score(prompts, outputs)
        self._note_reward_mean(kept)
        prompts, prompt_ids, kept, draws = self._drop_small(prompts, prompt_ids, kept, draws)
        return self._with_ref_logps(prompts, prompt_ids, kept, draws=draws)

    def _begin_step(self) -> None:
        """Load the newest weights (there must be some) and start the engine's clock."""
        self.pull_weights()
        if self.version < 0:
            raise RuntimeError("searcher has no policy weights: the trainer must publish before searching")
        if self.started is None:
            self.started = time.perf_counter()

    def _note_reward_mean(self, kept) -> None:
        """Mean reward of what was just sampled (before the buffer deduplicates anything): the
        plainest measure of how the sampling policy is doing."""
        rewards = [item[1] for items in kept for item in items]
        self.last_reward_mean = sum(rewards) / len(rewards) if rewards else float("nan")

    def _score(self, prompts: list[Prompt], outputs) -> list[list[tuple]]:
        """Per prompt, (token ids, reward, finished, sampler token log-probs, action mask) of its
        usable completions (the mask: None, or a multi-turn trajectory's).

        Empty completions are dropped; unfinished ones get ``unfinished_reward`` when it is set; a
        finished trajectory whose environment gave a reward keeps it; everything else is scored in
        one batched call of the task (given up after
        ``reward_timeout`` seconds: those samples are dropped and counted)."""
        kept, to_score = self._triage(prompts, outputs)
        if not to_score:
            return kept
        args = self._reward_args(prompts, to_score)
        if self._timer is None:
            rewards, stats = self._call_rewards(*args, self.reward_stats.fork())
        else:
            self._timer.submit(None, self._call_rewards, *args, self.reward_stats.fork())
            done: list = []
            while not done and self._timer.pending():
                done, _ = self._timer.collect(wait_s=1.0)
            if not done:  # given up at the deadline
                self.stats.reward_timeouts += len(to_score)
                return kept
            rewards, stats = done[0][1]
        self.reward_stats.merge(stats)
        self._add_rewards(kept, to_score, rewards)
        return kept

    def _triage(self, prompts, outputs) -> tuple[list[list], list[tuple[int, object]]]:
        """Count the completions; per prompt, those kept without a reward call (unfinished ones with
        ``unfinished_reward``), and the (prompt index, completion) pairs to score."""
        kept: list[list] = [[] for _ in prompts]
        to_score = []
        for i, outs in enumerate(outputs):
            for out in outs:
                self.stats.completions += 1
                mask = out.action_mask
                self.stats.tokens += sum(mask) if mask is not None else len(out.token_ids)
                if out.failed:  # its environment raised: counted in environment_errors
                    continue
                if not any(t not in self.eos_ids for t in out.token_ids):
                    self.stats.empty += 1
                    continue
                if not out.finished:
                    self.stats.unfinished += 1
                    if self.unfinished_reward is not None:
                        kept[i].append((out.token_ids, self.unfinished_reward, False, out.token_logps, mask))
                        continue
                elif out.reward is not None:  # the environment's own reward
                    kept[i].append((out.token_ids, out.reward, True, out.token_logps, mask))
                    continue
                to_score.append((i, out))
        return kept, to_score

    def _reward_args(self, prompts, to_score) -> tuple[list, list[str], list[list[int]]]:
        texts = reply_texts(self.tokenizer, [out for _, out in to_score], self.eos_ids)
        return (
            [with_conversation(prompts[i], out) for i, out in to_score],
            texts,
            [out.token_ids for _, out in to_score],
        )

    def _call_rewards(self, prompts, texts, ids, stats: RewardStats) -> tuple[list[float | None], RewardStats]:
        """One call of the task's rewards, counting into ``stats`` (a fork: safe on a scoring thread)."""
        return self.task.rewards(prompts, texts, ids, stats), stats

    @staticmethod
    def _add_rewards(kept, to_score, rewards) -> None:
        for (i, out), reward in zip(to_score, rewards, strict=True):
            if reward is not None:
                mask = out.action_mask
                kept[i].append((out.token_ids, reward, out.finished, out.token_logps, mask))

    def _drop_small(self, prompts, prompt_ids, kept, draws):
        """Leave out (and count, with their ``draws``) the prompts with fewer than two usable
        completions: no learning signal for a group objective."""
        keep = [i for i, items in enumerate(kept) if len(items) >= 2]
        self.stats.dropped_groups += len(kept) - len(keep)
        self.dropped_draws += [d for i, d in enumerate(draws) if i not in keep]
        pick = lambda xs: [xs[i] for i in keep]  # noqa: E731
        return pick(prompts), pick(prompt_ids), pick(kept), pick(draws)

    @torch.no_grad()
    def _with_ref_logps(self, prompts, prompt_ids, kept, versions=None, draws=None) -> list[RolloutGroup]:
        """Groups of the kept completions (two or more per prompt: see :meth:`_drop_small`) with
        their reference log-probs; ``versions``: each prompt's (oldest, newest) policy version,
        default this searcher's; ``draws``: each prompt's :attr:`RolloutGroup.draw`. Changes no
        counter but the reference pass's own (``ref_tokens``, ``ref_s``): it may run on a thread of
        its own, one pass at a time."""
        flat_prompts, flat_completions, masks = [], [], []
        for ids, items in zip(prompt_ids, kept, strict=True):
            flat_prompts += [ids] * len(items)
            flat_completions += [item[0] for item in items]
            masks += [item[4] for item in items]
        multi_turn = any(m is not None for m in masks)
        if multi_turn:  # whole trajectories (every reply ends with an end token), the model's tokens only
            masks = [m if m is not None else [1] * len(c) for m, c in zip(masks, flat_completions, strict=True)]
        ref = []
        if flat_completions:
            start = time.perf_counter()
            eos = None if multi_turn else self.eos_ids
            args = (self.reference, flat_prompts, flat_completions, self.tokenizer.pad_token_id, eos)
            limits = {
                "micro_batch": self.ref_micro_batch,
                "max_tokens": self.ref_max_tokens,
                "action_masks": masks if multi_turn else None,
            }
            ref = self.ref_passes.sequence_logprobs(*args, **limits).tolist()
            self.ref_s += time.perf_counter() - start
            self.ref_tokens += sum(len(p) + len(c) for p, c in zip(flat_prompts, flat_completions, strict=True))
        groups, i = [], 0
        versions = versions or [(self.version, self.version)] * len(prompts)
        draws = draws or [None] * len(prompts)
        for prompt, ids, items, (oldest, newest), draw in zip(prompts, prompt_ids, kept, versions, draws, strict=True):
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
                    action_masks=masks[i : i + n] if multi_turn else None,
                    draw=draw,
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
            "searcher/reward_timeouts": float(s.reward_timeouts),
            "searcher/engine_busy": self.engine_s / (time.perf_counter() - self.started) if self.started else 0.0,
            "searcher/version": float(self.version),
            "searcher/reference_tokens_per_s": self.ref_tokens / self.ref_s if self.ref_s else 0.0,
            "searcher/reward_mean": self.last_reward_mean,
            "weights/fetch_s": self.fetch_s,
            "weights/load_s": self.load_s,
            **self.weights.metrics(),  # the transport's counters (tba.weights.ray)
        }
        if self.conversations is not None:
            out.update(
                {
                    "searcher/turns_per_conversation": s.turns / s.completions if s.completions else 0.0,
                    "searcher/tool_calls": float(s.tool_calls),
                    "searcher/tool_errors": float(s.tool_errors),
                    "searcher/tool_timeouts": float(s.tool_timeouts),
                    "searcher/environment_errors": float(s.environment_errors),
                    **self.conversations.reward_means(),  # an agent's own (a verifiers rubric's functions)
                }
            )
        out.update(self.reward_stats.metrics())
        return out

    def oldest_version(self) -> int:
        """The oldest weight version a group this searcher sends from now on can start from: its
        own, since a step generates with the weights it holds (the staleness bound counts from it)."""
        return self.version

    def close(self) -> None:
        """Stop the conversations' threads and, for an agent task, its endpoint."""
        if self.conversations is not None:
            self.conversations.close()

    def new_errors(self) -> list[LoggedError]:
        """First traceback of each failing reward function (and environment or agent), each returned
        once (for ``errors.log``)."""
        found = [("reward", e) for e in self.reward_stats.take_new_errors()]
        if self.conversations is not None:  # an environment's or agent's first failure of each kind
            found += [("rollout", e) for e in self.conversations.take_new_errors()]
        where = f"searcher {self.searcher_id}, policy version {self.version}"
        return [LoggedError(kind, f"{where}: {e}") for kind, e in found]
