"""A trainer on several devices: the policy sharded over ``trainer.num_ranks`` processes with FSDP2.

    driver (tba train): replay buffer, bounds, weight store, metrics, checkpoints, searchers (sync)
        │ each step: the batch's groups split over the ranks (whole groups, balanced by tokens)
        ▼
    rank 0 … rank N-1: one torch.distributed group (NCCL on GPUs, gloo on CPUs); each holds
        1/N of every weight, gradient and AdamW moment; a step gathers each decoder layer's weights
        for its forward and backward, sums the ranks' gradients (reduce-scatter), clips by the global
        norm and steps its own shard

The ranks are Ray actors in one placement group (all on one node, packed): both runtimes start
them the same way, Ray gives each its GPU, and a rank whose process dies is reported to the
driver by its next call's error instead of a hang (:class:`RankGroup` waits on all ranks at
once and stops at the first failure). The driver keeps an unsharded copy of the policy for
evaluation and checkpoints, refreshed from the ranks when it needs it.

Sharding is per decoder layer (the model's ``_no_split_modules``), then the root (embeddings,
final norm, output head); the root keeps its weights gathered from forward to backward, because
the lean log-prob path applies the output head to the hidden states after the model's forward
(:func:`tba.models.logprobs.head_logprobs`). Gradients are summed over ranks, not averaged: each
rank's loss is weighted by its share of the batch, so a step equals the 1-rank trainer's step on
the whole batch. ``trainer.precision=bf16-mixed`` becomes FSDP2's mixed-precision policy (bf16
weights gathered for compute, gradients reduced in fp32, fp32 master shards).

Publication and checkpoints gather full tensors to rank 0 (on its CPU; publication casts each to
the searchers' dtype on the device first). Rank 0 puts published
weights on the ray runtime's weight board itself (once into Ray's object store, not through the
driver); in the sync runtime, and for checkpoints, it hands them to the driver. The weight store and
the checkpoint format are those of the 1-rank trainer (a Hugging Face folder for the weights), with
the optimizer state gathered by parameter name.
"""

from __future__ import annotations

import datetime
import socket
import sys
import time
import warnings

import ray
import torch
import torch.distributed as dist
from ray.exceptions import RayActorError, RayError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

from tba.config import Config, ConfigError, ObjectiveConfig, TrainerConfig, build_config
from tba.models.lora import is_lora, load_policy_state, policy_state, published_state
from tba.models.precision import PeakMemory, Precision, cpu_rss_bytes
from tba.objectives.needs import needs
from tba.plan import Plan
from tba.runtime.errors import TrainerRankFailed
from tba.runtime.policy import load_trainer_policy, make_trainer, quiet_transformers, seed_everything
from tba.runtime.sharding import check_fsdp2, combine_metrics, load_sharded, shard_policy, split_groups, sub_batch
from tba.trainer import group_lengths, group_tokens, loss_shares, rank_passes
from tba.types import Batch
from tba.weights import Sender
from tba.weights.ray.channel import Channel, channel_sender

RANK_TIMEOUT_S = 1800.0
"""How long a rank waits in a collective for the others: a rank that dies is seen by the driver
long before (its next call fails), which then stops the others; this only bounds a hang."""


_POLL_S = 1.0  # how often the driver checks that the ranks it waits for are alive


_DEATH_NOTICE_S = 10.0  # how long a rank's failure waits for news that another rank died (the cause)


