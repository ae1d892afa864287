"""The trainer role: replay buffer in, optimizer steps out, weights published every k steps.

:class:`Learner` (:mod:`tba.trainer.learner`) takes the optimizer steps; :class:`Trainer`
(:mod:`tba.trainer.core`) joins it to the replay buffer and the weights' publication;
:mod:`tba.trainer.planning` cuts each batch into micro-batches and says what the batch held;
:mod:`tba.trainer.updates` holds the two places updates happen (this process, or trainer ranks),
behind one interface.
"""

from tba.trainer.core import Trainer
from tba.trainer.learner import Learner
from tba.trainer.planning import (
    gather_ranks,
    group_lengths,
    group_metrics,
    group_tokens,
    lag_metrics,
    loss_shares,
    packing_choice,
    plan_groups,
    rank_passes,
    sequence_lengths,
)
from tba.trainer.updates import LocalUpdates, Updates, check_rank_count

__all__ = [
    "Learner",
    "LocalUpdates",
    "Trainer",
    "Updates",
    "check_rank_count",
    "gather_ranks",
    "group_lengths",
    "group_metrics",
    "group_tokens",
    "lag_metrics",
    "loss_shares",
    "packing_choice",
    "plan_groups",
    "rank_passes",
    "sequence_lengths",
]
