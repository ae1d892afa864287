"""The pieces of the trainer ranks that hold no process: a batch split over the ranks (whole
groups, balanced by tokens), the ranks' metrics combined as one batch's, FSDP2 over a policy (one
unit per decoder layer, then the root) and full weights copied into its shards. The ranks
themselves (Ray actors and the driver's handle on them): :mod:`tba.runtime.ranks`."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tba.config import ConfigError
from tba.models.logprobs import unwrap
from tba.models.precision import Precision
from tba.types import Batch


def split_groups(sizes: list[int], ranks: int) -> list[list[int]]:
    """Group indices per rank: whole groups, each rank at least one, the longest groups placed
    first on the rank with the fewest tokens so far (``sizes[g]``: tokens of group g). Each rank's
    indices keep the batch's order. Deterministic."""
    if len(sizes) < ranks:
        raise ValueError(f"{len(sizes)} groups cannot be split over {ranks} ranks")
    load, parts = [0] * ranks, [[] for _ in range(ranks)]
    for g in sorted(range(len(sizes)), key=lambda g: -sizes[g]):  # stable: ties keep the order
        r = min(range(ranks), key=lambda r: (load[r] if parts[r] else -1, r))  # an empty rank first
        parts[r].append(g)
        load[r] += sizes[g]
    return [sorted(p) for p in parts]


def sub_batch(batch: Batch, groups: list[int]) -> Batch:
    """The groups ``groups`` of ``batch``, as a batch of their own."""
    return Batch([batch.prompt_ids[g] for g in groups], [r for g in groups for r in batch.group(g)], batch.group_size)


# Metrics that are the same on every rank (global after the gradient reduction), and those that
# are counts to add; the rest are means over each rank's groups, combined by its share of them.
_SHARED = ("train/grad_norm", "train/clip_scale", "train/beta", "train/lr", "train/skipped_steps")


_SUMMED = ("train/micro_batches", "train/oversize_groups", "train/tokens", "train/positions")


def combine_metrics(per_rank: list[dict[str, float]], sizes: list[float], scales: list[float]) -> dict[str, float]:
    """One step's metrics from the ranks' own (``sizes``: each rank's fraction of the groups,
    ``scales``: of the loss)."""
    out: dict[str, float] = {}
    for key in dict.fromkeys(k for m in per_rank for k in m):  # every rank's keys, in order
        values = [m[key] for m in per_rank if key in m]
        if key in _SHARED:
            out[key] = values[0]
        elif key in _SUMMED:
            out[key] = float(sum(values))
        elif key.startswith("rank/"):
            continue
        elif key == "train/loss":
            out[key] = sum(m[key] * s for m, s in zip(per_rank, scales, strict=True) if key in m)
        else:
            out[key] = sum(m[key] * s for m, s in zip(per_rank, sizes, strict=True) if key in m) / sum(
                s for m, s in zip(per_rank, sizes, strict=True) if key in m
            )
    peaks = [m["rank/peak_memory_gb"] for m in per_rank if "rank/peak_memory_gb" in m]
    if peaks:
        out["train/rank_peak_memory_gb"] = max(peaks)
    return out


def check_fsdp2() -> None:
    """This torch has the FSDP2 the ranks use (public ``fully_shard``, and sums of gradients over
    ranks without a division: ``set_force_sum_reduction_for_comms``, 2025); else a clear error."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        FSDPModule = None  # noqa: N806
    if FSDPModule is None or not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise ConfigError(
            f"trainer.num_ranks > 1 needs FSDP2 with set_force_sum_reduction_for_comms, which torch "
            f"{torch.__version__} lacks: upgrade torch (2.9 has it) or train on one rank (trainer.num_ranks=1)"
        )


def shard_policy(model: torch.nn.Module, precision: Precision, device: torch.device | None = None) -> torch.nn.Module:
    """FSDP2 over ``model`` in the current process group: one unit per decoder layer, then the root,
    which stays gathered from forward to backward (the output head is applied after the forward).
    Gradients are summed over ranks (each rank weights its loss by its share). ``device``: where the
    shards live (default: where the model is); a model on the CPU moves there layer by layer, each
    rank keeping only its shard, so no GPU ever holds the whole model."""
    # FSDP2's public path (torch 2.6) and DTensor's (2.5) are imported where used: an older torch then
    # stops at check_fsdp2's message, not at this module's import
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    base = unwrap(model)
    names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ConfigError(
            f"trainer.num_ranks > 1 shards the model per decoder layer, and {type(base).__name__} names no "
            "decoder layer class (_no_split_modules); train it with trainer.num_ranks=1"
        )
    policy = MixedPrecisionPolicy()
    if precision.mode == "bf16-mixed":
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # the mesh on the model's device type: FSDP2's default is the machine's accelerator, so CPU ranks
    # on a GPU machine (which Ray leaves every GPU visible to) would shard onto CUDA
    device_type = device.type if device is not None else next(model.parameters()).device.type
    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=False)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)  # a sum: each rank's loss carries its share already
            m.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    return model


@torch.no_grad()
def load_sharded(model: torch.nn.Module, state: dict[str, torch.Tensor] | None, rank: int) -> None:
    """Copy full tensors, held by rank 0 (``state``; None elsewhere), into each rank's shards of the
    parameters of the same names, in place (the parameters that FSDP2 and the optimizer hold stay
    the same objects). Every rank calls this."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # (torch 2.5: see shard_policy)

    names = [sorted(state) if rank == 0 else None]
    dist.broadcast_object_list(names, src=0)
    params = dict(model.named_parameters(remove_duplicate=False))  # tied weights under each name
    unknown = [n for n in names[0] if n not in params]
    if unknown:
        raise ValueError(f"weights for parameters this model does not have: {unknown[:3]}")
    for name in names[0]:
        param = params[name]
        if not isinstance(param, DTensor):  # not sharded: the same on every rank
            full = state[name].to(param.device, param.dtype) if rank == 0 else torch.empty_like(param)
            dist.broadcast(full, src=0)
            param.copy_(full)
            continue
        local = param.to_local()
        full = state[name] if rank == 0 else None
        full = full.to(local.device, local.dtype) if full is not None else local.new_empty(param.shape)
        local.copy_(distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=0).to_local())
