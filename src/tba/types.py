"""Records that cross component (and, later, process) boundaries.

Plain dataclasses of Python numbers and lists: cheap to pickle, no torch inside, so a searcher on
another machine can send them without sharing tensors or devices.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

# rewards closer than this (relative to the larger of 1 and the first's magnitude) are equal: a
# reward model's scores that differ only in rounding carry no contrast
FLAT_TOLERANCE = 1e-9


def is_flat(rewards: Sequence[float]) -> bool:
    """Whether a group's rewards are all equal (a *flat* group: no reward contrast to learn from).

    The one definition: the buffer's contrast-first draw, the trainer's ``train/flat_groups``,
    Online DPO's pairs and the ranks' loss shares all ask this."""
    return max(rewards) - min(rewards) <= FLAT_TOLERANCE * max(1.0, abs(rewards[0]))


@dataclass
class RolloutGroup:
    """The K completions of one prompt, produced by one searcher with one policy version.

    Sequence log-probs are sums over completion tokens (EOS included, padding excluded).
    """

    prompt_id: str
    prompt_ids: list[int]
    completions: list[list[int]]  # K lists of token ids, each ending at (and including) EOS if finished
    rewards: list[float]
    ref_logps: list[float]
    policy_version: int  # trainer step count of the weights that generated the completions
    searcher_id: int = 0
    sampler_logps: list[float] | None = None  # sequence log-probs under the sampling policy
    finished: list[bool] | None = None  # completion ended with EOS (not cut at max_new_tokens)
    sampler_token_logps: list[list[float]] | None = None  # per completion token, when recorded
    # the newest weights that produced a token of the group, when newer than policy_version (the
    # oldest): a streaming searcher that loads weights with requests in flight
    newest_version: int | None = None
    # multi-turn trajectories: per completion token, 1 where the policy wrote it, 0 where an
    # environment added it (a tool's result, a user's turn): conditioning, never trained on and
    # left out of every log-prob sum. None: every token is the policy's (one turn)
    action_masks: list[list[int]] | None = None
    # the prompt's place among those its searcher has drawn (0, 1, ...: across its restarts and a
    # resumed run), for the trainer's account of every prompt (tba.runtime.ledger); None: untracked
    draw: int | None = None

    def __post_init__(self) -> None:
        k = len(self.completions)
        for name in ("rewards", "ref_logps", "sampler_logps", "finished", "sampler_token_logps", "action_masks"):
            values = getattr(self, name)
            if values is not None and len(values) != k:
                raise ValueError(
                    f"RolloutGroup {self.prompt_id!r}: {name} has {len(values)} entries for {k} completions"
                )
        for i, mask in enumerate(self.action_masks or []):
            if len(mask) != len(self.completions[i]):
                raise ValueError(
                    f"RolloutGroup {self.prompt_id!r}: completion {i} has {len(self.completions[i])} tokens and an "
                    f"action mask of {len(mask)}"
                )

    @property
    def size(self) -> int:
        return len(self.completions)


@dataclass
class Rollout:
    """One completion as the replay buffer stores it."""

    prompt_id: str
    completion: tuple[int, ...]
    reward: float
    ref_logp: float
    policy_version: int
    arrival_step: int  # trainer step at which the buffer received it
    sampler_logp: float | None = None
    finished: bool = True
    searcher_id: int = 0
    sampler_token_logps: tuple[float, ...] | None = None
    action_mask: tuple[int, ...] | None = None  # 0 for environment tokens (see RolloutGroup.action_masks)


@dataclass
class Batch:
    """What the trainer trains on: ``num_groups`` groups of ``group_size`` rollouts each.

    ``rollouts`` is flat, the ``group_size`` completions of each prompt consecutive, matching the
    layout that :func:`tba.objectives.tb_loss` expects.
    """

    prompt_ids: list[list[int]]  # one entry per group
    rollouts: list[Rollout]
    group_size: int
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def num_groups(self) -> int:
        return len(self.prompt_ids)

    def group(self, g: int) -> list[Rollout]:
        """The ``group_size`` rollouts of group ``g``."""
        k = self.group_size
        return self.rollouts[g * k : (g + 1) * k]

    def flat(self, g: int) -> bool:
        """Whether group ``g``'s rewards are all equal (:func:`is_flat`)."""
        return is_flat([r.reward for r in self.group(g)])


@dataclass
class EvalSettings:
    """How evaluation generates: from the ``eval`` and ``generation`` config sections."""

    max_new_tokens: int
    limit: int | None = None  # first N problems only
    samples: int = 1  # n completions per problem for pass@k / maj@k (1: greedy only)
    pass_k: tuple[int, ...] = (1,)
    temperature: float = 1.0
    top_p: float = 1.0
    log_samples: int = 4  # problems whose completions are returned for samples.jsonl
    packing: bool = True  # scoring passes (the KL to the reference) packed where the models can be
    batch_size: int = 256  # prompts a HF generate call takes at a time
    chat_template: bool | None = None  # the prompts' encoding (model.chat_template)


@dataclass
class EvalResult:
    metrics: dict[str, float]  # eval/<name> -> value
    samples: list[dict] = field(default_factory=list)  # records for samples.jsonl
    answers: list[dict] = field(default_factory=list)  # sampled answers per problem, for eval_answers.jsonl


@dataclass
class SearcherReport:
    """What a searcher sends with each batch beside its groups: its counters (``metrics``, declared
    in :mod:`tba.searcher.counters`, the run's metrics combine them) apart from what the trainer's
    side runs the run with (the lag bound, the prompt ledger, restarts, the start-up line)."""

    searcher_id: int
    metrics: dict[str, float]
    place: dict | None = None  # where it is in its prompts (tba.searcher.state.Resumable.place)
    dropped_draws: list[int] = field(default_factory=list)  # draws of groups dropped since the last report
    oldest_version: int = -1  # the oldest weights a group it sends from now on can start from
    incarnation: str = ""  # its process: a restarted searcher is a new incarnation
    node: str = ""  # the Ray node it runs on
    started: dict[str, float] = field(default_factory=dict)  # wall-clock: entered, ready, first_batch


@dataclass(frozen=True)
class LoggedError:
    """A line for a run's ``errors.log``, with what kind of failure it is: ``reward`` (a reward
    function's first traceback: its samples skipped and counted), ``rollout`` (an environment's or an
    agent's first of a kind: those rollouts dropped and counted) or ``notice`` (the run's own: a
    searcher that died or came back, a fall below the start, a slowdown)."""

    kind: str
    text: str