@ray.remote
class TrainerRank:
    """One rank of the trainer: a shard of the policy and of its optimizer."""

    def __init__(self, cfg_data: dict, plan_data: dict, rank: int, world: int):
        self.sender: Sender | None = None  # rank 0's side of the run's weight channel, opened at its first publication
        self.plan = Plan.from_dict(plan_data)
        torch.set_num_threads(self.plan.rank_threads)
        self.cfg: Config = build_config(cfg_data)
        self.rank, self.world = rank, world
        self.trainer = None

    def address(self) -> tuple[str, int]:
        """Where rank 0 listens for the others: this node's address and a free port."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def join(self, host: str, port: int, pad_id: int, eos_ids: set[int]) -> tuple[bool, int | str | None]:
        """Join the process group, load the policy, shard it, build the optimizer; whether its
        passes are packed and in rows of what width (the same on every rank: the ranks plan their
        passes alike, since each pass is a collective)."""

        warnings.filterwarnings("ignore", message=".*returned a view tensor.*")  # hidden states are read, not changed
        quiet_transformers()
        cfg, plan = self.cfg, self.plan
        device = plan.torch_device
        if device.type == "cuda":  # Ray made this rank's GPU the only visible one
            device = torch.device("cuda", 0)
            torch.cuda.set_device(device)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            init_method=f"tcp://{host}:{port}",
            rank=self.rank,
            world_size=self.world,
            timeout=datetime.timedelta(seconds=RANK_TIMEOUT_S),
            # NCCL: the group is bound to this GPU and connects now, so a failure shows here, not in a step
            device_id=device if device.type == "cuda" else None,
        )
        self.base_rss = cpu_rss_bytes()  # before the model: what a benchmark subtracts
        seed_everything(cfg.run.seed)  # every rank loads the same weights (an adapter's initialisation too)
        precision = Precision(plan.precision, device.type)
        # on a GPU the full model is read into host memory and sharded onto the GPU layer by layer
        # (model.dtype=auto resolved for the GPU it ends on: a LoRA policy's frozen base stays bf16)
        load_on, m = device, cfg.model
        if device.type == "cuda":
            load_on = torch.device("cpu")
            m = m.model_copy(update={"dtype": plan.dtype})
        policy = load_trainer_policy(m, cfg.trainer, plan.policy, load_on, precision)
        model = shard_policy(policy, precision, device)
        self.trainer = make_trainer(cfg.trainer, cfg.objective, cfg.generation, plan, model, pad_id, eos_ids, precision)
        self.peak = PeakMemory(device)
        return self.trainer.passes

    def update(self, batch: Batch, version: int, scale: float, passes: int | None = None) -> dict[str, float]:
        t = self.trainer
        t.version = version
        metrics = t.update(batch, scale, passes)
        metrics["rank/peak_memory_gb"] = self.peak.read()
        return metrics

    def _gather(self) -> dict[str, torch.Tensor]:
        # tensor by tensor onto rank 0's CPU; a LoRA policy's frozen base is never needed (the adapter is)
        frozen = is_lora(self.trainer.model)
        options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen)
        return get_model_state_dict(self.trainer.model, options=options)  # rank 0 only; {} elsewhere

    def published_state(self, dtype_name: str | None) -> dict[str, torch.Tensor] | None:
        """What searchers load, gathered (rank 0 returns it; the others None): tensor by tensor, each
        cast to the searchers' dtype on the device before it moves to rank 0's host memory, so neither
        a GPU nor the host holds the model twice, and nothing travels in fp32 that searchers hold in
        bf16. A LoRA policy's frozen base is not gathered."""
        from torch.distributed.tensor import DTensor  # (torch 2.5: see sharding.shard_policy)

        model = self.trainer.model
        dtype = getattr(torch, dtype_name) if dtype_name else None
        trainable = {n for n, p in model.named_parameters() if p.requires_grad} if is_lora(model) else None
        state = {}
        for name, value in model.state_dict().items():  # the same names in the same order on every rank
            if trainable is not None and name not in trainable:
                continue
            full = value.full_tensor() if isinstance(value, DTensor) else value  # a collective of all ranks
            if self.rank == 0:
                state[name] = (full.to(dtype) if dtype is not None and full.is_floating_point() else full).to("cpu")
        return published_state(model, state) if self.rank == 0 else None

    def publish(self, channel: Channel, version: int, dtype_name: str | None) -> dict[str, float] | None:
        """Gather what searchers load and publish it through the run's weight channel from rank 0
        (ray runtime): the weights go from this process to the searchers once, not through the driver.
        Rank 0 returns its sender's counters (the others None)."""

        state = self.published_state(dtype_name)
        if self.rank == 0:
            if self.sender is None:
                self.sender = channel_sender(channel, lambda m: print(m, file=sys.stderr, flush=True))
            self.sender.publish(state, version)
            return self.sender.metrics()
        return None

    def policy_state(self) -> dict[str, torch.Tensor] | None:
        """The trainable part of the policy's state dict, gathered (rank 0; the others None)."""

        state = self._gather()
        return policy_state(self.trainer.model, state) if self.rank == 0 else None

    def state_dict(self) -> dict | None:
        """The optimizer state gathered by parameter name, the schedule and the counters (rank 0)."""

        t = self.trainer
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        # an optimizer that has not stepped has no state; asking for it would make one with a step of
        # lr 0 (torch's _init_optim_state), so that AdamW's first real step would count as its second
        optimizer = get_optimizer_state_dict(t.model, t.optimizer, options=options) if t.optimizer.state else {}
        if self.rank != 0:
            return None
        return {"num_ranks": self.world, "stepped": bool(optimizer), **t.step_state(optimizer)}

    def load_state_dict(self, policy: dict | None, state: dict | None) -> None:
        """Weights (``policy``: :func:`tba.models.lora.policy_state` of the driver's copy, given to rank
        0) and the trainer's state (``state``: what :meth:`state_dict` returned; its optimizer part given
        to rank 0, the schedule and counters to every rank); None: weights only."""

        t = self.trainer
        load_sharded(t.model, policy, self.rank)
        if state is None:  # weights only (loading an empty optimizer state would count a step in AdamW)
            return
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
        if state.get("stepped", True):  # (as in state_dict: loading no state would count a step)
            set_optimizer_state_dict(t.model, t.optimizer, state.get("optimizer", {}), options=options)
        t.load_step_state(state, optimizer=False)
        t.version = state["version"]

    def skip(self) -> dict[str, float]:
        """A step with nothing to train on: the schedule advances (see ``Trainer.skip``)."""
        return self.trainer.skip_update()

    def memory(self) -> dict[str, float]:
        """This process's resident memory (GiB) before the model was loaded and now."""
        return {"base_gb": self.base_rss / 2**30, "rss_gb": cpu_rss_bytes() / 2**30}


