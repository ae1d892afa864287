"""The trainer sharded over ranks (``trainer.num_ranks``): FSDP2 over gloo in two CPU processes gives
the 1-rank trainer's step, publishes its weights, checkpoints and resumes, and a dead rank ends the
run with a clear message."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import ray
import torch
from tests.conftest import SMALL_DEMO_ARGS, start_local_ray
from tests.helpers.numerics import adam_first_step_tolerance, assert_reordered_close, batch_tokens
from tests.helpers.processes import session_processes
from tests.helpers.ranks import train_on_ranks
from tests.helpers.trainers import synthetic_groups
from transformers import AutoModelForCausalLM

from tba.buffer import ReplayBuffer
from tba.checkpoint import CheckpointError, latest_checkpoint, load_policy_weights, read_trainer_state, save_checkpoint
from tba.config import TrainerConfig
from tba.metrics import read_metrics
from tba.models.packing import Passes
from tba.objectives import needs
from tba.runtime.ranks import combine_metrics, split_groups, sub_batch
from tba.trainer import loss_shares, rank_passes
from tba.types import Batch, Rollout
from tba.weights import LocalWeightStore

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


def test_groups_are_split_whole_and_balanced_by_tokens():
    sizes = [40, 8, 8, 8, 8, 8, 8, 8]
    parts = split_groups(sizes, 2)
    assert sorted(g for p in parts for g in p) == list(range(8))  # every group once
    assert parts == [[0, 6], [1, 2, 3, 4, 5, 7]]  # longest first, each to the lighter rank: 48 tokens each
    assert split_groups(sizes, 2) == parts  # deterministic
    assert split_groups([5, 5, 5], 3) == [[0], [1], [2]]
    with pytest.raises(ValueError, match="cannot be split"):
        split_groups([5], 2)


def _batch(rewards: list[list[float]]) -> Batch:
    k = len(rewards[0])
    rollouts = [Rollout(f"p{g}", (1, 2), r, -1.0, 0, 0) for g, rs in enumerate(rewards) for r in rs]
    return Batch([[1]] * len(rewards), rollouts, k)


def test_rank_shares_of_the_loss():
    batch = _batch([[0, 1], [1, 1], [0, 0], [1, 0]])
    parts = [[0, 1, 2], [3]]
    assert loss_shares(batch, parts) == [0.75, 0.25]
    pairs = needs("online_dpo").pairs_only  # Online DPO averages over the groups that hold a pair
    assert pairs and loss_shares(batch, parts, pairs) == [0.5, 0.5]  # groups 0 and 3 do
    assert loss_shares(batch, [[1, 2], [0, 3]], pairs_only=True) == [0.0, 1.0]
    assert sub_batch(batch, [1, 3]).rollouts == batch.rollouts[2:4] + batch.rollouts[6:8]


def test_every_rank_runs_as_many_passes_as_the_rank_with_the_most():
    # each pass over sharded weights is a collective: a rank with fewer would leave the others waiting
    batch = _batch([[0, 1]] * 5)
    cfg = TrainerConfig(batch_prompts=5, micro_batch_prompts=1)
    assert rank_passes(batch, [[0, 1, 2], [3, 4]], cfg, Passes()) == 3
    assert rank_passes(batch, [[0, 1, 2], [3, 4]], TrainerConfig(batch_prompts=5), Passes()) == 1


def test_an_empty_pass_adds_nothing_to_the_gradients(tiny_model, tokenizer):
    from tests.helpers.trainers import make_trainer

    trainer = make_trainer(tiny_model, tokenizer, ReplayBuffer(capacity=100, seed=0), LocalWeightStore())
    trainer.ingest(synthetic_groups(tokenizer, n_prompts=4, k=4))
    batch = trainer.buffer.sample(4, 4)
    grads = []
    for passes in (None, 3):
        tiny_model.zero_grad(set_to_none=True)
        metrics = trainer._accumulate_gradients(batch, beta=0.5, passes=passes)
        grads.append([p.grad.clone() for p in tiny_model.parameters() if p.grad is not None])
        assert metrics["train/micro_batches"] == 1.0  # the real ones
    assert len(grads[1]) == len(grads[0]) > 0
    assert all(torch.equal(a, b) for a, b in zip(grads[0], grads[1], strict=True))


def test_ranks_on_a_torch_without_the_fsdp2_they_use_are_refused(monkeypatch):
    from torch.distributed.fsdp import FSDPModule

    from tba.config import ConfigError
    from tba.runtime.ranks import check_fsdp2

    check_fsdp2()
    monkeypatch.delattr(FSDPModule, "set_force_sum_reduction_for_comms")
    with pytest.raises(ConfigError, match=r"upgrade torch .* or train on one rank"):
        check_fsdp2()


def test_rank_metrics_combine_as_one_batch():
    per_rank = [
        {
            "train/loss": 2.0,
            "train/reward_mean": 1.0,
            "train/grad_norm": 3.0,
            "train/micro_batches": 2.0,
            "rank/peak_memory_gb": 1.5,
        },
        {
            "train/loss": 4.0,
            "train/reward_mean": 0.0,
            "train/grad_norm": 3.0,
            "train/micro_batches": 1.0,
            "rank/peak_memory_gb": 1.25,
        },
    ]
    out = combine_metrics(per_rank, sizes=[0.75, 0.25], scales=[0.5, 0.5])
    assert out == {
        "train/loss": 3.0,  # weighted by the loss shares
        "train/reward_mean": 0.75,  # by the group shares
        "train/grad_norm": 3.0,  # global already
        "train/micro_batches": 3.0,
        "train/rank_peak_memory_gb": 1.5,
    }


# ------------------------------------------------------------------ two ranks over gloo


@pytest.fixture(scope="module")
def ray_cpus(_ray_for_the_session, demo_cache):
    start_local_ray()
    return demo_cache


@pytest.mark.parametrize(
    "extra",
    [
        [],
        # LoRA, activation checkpointing and token-budget micro-batches on the ranks, Online DPO's shares
        [
            "--model.lora.r=4",
            "--trainer.gradient_checkpointing=true",
            "--trainer.micro_batch_tokens=200",
            "--objective.type=online_dpo",
        ],
    ],
    ids=["full", "lora-ckpt-micro-dpo"],
)
def test_two_ranks_take_the_one_rank_step(ray_cpus, extra, tmp_path):
    """One step from the same weights: the ranks add the groups' gradients in another order, so
    every number is the 1-rank trainer's up to reordering the batch's token sums (``tokens``). On
    the same rank group: the state before any step, and for the full model a resume from a
    checkpoint of step 1 after step 2 (bit-exact) and a skipped step."""
    one, m1 = train_on_ranks(ray_cpus, 1, extra, steps=1)
    two, _ = train_on_ranks(ray_cpus, 2, extra, steps=0)
    try:
        first = two.buffer.sample(6, two.trainer.group_size)  # the draw train_on_ranks steps on
        # before any step there is no optimizer state, and loading none makes none up (torch's
        # get/set_optimizer_state_dict would take a step of lr 0, so the first real one counts twice)
        fresh = two.trainer.state_dict()
        assert fresh["optimizer"] == {} and fresh["stepped"] is False
        two.trainer.load_state_dict(fresh)
        assert two.trainer.state_dict()["stepped"] is False
        m2 = [two.trainer.step(first)]
        batch = one.buffer.sample(6, one.trainer.group_size)
        tokens = batch_tokens(batch)
        for key in ("train/loss", "train/grad_norm", "train/reward_mean", "train/kl", "train/lr"):
            assert_reordered_close(m2[0][key], m1[0][key], terms=tokens)
        assert m2[0]["train/micro_batches"] >= 2 and m2[0]["train/rank_peak_memory_gb"] > 0
        # both packed (trainer.packing's default): the ranks' rows hold their own groups' sequences
        assert one.trainer.passes.packed and two.trainer.updates.passes.packed and m2[0]["train/padding_fraction"] < 0.5
        # the optimizer's moments, gathered by parameter name: after one step (1 − β₁)·g and
        # (1 − β₂)·g², so the gradients themselves, and their squares (twice the relative error)
        s1, s2 = one.trainer.state_dict(), two.trainer.state_dict()
        names = [n for n, p in one.policy.named_parameters() if p.requires_grad]
        moments = {n: s1["optimizer"]["state"][i] for i, n in enumerate(names)}
        assert set(s2["optimizer"]["state"]) == set(names) and s2["num_ranks"] == 2
        grads = {n: moments[n]["exp_avg"] / 0.1 for n in names}
        for n in names:
            assert_reordered_close(s2["optimizer"]["state"][n]["exp_avg"], moments[n]["exp_avg"], terms=tokens)
            squares = s2["optimizer"]["state"][n]["exp_avg_sq"]
            assert_reordered_close(squares, moments[n]["exp_avg_sq"], terms=4 * tokens)
        # what searchers load: the same keys, the same weights up to what Adam's normalisation makes
        # of the gradients' rounding (tests/helpers/numerics.py: adam_first_step_tolerance)
        p1, p2 = one.trainer.published_state(), two.trainer.published_state()
        assert p1.keys() == p2.keys() and len(p1) > 0
        lr = m1[0]["train/lr"]
        ones = dict(one.policy.named_parameters())
        bounds = {n.replace(".default", ""): adam_first_step_tolerance(grads[n], ones[n], lr, tokens) for n in names}
        by_storage = {p.data_ptr(): n.replace(".default", "") for n, p in ones.items()}
        tied = {k: by_storage[t.data_ptr()] for k, t in one.policy.state_dict().items() if t.data_ptr() in by_storage}
        for key in p1:  # a tied head is published under its own name
            bound = bounds[key] if key in bounds else bounds[tied[key]]
            assert ((p2[key].double() - p1[key].double()).abs() <= bound).all(), key
        if "--model.lora.r=4" in extra:
            assert all("lora_" in key for key in p2)  # the adapter only
        # the driver's copy, synced for checkpoints and evaluation, holds the ranks' weights
        two.trainer.sync_policy()
        for name, p in two.policy.named_parameters():
            if p.requires_grad:
                moved_apart = (p.detach().double() - ones[name].detach().double()).abs()
                assert (moved_apart <= adam_first_step_tolerance(grads[name], ones[name], lr, tokens)).all(), name
        if not extra:  # (a resume on the full model; the other settings change the step, checked above)
            # a checkpoint after step 1, written as a run writes it: the driver's synced copy of the
            # weights (a Hugging Face model) and the ranks' state gathered by parameter name
            state = copy.deepcopy(two.trainer.state_dict())
            ckpt = save_checkpoint(tmp_path, two.policy, two.tokenizer, state, two.buffer.state_dict())
            assert AutoModelForCausalLM.from_pretrained(ckpt).num_parameters() > 0
            # a second step runs on the ranks' updated weights
            ma = two.trainer.step(batch)
            assert all(math.isfinite(v) for v in ma.values())
            pa = {k: v.clone() for k, v in two.trainer.published_state().items()}
            # a resume from the files: back to step 1 on ranks whose weights and moments have moved on
            # (the checkpoint's weights first, as resume() loads them), and the second step again, bit
            # for bit
            saved = read_trainer_state(ckpt)["trainer"]
            assert saved["num_ranks"] == 2
            load_policy_weights(two.policy, ckpt)
            two.trainer.load_state_dict(saved)
            two.trainer.weights = LocalWeightStore()  # a resumed run's: nothing published yet
            assert two.trainer.version == 1
            after = two.trainer.state_dict()
            for name, moments in state["optimizer"]["state"].items():
                for key, value in moments.items():
                    torch.testing.assert_close(after["optimizer"]["state"][name][key], value, rtol=0, atol=0)
            assert after["scheduler"] == state["scheduler"]
            mb = two.trainer.step(batch)
            assert mb["train/loss"] == ma["train/loss"]  # the same state, batch and ranks: bit-exact by design
            pb = two.trainer.published_state()
            assert pa.keys() == pb.keys() and all(torch.equal(pa[k], pb[k]) for k in pa)
            # a step with nothing to train on: every rank's schedule moves on, no weight does
            epoch = two.trainer.state_dict()["scheduler"]["last_epoch"]
            skipped = two.trainer.skip()
            assert two.trainer.version == 3 and skipped["train/skipped_steps"] == skipped["train/empty_steps"] == 1.0
            after = two.trainer.state_dict()
            assert after["scheduler"]["last_epoch"] == epoch + 1 and after["empty_steps"] == 1
            assert all(torch.equal(two.trainer.published_state()[k], pb[k]) for k in pb)
        # a one-rank trainer's state is not resumed by two ranks: the message names the setting
        with pytest.raises(CheckpointError, match="--trainer.num_ranks=1"):
            two.trainer.load_state_dict(one.trainer.state_dict())
    finally:
        two.trainer.updates.close()


# ------------------------------------------------------------------ whole runs


def _cli(tmp_path, cache, name, *args) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tba",
        "train",
        *SMALL_DEMO_ARGS,
        "--logging.progress=false",
        "--trainer.num_ranks=2",  # runtime.rank_cpus by default: the CPU the searcher leaves, halved
        f"--model.cache_dir={cache}",
        f"--run.output_dir={tmp_path}",
        f"--run.name={name}",
        *args,
    ]


@ray.remote(num_cpus=0, max_restarts=0)
class CollectiveStandIn:
    """A rank in a collective: ``fail`` raises at once, as a survivor's collective does when its
    peer's connection resets; ``die`` exits the process after ``delay`` seconds; ``ok`` returns."""

    def step(self, how: str, delay: float = 0.0):
        time.sleep(delay)
        if how == "fail":
            raise RuntimeError("gloo: Read error [127.0.0.1]:6531: Connection reset by peer")
        if how == "die":
            os._exit(1)
        return how


