"""How a step's batch is cut and what is said about it: micro-batches of whole groups under the
token budget, the ranks' shares of the loss and their passes, the packing choice, and the batch's
lag and group metrics."""

from __future__ import annotations

import torch

from tba.models.logprobs import plan_micro_batches, unwrap
from tba.models.packing import Passes
from tba.models.packing_choice import choose_packing
from tba.types import Batch


def lag_metrics(batch: Batch, version: int) -> dict[str, float]:
    """How stale a batch is, for a step that trains weights of ``version``: a rollout's lag is
    ``version`` minus its policy version.

    ``train/lag_mean`` and ``train/lag_max`` cover the whole batch, replayed data included.
    ``train/lag_fresh`` is the mean lag of the rollouts that arrived since the previous step (the
    buffer stamps each with the step it arrived at), so it says how stale the searchers are now;
    it is left out when the batch holds none of them.
    """
    lags = [version - r.policy_version for r in batch.rollouts]
    out = {"train/lag_mean": sum(lags) / len(lags), "train/lag_max": float(max(lags))}
    fresh = [lag for lag, r in zip(lags, batch.rollouts, strict=True) if r.arrival_step == version]
    if fresh:
        out["train/lag_fresh"] = sum(fresh) / len(fresh)
    return out


def group_metrics(batch: Batch) -> dict[str, float]:
    """What the step's groups hold, as fractions of the batch:

    - ``train/flat_groups``: groups whose K rewards are all equal. They carry no reward signal;
      trajectory balance still trains on them (their residuals pull log π − log π_ref of the K
      completions together, toward the reference), GRPO's advantages there are zero;
    - ``train/mixed_groups``: groups whose completions come from more than one policy version
      (assembled from a prompt's stored rollouts);
    - ``train/unfinished``: completions cut at ``generation.max_new_tokens``.
    """
    n = batch.num_groups
    groups = [batch.group(g) for g in range(n)]
    return {
        "train/flat_groups": sum(batch.flat(g) for g in range(n)) / n,
        "train/mixed_groups": sum(len({r.policy_version for r in g}) > 1 for g in groups) / n,
        "train/unfinished": sum(not r.finished for r in batch.rollouts) / len(batch.rollouts),
    }


def gather_ranks(values: torch.Tensor) -> torch.Tensor:
    """``values`` of every trainer rank, concatenated (this rank's alone outside a process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return values
    parts: list = [None] * dist.get_world_size()
    dist.all_gather_object(parts, values.cpu())
    return torch.cat(parts)


def group_lengths(batch: Batch) -> list[tuple[int, int]]:
    """(prompt length, longest completion) of each group of ``batch``, in tokens: the group's padded
    size is group_size × their sum."""
    return [(len(batch.prompt_ids[g]), max(len(r.completion) for r in batch.group(g))) for g in range(batch.num_groups)]


def loss_shares(batch: Batch, parts: list[list[int]], pairs_only: bool = False) -> list[float]:
    """Each part's share of the batch's loss, ``parts`` being lists of group indices (a step's
    micro-batches, or its trainer ranks, whose losses are weighted by it before their gradients are
    summed). Losses are means over groups (or over their completions, K per group), so the share
    is the part's fraction of the groups; Online DPO averages over the groups whose rewards differ
    (the others hold no pair: ``pairs_only``), so there it is its fraction of those."""
    n = batch.num_groups
    sizes = [len(p) / n for p in parts]
    if not pairs_only:
        return sizes
    pairs = [sum(not batch.flat(g) for g in p) for p in parts]
    total = sum(pairs)
    return [p / total for p in pairs] if total else sizes


def group_tokens(batch: Batch) -> list[int]:
    """Real tokens of each group of ``batch``: its completions and a prompt for each."""
    return [sum(len(batch.prompt_ids[g]) + len(r.completion) for r in batch.group(g)) for g in range(batch.num_groups)]


def sequence_lengths(batch: Batch, groups: list[int]) -> list[list[tuple[int, int]]]:
    """(prompt, completion) lengths of each sequence of ``groups`` of ``batch``, by group: what
    :func:`tba.models.packing.pass_cost` prices."""
    return [[(len(batch.prompt_ids[g]), len(r.completion)) for r in batch.group(g)] for g in groups]


def plan_groups(batch: Batch, cfg, passes: Passes, groups: list[int] | None = None) -> list[list[int]]:
    """The micro-batches of ``groups`` of ``batch`` (default all; as positions in ``groups``) under
    ``cfg``'s limits: the token budget bounds the positions each pass computes, padded, or packed
    where ``passes`` packs (:meth:`tba.models.packing.Passes.cost`)."""
    groups = list(range(batch.num_groups)) if groups is None else groups
    sizes = group_lengths(batch)
    cost = passes.cost(sequence_lengths(batch, groups))
    return plan_micro_batches(
        [sizes[g] for g in groups], batch.group_size, cfg.micro_batch_prompts, cfg.micro_batch_tokens, cost=cost
    )


def rank_passes(batch: Batch, parts: list[list[int]], cfg, passes: Passes) -> int:
    """The most forward and backward passes a rank runs when the ranks take ``parts`` of ``batch``
    (group indices each) under ``cfg``'s micro-batch limits. Every pass over sharded weights is a
    collective (FSDP2 gathers each layer's weights, reduces its gradients): a rank with fewer passes
    runs empty ones up to this count, else the others wait for it until the group times out."""
    return max(len(plan_groups(batch, cfg, passes, part)) for part in parts)


def packing_choice(model: torch.nn.Module, cfg) -> Passes:
    """How the trainer's passes over ``model`` run: packed with ``cfg.packing`` and a model that can
    be packed (else one warning, and padding), in rows of ``cfg.packing_row_tokens``."""
    if not cfg.packing:
        return Passes()
    name = type(unwrap(model)).__name__
    return choose_packing(
        model, cfg.packing_row_tokens, "trainer.packing", name, "the trainer pads its batches instead"
    )