class RankGroup:
    """The driver's handle on the trainer ranks: starts them, splits each step's batch over them,
    gathers what they hold, and turns a rank's death into :class:`TrainerRankFailed`."""

    def __init__(
        self,
        cfg_data: dict,
        t: TrainerConfig,
        o: ObjectiveConfig,
        plan: Plan,
        pad_id: int,
        eos_ids: set[int],
        log=print,
        initial: dict[str, torch.Tensor] | None = None,
    ):
        """``cfg_data``: the run's config as data, which each rank builds its part from; ``trainer``
        and ``objective``: its sections that the split of a batch reads. ``initial``: weights to
        start from instead of what each rank loads (a LoRA adapter's initialisation, so that the
        ranks start where the driver's copy does)."""
        n = t.num_ranks
        check_fsdp2()
        self.size, self.trainer_cfg, self.objective, self.closed = n, t, o, False
        gpu = plan.torch_device.type == "cuda"
        cpus = plan.rank_cpus
        bundle = {"GPU": 1, "CPU": cpus} if gpu else {"CPU": cpus}
        total = ray.cluster_resources()
        if any(total.get(key, 0) < n * amount for key, amount in bundle.items()):
            raise ConfigError(
                f"trainer.num_ranks={n} needs {n} x {bundle} and the Ray cluster has {total.get('CPU', 0):g} CPUs "
                f"and {total.get('GPU', 0):g} GPUs in all; lower trainer.num_ranks or runtime.rank_cpus"
            )
        self.group = placement_group([bundle] * n, strategy="STRICT_PACK")
        if not ray.wait([self.group.ready()], timeout=120)[0]:
            remove_placement_group(self.group)
            free = ray.available_resources()
            raise ConfigError(
                f"trainer.num_ranks={n} needs {n} x {bundle} on one node and Ray could not place them within "
                f"120 s (free now: {free.get('CPU', 0):g} CPUs, {free.get('GPU', 0):g} GPUs); lower "
                "trainer.num_ranks or runtime.rank_cpus"
            )
        plan_data = plan.to_dict()
        self.actors = [
            TrainerRank.options(
                num_cpus=cpus,
                num_gpus=1 if gpu else 0,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=r),
            ).remote(cfg_data, plan_data, r, n)
            for r in range(n)
        ]
        host, port = self._call("address", [()], ranks=[0])[0]
        packing = self._call("join", [(host, port, pad_id, eos_ids)] * n)
        if len(set(packing)) > 1:
            raise RuntimeError(f"trainer ranks disagree on packing ({packing}): the same model must pack on every rank")
        self.passes = packing[0]
        if initial is not None:
            self._call("load_state_dict", [(initial, None)] + [(None, None)] * (n - 1))
        log(f"trainer: {n} ranks ({'NCCL on GPUs' if gpu else 'gloo on CPUs'}), FSDP2 per decoder layer")

    def update(self, batch: Batch, version: int) -> dict[str, float]:
        if self.passes.packed:  # the ranks balanced by the tokens they compute
            sizes = group_tokens(batch)
        else:
            sizes = [batch.group_size * (p + c) for p, c in group_lengths(batch)]
        parts = split_groups(sizes, self.size)
        scales = loss_shares(batch, parts, needs(self.objective).pairs_only)
        # equal on every rank: each pass is a collective
        passes = rank_passes(batch, parts, self.trainer_cfg, self.passes)
        per_rank = self._call(
            "update", [(sub_batch(batch, p), version, s, passes) for p, s in zip(parts, scales, strict=True)]
        )
        self.last_rank_metrics = per_rank
        return combine_metrics(per_rank, [len(p) / batch.num_groups for p in parts], scales)

    def published_state(self, dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
        return self._call("published_state", [(_dtype_name(dtype),)] * self.size)[0]

    def publish(self, weights: Sender, version: int, dtype: torch.dtype | None) -> None:
        """Publish the ranks' weights as ``version``: from rank 0 through the run's weight channel
        (the ray runtime: ``weights.spec()``), else gathered into this process and through ``weights``."""
        channel = weights.spec()
        if channel is None:
            weights.publish(self.published_state(dtype), version)
        else:
            counters = self._call("publish", [(channel, version, _dtype_name(dtype))] * self.size)[0]
            weights.published_elsewhere(version, counters)

    def policy_state(self) -> dict[str, torch.Tensor]:
        return self._call("policy_state", [()] * self.size)[0]

    def state_dict(self) -> dict:
        return self._call("state_dict", [()] * self.size)[0]

    def sync_into(self, model: torch.nn.Module) -> None:
        """``model`` (the driver's copy) takes the ranks' current weights."""
        load_policy_state(model, self.policy_state())

    def load_state_dict(self, model: torch.nn.Module, state: dict) -> None:
        """The checkpoint's weights (in ``model``) and optimizer state to the ranks."""
        light = {k: v for k, v in state.items() if k != "optimizer"}  # rank 0 sends the optimizer's shards
        self._call("load_state_dict", [(policy_state(model), state)] + [(None, light)] * (self.size - 1))

    def skip(self) -> dict[str, float]:
        """Every rank skips a step (``Trainer.skip``): the steps skipped so far and the learning rate."""
        return self._call("skip", [()] * self.size)[0]

    def memory(self) -> list[dict[str, float]]:
        return self._call("memory", [()] * self.size)

    def close(self) -> None:
        """Stop the ranks and free their placement group (again: nothing)."""
        if self.closed:
            return
        self.closed = True
        for actor in self.actors:
            ray.kill(actor)
        remove_placement_group(self.group)

    def _call(self, method: str, args: list[tuple], ranks: list[int] | None = None) -> list:
        """``method(*args[i])`` on each rank (``ranks``: which; default all), waiting for all of them;
        the first failure kills the others (which would wait in a collective for the failed one)
        and raises :class:`TrainerRankFailed`."""
        ranks = ranks if ranks is not None else list(range(self.size))
        refs = [getattr(self.actors[r], method).remote(*a) for r, a in zip(ranks, args, strict=True)]
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            for ref in done:
                try:
                    ray.get(ref)
                except RayError as err:
                    r = ranks[refs.index(ref)]
                    if not isinstance(err, RayActorError):  # a peer's death shows first as a collective's error
                        r, err = self._death_behind(refs, ranks, r, err)
                    self.close()
                    if isinstance(err, RayActorError):
                        raise TrainerRankFailed(
                            f"trainer rank {r} died ({_first_line(err)}); the run stops. The checkpoints written "
                            "so far are intact: continue with --run.resume=true"
                        ) from None
                    raise TrainerRankFailed(f"trainer rank {r} failed in {method}; the run stops.\n{err}") from None
        return ray.get(refs)

    def _death_behind(self, refs: list, ranks: list[int], r: int, err: RayError) -> tuple[int, RayError]:
        """Rank ``r`` failed with ``err``; when another rank died, the survivors' collective fails
        too (a connection reset), often before Ray reports the death. Wait a little for the other
        ranks' results: the first one that died is the cause to report, else ``r``'s own error."""
        others = [ref for ref in refs if ranks[refs.index(ref)] != r]
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while others and time.monotonic() < deadline:
            done, others = ray.wait(others, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as death:
                    return ranks[refs.index(ref)], death
                except RayError:
                    pass
        return r, err


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def _first_line(err: Exception) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__
