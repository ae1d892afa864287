"""Where the trainer's updates happen: in this process (:class:`LocalUpdates`: the policy and its
optimizer are the trainer's own) or on trainer ranks that hold the sharded policy and its optimizer
(``tba.runtime.ranks.RankGroup``). Both are :class:`Updates`; the trainer calls one of them and
never asks which."""

from __future__ import annotations

from typing import Protocol

import torch

from tba.checkpoint import CheckpointError
from tba.models.lora import published_state
from tba.models.precision import cast_floats
from tba.types import Batch
from tba.weights import Sender, shares_memory


class Updates(Protocol):
    """What takes the trainer's optimizer steps and holds the weights they change."""

    size: int  # processes that hold the policy (1: this one)

    def update(self, batch: Batch, version: int) -> dict[str, float]:
        """One optimizer step on ``batch`` at ``version``; the step's metrics."""
        ...

    def skip(self) -> dict[str, float]:
        """A step with nothing to train on (the schedule advances); ``train/skipped_steps`` so far."""
        ...

    def published_state(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        """What searchers load (a LoRA policy's adapter), floating tensors cast to ``dtype``."""
        ...

    def publish(self, weights: Sender, version: int, dtype: torch.dtype | None) -> None:
        """Publish :meth:`published_state` through ``weights`` as ``version``."""
        ...

    def sync_into(self, model: torch.nn.Module) -> None:
        """Bring ``model`` (the trainer's copy, for evaluation and checkpoints) to the current weights."""
        ...

    def state_dict(self) -> dict:
        """The optimizer, the schedule and the counters, for a checkpoint."""
        ...

    def load_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        """Restore :meth:`state_dict`, with ``model``'s weights (the checkpoint's, loaded first)."""
        ...

    def close(self) -> None: ...


class LocalUpdates:
    """The trainer's own model and optimizer, stepped in this process (no ranks)."""

    size = 1

    def __init__(self, trainer):
        """``trainer``: the :class:`~tba.trainer.learner.Learner` whose model and optimizer these
        are; it keeps their state, and this asks it through its methods."""
        self.trainer = trainer

    def update(self, batch: Batch, version: int) -> dict[str, float]:
        return self.trainer.update(batch)

    def skip(self) -> dict[str, float]:
        return self.trainer.skip_update()

    def published_state(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return cast_floats(published_state(self.trainer.model), dtype)

    def publish(self, weights: Sender, version: int, dtype: torch.dtype | None) -> None:
        """Through ``weights``: a cast that copies is its ``prepare`` (on a
        :class:`~tba.weights.BackgroundPublisher`'s thread, off the trainer's path), and weights
        that alias the model's are marked so (the trainer settles the publication before its
        optimizer writes them)."""
        state = published_state(self.trainer.model)
        floats = [v for v in state.values() if v.is_floating_point()]
        if dtype is not None and floats and all(v.dtype != dtype for v in floats):  # a copy of each trained tensor
            weights.publish(state, version, aliases=True, prepare=lambda s: cast_floats(s, dtype))
        else:
            state = cast_floats(state, dtype)  # as published_state(): no copy, or a few tensors
            weights.publish(state, version, aliases=shares_memory(state, self.trainer.model))

    def sync_into(self, model: torch.nn.Module) -> None:
        """Nothing: the trainer's model is the policy itself."""

    def state_dict(self) -> dict:
        return self.trainer.step_state()

    def load_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        self.trainer.load_step_state(state)

    def close(self) -> None:
        """Nothing to stop."""


def check_rank_count(state: dict, ranks: int) -> None:
    """A checkpoint's optimizer state is resumed by as many ranks as saved it (1 rank keeps torch's
    own format; several, one gathered by parameter name)."""
    saved = state.get("num_ranks", 1)
    if (saved > 1) != (ranks > 1):
        raise CheckpointError(
            f"this checkpoint was written by a trainer of {saved} rank(s) and this run has {ranks}: "
            f"resume it with --trainer.num_ranks={saved}"
        )
