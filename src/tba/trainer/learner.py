"""The learner: a policy, its optimizer and the objective; one optimizer step at a time.

One call of :meth:`Learner.learn`:

    sequence log-probs of the batch under the policy → the objective's loss → clip gradients
    → AdamW step → LR schedule step; the version moves on by one

Micro-batches hold whole groups, so the per-prompt log Z is always computed from the prompt's
own K completions (the paper's code was only right with one prompt per micro-batch). They are
cut by a count of groups (``micro_batch_prompts``) and a token budget (``micro_batch_tokens``),
and each one's loss is weighted by its share of the batch, so the step equals one pass over the
whole batch. With ``trainer.packing`` (the default) a micro-batch's sequences are packed into rows
with no padding (:mod:`tba.models.packing`), so its token budget (the positions a pass computes)
holds more groups; a model that cannot be packed is padded, with one warning. The learner never
needs the reference model: searchers attach reference log-probs to rollouts.

The learner knows nothing of the replay buffer, of publication or of which versions searchers
see: :class:`tba.trainer.Trainer` joins it to those. Its one tie to publication is
:attr:`Learner.before_write`, which the optimizer calls before it writes the weights (a
publication that still reads them must finish first).

Precision (``trainer.precision``, see :mod:`tba.models.precision`) enters in two places only: the
forward passes run under its autocast, and :meth:`Learner.published_state` casts the weights to the
searchers' dtype.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable

import torch

from tba.config import ObjectiveConfig, TrainerConfig
from tba.models.logprobs import truncate_at_eos
from tba.models.precision import Precision
from tba.objectives import needs, normalised_ess, objective_loss
from tba.schedules import beta_at
from tba.trainer.optimizer import make_optimizer
from tba.trainer.planning import (
    gather_ranks,
    group_lengths,
    group_metrics,
    lag_metrics,
    loss_shares,
    packing_choice,
    plan_groups,
    sequence_lengths,
)
from tba.trainer.updates import LocalUpdates, Updates, check_rank_count
from tba.types import Batch


class Learner:
    def __init__(
        self,
        model: torch.nn.Module,
        cfg: TrainerConfig,
        objective: ObjectiveConfig,
        group_size: int,
        pad_id: int,
        eos_ids: set[int],
        max_new_tokens: int | None = None,
        precision: Precision | None = None,
        publish_dtype: torch.dtype | None = None,
        ranks: Updates | None = None,
        trust_region: float | None = None,
        grad_clip: float | None = None,
        sampler_logps: bool | None = None,
    ):
        """``trust_region`` (TB's band; None: plain TB) and ``grad_clip`` (None: no clipping):
        numbers, as the run plan resolved them (:func:`tba.runtime.policy.make_trainer` builds a
        trainer from a plan; ``auto`` means nothing here). ``precision``: how ``model``
        computes (default fp32); ``publish_dtype``: the dtype that
        published floating weights are cast to (the searchers' ``model.dtype``; None keeps them).
        ``ranks``: trainer ranks (``trainer.num_ranks`` > 1) that hold the sharded policy and its
        optimizer and take the steps; ``model`` is then this process's unsharded copy, brought up to
        date by :meth:`sync_policy` (for evaluation and checkpoints)."""
        self.model = model
        self.cfg = cfg
        self.objective = objective
        self.group_size = group_size
        self.pad_id = pad_id
        self.eos_ids = eos_ids
        self.precision = precision or Precision()
        self.publish_dtype = publish_dtype
        self.max_tokens = objective.max_tokens or max_new_tokens or 1  # Dr. GRPO's constant
        if isinstance(trust_region, str) or isinstance(grad_clip, str):
            raise TypeError(
                f"Trainer takes resolved numbers, not {trust_region!r} / {grad_clip!r}: build it from a run "
                "plan (tba.runtime.policy.make_trainer) or pass the band and the clip"
            )
        self.trust_region = trust_region if needs(objective).balance else None
        self.grad_clip = grad_clip
        if sampler_logps is None:  # (a trainer built from a plan is told: its sampler_logprobs)
            sampler_logps = needs(objective).sampler_logps(objective, self.trust_region)
        self.sampler_logps = sampler_logps  # the rollouts carry them
        self.version = 0  # optimizer steps taken: the version of the current weights
        self.skipped_steps = 0
        self.empty_steps = 0  # steps with nothing to train on (:meth:`learn_nothing`)
        self.oversize_groups = 0  # groups that alone exceeded micro_batch_tokens
        self._log_w: list[torch.Tensor] = []  # this step's log importance weights (objective.tb_ess_lr)
        # called before the optimizer writes the weights: the seconds it waited for a reader of them
        self.before_write: Callable[[], float] = lambda: 0.0
        self.write_wait_s = 0.0  # those seconds since the last step's metrics
        self._synced = -1  # the version whose weights ``model`` holds, with ranks
        self.passes = packing_choice(model, cfg)
        self.updates: Updates = ranks if ranks is not None else LocalUpdates(self)
        self.optimizer = self.scheduler = None  # the ranks hold theirs; ``model`` is this process's copy
        if ranks is None:
            self.optimizer, self.scheduler = make_optimizer(model, cfg)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def published_state(self) -> dict[str, torch.Tensor]:
        """What searchers load: the policy's state dict (a LoRA policy's adapter), floating tensors
        cast once to ``publish_dtype`` (with ranks: gathered from their shards)."""
        return self.updates.published_state(self.publish_dtype)

    def sync_policy(self) -> None:
        """With ranks, load their current weights into ``self.model`` (once per version); without,
        ``self.model`` is the policy itself and this does nothing."""
        if self._synced != self.version:
            self.updates.sync_into(self.model)
            self._synced = self.version

    def learn(self, batch: Batch, started: float | None = None) -> dict[str, float]:
        """One optimizer step on ``batch``; the version moves on by one. ``started``: when the step
        began (``perf_counter``: its rate and seconds count from there), default now."""
        start = time.perf_counter() if started is None else started
        metrics = self.updates.update(batch, self.version)
        positions = metrics.get("train/positions", 0.0)
        if positions:
            metrics["train/padding_fraction"] = 1.0 - metrics["train/tokens"] / positions
            metrics["train/tokens_per_s"] = metrics["train/tokens"] / max(time.perf_counter() - start, 1e-9)
        metrics.update(lag_metrics(batch, self.version))
        metrics.update(group_metrics(batch))
        metrics.update(
            {
                "train/empty_steps": float(self.empty_steps),
                "train/step_s": time.perf_counter() - start,
                **batch.stats,
            }
        )
        return self._advance(metrics)

    def learn_nothing(self) -> dict[str, float]:
        """A step with nothing to train on (``buffer.fresh_only``: the searcher dropped every group
        of the step, for empty completions or failed rewards, as a policy that only answers with
        the end token makes it do): no update, but the version and the learning-rate schedule
        advance as after a step (and the trainer's publications with them), so the run keeps its
        length and the searchers their lag, and a stale sampler (``runtime.extra_lag``) still gets
        newer weights. Counted in ``train/skipped_steps`` (with the steps whose gradients were not
        finite) and ``train/empty_steps``."""
        start = time.perf_counter()
        skipped = self.updates.skip()
        self.empty_steps += 1
        metrics = {
            "train/skipped_steps": skipped.pop("train/skipped_steps"),
            "train/empty_steps": float(self.empty_steps),
            "train/step_s": time.perf_counter() - start,
            **skipped,
        }
        return self._advance(metrics)

    def _advance(self, metrics: dict[str, float]) -> dict[str, float]:
        """The version moves on by one (a step taken or skipped)."""
        self.version += 1
        return metrics

    def skip_update(self) -> dict[str, float]:
        """No optimizer step, one schedule step (the learning rate follows the version): the steps
        skipped so far and the learning rate."""
        self.skipped_steps += 1
        self._schedule_step()
        return {"train/skipped_steps": float(self.skipped_steps), "train/lr": self.optimizer.param_groups[0]["lr"]}

    def _schedule_step(self) -> None:
        """One step of the learning-rate schedule, after the optimizer's or in place of it."""
        with warnings.catch_warnings():  # torch warns when a skipped step precedes the schedule's
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step")
            self.scheduler.step()

    def update(self, batch: Batch, scale: float = 1.0, passes: int | None = None) -> dict[str, float]:
        """Gradients of the objective on ``batch``, clipped, one AdamW step and one schedule step at
        version ``self.version`` (which the caller advances). ``scale`` weights this batch's loss:
        a rank's share of the step's batch, whose gradients the ranks sum. ``passes``: forward and
        backward passes to run at least (a rank runs as many as the rank with the most, since each
        pass is a collective of every rank: see :func:`rank_passes`)."""
        o = self.objective
        beta = beta_at(self.version, o.beta, o.beta_final, o.beta_anneal_steps, o.beta_final_from)
        self._log_w = []
        metrics = self._accumulate_gradients(batch, beta, scale, passes)
        if o.tb_ess_lr:  # this step's learning rate times the batch's ESS (the schedule resets it next step)
            lr_scale = normalised_ess(gather_ranks(torch.cat(self._log_w)))
            for group in self.optimizer.param_groups:
                group["lr"] *= lr_scale
            metrics["train/tb_ess"] = lr_scale
        params = [p for p in self.model.parameters() if p.requires_grad]
        clip = math.inf if self.grad_clip is None else self.grad_clip
        grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        grad_norm = (grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm).item()
        self.write_wait_s += self.before_write()  # a publication that reads these weights must finish first
        if math.isfinite(grad_norm):
            self.optimizer.step()
        else:  # one bad batch must not poison the weights of a long run
            self.skipped_steps += 1
        self.optimizer.zero_grad(set_to_none=True)
        self._schedule_step()  # after the optimizer, so step 0 uses the first warmup value
        if clip < math.inf and math.isfinite(grad_norm):  # what the clip multiplied the gradient by
            metrics["train/clip_scale"] = min(1.0, clip / (grad_norm + 1e-6))
        metrics.update(
            {
                "train/grad_norm": grad_norm,
                "train/beta": beta,
                "train/lr": self.optimizer.param_groups[0]["lr"],
                "train/skipped_steps": float(self.skipped_steps),
            }
        )
        return metrics

    def _accumulate_gradients(
        self, batch: Batch, beta: float, scale: float = 1.0, passes: int | None = None
    ) -> dict[str, float]:
        k, n = self.group_size, batch.num_groups
        plan = plan_groups(batch, self.cfg, self.passes)
        for _ in range(len(plan), passes or 0):  # the gathers and reductions the other ranks wait for
            self._empty_pass(batch)
        if (cost := self.passes.cost(sequence_lengths(batch, list(range(n))))) is not None:
            self._count_oversize([cost([g]) for g in range(n)])  # what each group's pass alone would compute
        else:
            self._count_oversize([k * (p + c) for p, c in group_lengths(batch)])
        weights = loss_shares(batch, plan, needs(self.objective).pairs_only)
        totals: dict[str, float] = {"train/tokens": 0.0, "train/positions": 0.0}
        for groups, share in zip(plan, weights, strict=True):
            rollouts = [r for g in groups for r in batch.group(g)]
            prompts = [batch.prompt_ids[g] for g in groups for _ in range(k)]
            completions = [self._completion(r) for r in rollouts]
            lens = [len(p) for p in prompts], [len(c) for c in completions]
            packed = self.passes.packs(*lens)  # decided once for the pass and its count
            with self.precision.autocast():  # [G*K, T] each, fp32
                token_logp, mask = self.passes.token_logprobs(
                    self.model, prompts, completions, self.pad_id, packed=packed
                )
            token_logp, mask = self._policy_tokens(rollouts, token_logp, mask)
            positions, real = self.passes.positions(*lens, packed=packed)
            totals["train/tokens"] += real
            totals["train/positions"] += positions
            logp = token_logp.sum(-1)  # [G*K]
            ref = torch.tensor([r.ref_logp for r in rollouts], device=logp.device)
            reward = torch.tensor([r.reward for r in rollouts], device=logp.device)
            loss, m = objective_loss(
                self.objective,
                token_logp,
                mask,
                logp,
                ref,
                reward,
                rollouts,
                beta,
                self.group_size,
                self.max_tokens,
                self.trust_region,
                self.sampler_logps,
                self._log_w,
            )
            (loss * (share * scale)).backward()  # micro-batch losses are means: weight by their share of the batch
            kl = m["kl"] if "kl" in m else (logp.detach() - ref).mean().item()
            parts = {
                "train/loss": loss.item(),
                "train/kl": kl,
                **{f"train/{'log_z' if key == 'log_z_mean' else key}": v for key, v in m.items() if key != "kl"},
                "train/reward_mean": reward.mean().item(),
                "train/completion_len": sum(len(r.completion) for r in rollouts) / len(rollouts),
            }
            size = len(groups) / n  # metrics are means over the batch's groups; the loss as weighted
            for key, value in parts.items():
                totals[key] = totals.get(key, 0.0) + value * (share if key == "train/loss" else size)
        totals["train/micro_batches"] = float(len(plan))
        if self.cfg.micro_batch_tokens is not None:
            totals["train/oversize_groups"] = float(self.oversize_groups)
        return totals

    def _empty_pass(self, batch: Batch) -> None:
        """A forward and backward pass that adds nothing to the gradients: one sequence of the batch,
        its loss times 0. With sharded weights it takes part in every rank's gathers and gradient
        reductions, which is all a rank with fewer micro-batches than another must do."""
        rollout = batch.group(0)[0]
        with self.precision.autocast():
            token_logp, _ = self.passes.token_logprobs(
                self.model, [batch.prompt_ids[0]], [self._completion(rollout)], self.pad_id
            )
        (token_logp.sum() * 0.0).backward()

    def _completion(self, rollout) -> list[int]:
        """The tokens of ``rollout`` the policy is scored on: a completion up to its first EOS; a
        multi-turn trajectory (with an action mask) whole, since each of its turns ends with one."""
        if rollout.action_mask is not None:
            return list(rollout.completion)
        return truncate_at_eos(list(rollout.completion), self.eos_ids)

    @staticmethod
    def _policy_tokens(rollouts, token_logp: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The log-probs and mask of the tokens the policy wrote: an environment's tokens in a
        multi-turn trajectory (action mask 0) are conditioning, zeroed out of both, so every
        objective's sums leave them out."""
        if all(r.action_mask is None for r in rollouts):
            return token_logp, mask
        action = torch.ones(mask.shape, dtype=mask.dtype)  # built on the host, moved once
        for i, r in enumerate(rollouts):
            if r.action_mask is not None:
                n = min(len(r.action_mask), action.shape[1])
                action[i, :n] = torch.tensor(r.action_mask[:n], dtype=action.dtype)
        action = action.to(mask.device)
        return token_logp * action, mask * action

    def _count_oversize(self, tokens: list[int]) -> None:
        """Count the groups that alone exceed ``micro_batch_tokens`` (each runs alone); warn at the first.
        ``tokens``: each group's tokens as the budget counts them (the positions its pass computes)."""
        budget = self.cfg.micro_batch_tokens
        over = [t for t in tokens if budget is not None and t > budget]
        if over and not self.oversize_groups:
            warnings.warn(
                f"a group of {self.group_size} completions needs {over[0]} tokens, more than "
                f"trainer.micro_batch_tokens={budget}; such groups run alone in a micro-batch (counted in "
                "train/oversize_groups). Raise the budget, or lower generation.max_new_tokens, if memory is short",
                stacklevel=4,
            )
        self.oversize_groups += len(over)

    def step_state(self, optimizer: dict | None = None) -> dict:
        """This process's optimizer steps: the counters, the schedule and the optimizer's state
        (``optimizer``: that state in another form, a rank's gathered by parameter name)."""
        return {
            "skipped_steps": self.skipped_steps,
            "oversize_groups": self.oversize_groups,
            "optimizer": self.optimizer.state_dict() if optimizer is None else optimizer,
            "scheduler": self.scheduler.state_dict(),
        }

    def load_step_state(self, state: dict, optimizer: bool = True) -> None:
        """Restore :meth:`step_state`; ``optimizer=False`` leaves the optimizer's state to the
        caller (a rank sets its shard from the gathered state)."""
        self.skipped_steps = state["skipped_steps"]
        self.oversize_groups = state.get("oversize_groups", 0)  # absent from checkpoints before it existed
        if optimizer:
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def state_dict(self) -> dict:
        return {"version": self.version, "empty_steps": self.empty_steps, **self.updates.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned. With ranks, ``self.model``'s weights go to them
        too (a resume loads the checkpoint's weights into ``self.model`` first)."""
        check_rank_count(state, self.updates.size)
        self.version = state["version"]
        self.empty_steps = state.get("empty_steps", 0)  # absent from checkpoints before it existed
        self.updates.load_state_dict(self.model, state)
        self._synced = self.version
