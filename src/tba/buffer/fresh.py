"""On-policy training without replay (``buffer.fresh_only``): a step's batch is exactly the groups
just generated."""

from __future__ import annotations

import random

from tba.buffer.replay import BufferTooSmall, ReplayBuffer
from tba.types import Batch, RolloutGroup


def fresh_batch(groups: list[RolloutGroup], group_size: int, step: int, rng: random.Random) -> Batch:
    """A batch of exactly the groups just generated, for on-policy training without replay
    (``buffer.fresh_only``): no deduplication (a completion sampled twice counts twice, as it
    does for the on-policy baselines), every rollout stamped as arriving at ``step``. A group with
    more than ``group_size`` completions gives its first ``group_size``; one with fewer (completions
    dropped by a reward function that failed on them) fills up with repeats of its own, counted in
    ``buffer/repeat_fraction``; a group with none is left out."""
    prompt_ids, rollouts, repeats = [], [], 0
    for group in groups:
        if not group.completions:
            continue
        own = [ReplayBuffer._make_rollout(group, i, step) for i in range(min(group_size, len(group.completions)))]
        fill = group_size - len(own)
        repeats += fill
        prompt_ids.append(list(group.prompt_ids))
        rollouts.extend(own + rng.choices(own, k=fill))
    if not prompt_ids:
        raise BufferTooSmall("no completion of this step survived scoring: nothing to train on")
    return Batch(
        prompt_ids=prompt_ids,
        rollouts=rollouts,
        group_size=group_size,
        stats={"buffer/recent_fraction": 1.0, "buffer/repeat_fraction": repeats / len(rollouts)},
    )