def _stand_in_group(n: int):
    from ray.util.placement_group import placement_group

    from tba.runtime.ranks import RankGroup

    group = RankGroup.__new__(RankGroup)  # the driver's handle, on stand-in actors instead of TrainerRanks
    group.size, group.closed = n, False
    group.group = placement_group([{"CPU": 0.01}])
    group.actors = [CollectiveStandIn.remote() for _ in range(n)]
    return group


def test_a_rank_whose_peer_died_reports_the_death_not_its_own_collective_error(ray_cpus, monkeypatch):
    import tba.runtime.ranks
    from tba.runtime.errors import TrainerRankFailed

    # the news of rank 1's death (a fresh worker, 0.5 s after its call starts) may take longer than the
    # default 10 s on a loaded machine; the wait ends as soon as every other rank has returned
    monkeypatch.setattr(tba.runtime.ranks, "_DEATH_NOTICE_S", 300.0)
    group = _stand_in_group(2)  # rank 0's collective fails first; rank 1 dies a moment later
    with pytest.raises(TrainerRankFailed, match=r"trainer rank 1 died .*--run.resume=true"):
        group._call("step", [("fail",), ("die", 0.5)])
    assert group.closed
    group = _stand_in_group(2)  # no rank died: the failing rank's own error, in full
    with pytest.raises(TrainerRankFailed, match=r"trainer rank 0 failed in step(.|\n)*Connection reset by peer"):
        group._call("step", [("fail",), ("ok",)])


def test_ranks_publish_by_broadcast_and_a_killed_rank_ends_the_run_with_a_clear_message(tmp_path, demo_cache):
    """Trainer ranks with ``runtime.weight_transport=broadcast``: rank 0 opens the run's weight
    channel in its own process and broadcasts what the ranks gathered; the searcher stages the
    broadcasts, and rank 0's counters reach the run's metrics through the driver. Then a rank is
    killed: the run ends with a message that says so and keeps its complete checkpoint."""
    proc = subprocess.Popen(
        _cli(
            tmp_path,
            demo_cache,
            "k",
            "--runtime.type=ray",
            "--runtime.weight_transport=broadcast",
            "--trainer.steps=100000",
            "--eval.every=100000",
            "--trainer.checkpoint_every=6",
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TERM": "dumb"},
        start_new_session=True,
    )
    try:
        deadline = time.time() + 180
        while latest_checkpoint(tmp_path / "k") is None and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        ranks = sorted(pid for pid, cmd in session_processes(proc.pid).items() if cmd.startswith("ray::TrainerRank"))
        assert len(ranks) == 2, f"no checkpoint or no ranks: {proc.poll()} {ranks}"
        os.kill(ranks[1], signal.SIGKILL)
        killed = time.time()
        stderr = proc.communicate(timeout=60)[1]
        took = time.time() - killed
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert "weights: broadcast group formed (the trainer and 1 searcher(s), generation 1)" in stderr
    # step 6 trained on new data at most 4 versions old (the lag bound 4 x sync_interval): generated
    # with weights that the searcher received by broadcast
    (six,) = [
        r for r in read_metrics(tmp_path / "k" / "metrics.jsonl") if r.get("train/loss") is not None and r["step"] == 6
    ]
    assert six["weights/broadcasts"] >= 1 and six["weights/fallbacks"] == 0  # (the first: before the group formed)
    assert six["weights/received"] >= 1 and six["weights/receive_failures"] == 0
    assert six["train/lag_fresh"] <= 4
    assert proc.returncode == 1, stderr[-3000:]
    assert "trainer rank" in stderr and "died" in stderr and "--run.resume=true" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr
    print(f"\nrun ended {took:.1f} s after a rank was killed")
    ckpt = latest_checkpoint(tmp_path / "k")  # complete and loadable
    state = read_trainer_state(ckpt)
    assert state["trainer"]["num_ranks"] == 2 and state["trainer"]["version"] >= 6
    assert json.loads((ckpt / "config.json").read_text())["model_type"] == "llama"
