"""Replay buffer: dedup, eviction, the recent/weighted sampling rule, checkpointing."""

from __future__ import annotations

import pickle
from collections import Counter

import pytest

from tba.buffer import BufferTooSmall, ReplayBuffer
from tba.types import RolloutGroup


def make_group(
    prompt_id: str,
    completions: list[list[int]],
    rewards: list[float] | None = None,
    version: int = 0,
    searcher_id: int = 0,
) -> RolloutGroup:
    k = len(completions)
    return RolloutGroup(
        prompt_id=prompt_id,
        prompt_ids=[ord(c) for c in prompt_id],
        completions=completions,
        rewards=rewards if rewards is not None else [0.0] * k,
        ref_logps=[-1.0 - i for i in range(k)],
        policy_version=version,
        searcher_id=searcher_id,
        sampler_logps=[-2.0 - i for i in range(k)],
        finished=[i % 2 == 0 for i in range(k)],
    )


def fill(buffer: ReplayBuffer, num_prompts: int, k: int = 4, step: int = 0, tag: str = "p") -> None:
    for p in range(num_prompts):
        buffer.add(make_group(f"{tag}{p}", [[p, j] for j in range(k)]), step=step)


def test_add_stores_fields_and_counts_new_rollouts() -> None:
    buffer = ReplayBuffer()
    assert buffer.add(make_group("a", [[1, 2], [3]], rewards=[0.5, 1.0], version=3, searcher_id=2), step=5) == 2
    assert len(buffer) == 2 and buffer.num_prompts == 1
    batch = buffer.sample(1, 2)
    assert batch.prompt_ids == [[ord("a")]]
    by_completion = {r.completion: r for r in batch.rollouts}
    first = by_completion[(1, 2)]
    assert (first.prompt_id, first.reward, first.ref_logp, first.sampler_logp) == ("a", 0.5, -1.0, -2.0)
    assert (first.policy_version, first.arrival_step, first.searcher_id, first.finished) == (3, 5, 2, True)
    assert by_completion[(3,)].finished is False


def test_duplicate_completion_newest_copy_wins() -> None:
    buffer = ReplayBuffer(recent_prob=1.0)
    buffer.add(make_group("a", [[1], [2]], rewards=[0.0, 0.0], version=0), step=0)
    assert buffer.add(make_group("a", [[1]], rewards=[9.0], version=4), step=3) == 0
    assert len(buffer) == 2
    assert buffer.stats()["buffer/duplicates"] == 1.0
    batch = buffer.sample(1, 1)  # the recent path takes the newest rollout: the replaced copy
    (newest,) = batch.rollouts
    assert (newest.completion, newest.reward, newest.policy_version, newest.arrival_step) == ((1,), 9.0, 4, 3)


def test_duplicate_counts_as_newest_for_eviction() -> None:
    buffer = ReplayBuffer(capacity=3, per_prompt_capacity=None)
    buffer.add(make_group("a", [[1], [2], [3]]), step=0)
    buffer.add(make_group("a", [[1]]), step=1)  # refresh [1]: now [2] is the oldest
    buffer.add(make_group("a", [[4]]), step=2)
    assert sorted(r.completion for r in buffer.sample(1, 3).rollouts) == [(1,), (3,), (4,)]


def test_global_capacity_evicts_oldest_first() -> None:
    buffer = ReplayBuffer(capacity=5, per_prompt_capacity=None, recent_prob=0.0)
    buffer.add(make_group("a", [[1], [2], [3]]), step=0)
    buffer.add(make_group("b", [[4], [5], [6]]), step=1)
    assert len(buffer) == 5
    assert buffer.stats()["buffer/evicted"] == 1.0
    kept = {r.completion for r in buffer.sample(2, 3).rollouts}
    assert kept == {(2,), (3,), (4,), (5,), (6,)}  # [1] arrived first and went first
    buffer.add(make_group("c", [[7], [8]]), step=2)
    assert buffer.stats()["buffer/evicted"] == 3.0 and buffer.num_prompts == 2  # "a" is gone
    assert {r.completion for r in buffer.sample(2, 3).rollouts} == {(4,), (5,), (6,), (7,), (8,)}


def test_stale_queue_entries_are_compacted() -> None:
    buffer = ReplayBuffer(capacity=4, per_prompt_capacity=None)
    buffer.add(make_group("a", [[1], [2]]), step=0)
    for step in range(3000):  # every duplicate leaves a stale entry in the eviction queue
        buffer.add(make_group("a", [[1]]), step=step)
    assert len(buffer._fifo) <= 2 * len(buffer) + 1024
    buffer.add(make_group("a", [[3], [4], [5]]), step=3000)
    assert {r.completion for r in buffer.sample(1, 4).rollouts} == {(1,), (3,), (4,), (5,)}


def test_per_prompt_capacity_evicts_that_prompts_oldest() -> None:
    buffer = ReplayBuffer(per_prompt_capacity=3, recent_prob=1.0)
    buffer.add(make_group("a", [[1], [2]]), step=0)
    buffer.add(make_group("b", [[9], [8]]), step=0)
    buffer.add(make_group("a", [[3], [4], [5]]), step=1)
    assert len(buffer) == 5
    assert buffer.stats()["buffer/evicted"] == 2.0
    batch = buffer.sample(2, 3)
    kept = {r.completion for r in batch.rollouts if r.prompt_id == "a"}
    assert kept == {(3,), (4,), (5,)}


def test_emptied_prompt_disappears() -> None:
    buffer = ReplayBuffer(capacity=2, per_prompt_capacity=None, min_completions=1)
    buffer.add(make_group("a", [[1], [2]]), step=0)
    buffer.add(make_group("b", [[3], [4]]), step=1)
    assert buffer.num_prompts == 1
    assert buffer.stats()["buffer/prompts"] == 1.0
    assert {r.prompt_id for r in buffer.sample(1, 2).rollouts} == {"b"}
    with pytest.raises(BufferTooSmall):
        buffer.sample(2, 1)


def test_sample_layout_distinct_prompts_same_prompt_per_group() -> None:
    buffer = ReplayBuffer(recent_prob=0.5, reward_inv_temp=1.0, seed=3)
    fill(buffer, 10, k=8)
    buffer.mark_sync()
    fill(buffer, 5, k=8, tag="q")
    for _ in range(20):
        batch = buffer.sample(6, 4)
        assert batch.group_size == 4 and batch.num_groups == 6 and len(batch.rollouts) == 24
        groups = [batch.rollouts[i * 4 : (i + 1) * 4] for i in range(6)]
        owners = [{r.prompt_id for r in g} for g in groups]
        assert all(len(o) == 1 for o in owners)
        assert len({next(iter(o)) for o in owners}) == 6
        assert all(len({r.completion for r in g}) == 4 for g in groups)
        assert ["".join(map(chr, ids)) for ids in batch.prompt_ids] == [o.pop() for o in owners]


def test_recent_path_uses_prompts_since_sync_and_their_newest() -> None:
    buffer = ReplayBuffer(recent_prob=1.0, per_prompt_capacity=None)
    fill(buffer, 10, k=6, tag="old")
    buffer.mark_sync()
    for p in range(3):
        buffer.add(make_group(f"new{p}", [[p, j] for j in range(6)]), step=1)
    buffer.add(make_group("new0", [[100], [101]]), step=2)
    batch = buffer.sample(3, 2)
    assert sorted(r.prompt_id for r in batch.rollouts) == ["new0"] * 2 + ["new1"] * 2 + ["new2"] * 2
    assert {r.completion for r in batch.rollouts if r.prompt_id == "new0"} == {(100,), (101,)}
    assert {r.completion for r in batch.rollouts if r.prompt_id == "new1"} == {(1, 5), (1, 4)}
    assert batch.stats["buffer/recent_fraction"] == 1.0
    # only 3 recent prompts: the other slots fall back to the whole buffer
    batch = buffer.sample(5, 2)
    assert batch.stats["buffer/recent_fraction"] == pytest.approx(3 / 5)
    assert sum(pid.startswith("new") for pid in {r.prompt_id for r in batch.rollouts}) == 3


def test_previous_window_used_until_new_data_arrives() -> None:
    buffer = ReplayBuffer(recent_prob=1.0)
    fill(buffer, 5, tag="old")
    buffer.mark_sync()
    fill(buffer, 2, tag="mid")
    buffer.mark_sync()  # nothing arrived yet since this publication: "mid" is still the recent set
    buffer.mark_sync()  # a second empty window keeps it too
    batch = buffer.sample(2, 2)
    assert {r.prompt_id for r in batch.rollouts} == {"mid0", "mid1"}
    assert batch.stats["buffer/recent_fraction"] == 1.0
    fill(buffer, 1, tag="new")
    batch = buffer.sample(2, 2)
    assert batch.stats["buffer/recent_fraction"] == 0.5
    assert "new0" in {r.prompt_id for r in batch.rollouts}


def test_uniform_over_prompts_when_not_recent() -> None:
    buffer = ReplayBuffer(recent_prob=0.0, seed=7)
    fill(buffer, 5, k=2)
    fill(buffer, 5, k=20, tag="big")  # more rollouts must not mean more draws
    counts: Counter[str] = Counter()
    draws = 4000
    for _ in range(draws):
        counts[buffer.sample(1, 2).rollouts[0].prompt_id] += 1
    assert len(counts) == 10
    for n in counts.values():
        assert abs(n - draws / 10) < 0.15 * draws / 10


def test_uniform_over_completions_at_zero_inv_temp() -> None:
    buffer = ReplayBuffer(recent_prob=0.0, seed=1)
    buffer.add(make_group("a", [[i] for i in range(4)], rewards=[0.0, 0.0, 0.0, 10.0]), step=0)
    counts = Counter(r.completion for _ in range(2000) for r in buffer.sample(1, 1).rollouts)
    assert all(abs(n - 500) < 75 for n in counts.values()) and len(counts) == 4


def test_large_inv_temp_concentrates_on_high_reward() -> None:
    buffer = ReplayBuffer(recent_prob=0.0, reward_inv_temp=50.0, seed=2)
    rewards = [0.0, 0.1, 0.2, 1.0, 0.9, 0.3]
    buffer.add(make_group("a", [[i] for i in range(6)], rewards=rewards), step=0)
    for _ in range(50):
        batch = buffer.sample(1, 2)
        assert {r.completion for r in batch.rollouts} == {(3,), (4,)}


def test_weighted_draws_see_changes_made_after_sampling() -> None:
    buffer = ReplayBuffer(capacity=5, per_prompt_capacity=None, recent_prob=0.0, reward_inv_temp=50.0)
    buffer.add(make_group("a", [[1], [2], [3]], rewards=[0.0, 0.5, 0.1]), step=0)
    assert {r.completion for r in buffer.sample(1, 1).rollouts} == {(2,)}
    buffer.add(make_group("a", [[4]], rewards=[1.0]), step=1)
    assert {r.completion for r in buffer.sample(1, 1).rollouts} == {(4,)}
    buffer.add(make_group("a", [[1]], rewards=[2.0]), step=2)  # a duplicate's new reward counts
    assert {r.completion for r in buffer.sample(1, 1).rollouts} == {(1,)}
    buffer.add(make_group("b", [[5], [6], [7]]), step=3)  # evicts [2] and [3]
    assert {r.completion for r in buffer.sample(2, 3).rollouts} == {(1,), (4,), (5,), (6,), (7,)}


def test_moderate_inv_temp_matches_softmax() -> None:
    buffer = ReplayBuffer(recent_prob=0.0, reward_inv_temp=1.0, seed=4)
    buffer.add(make_group("a", [[0], [1]], rewards=[0.0, 1.0]), step=0)
    buffer.add(make_group("a", [[2]], rewards=[0.0]), step=0)
    draws = 6000
    counts = Counter(r.completion for _ in range(draws) for r in buffer.sample(1, 1).rollouts)
    expected = 2.718281828 / (2 + 2.718281828)
    assert abs(counts[(1,)] / draws - expected) < 0.03


def test_repeats_fill_small_groups() -> None:
    buffer = ReplayBuffer(recent_prob=1.0)
    buffer.add(make_group("a", [[1], [2], [3]]), step=0)
    batch = buffer.sample(1, 8)
    assert len(batch.rollouts) == 8
    assert [r.completion for r in batch.rollouts[:3]] == [(3,), (2,), (1,)]  # newest first
    assert {r.completion for r in batch.rollouts[3:]} <= {(1,), (2,), (3,)}
    assert batch.stats["buffer/repeat_fraction"] == pytest.approx(5 / 8)
    weighted = ReplayBuffer(recent_prob=0.0, reward_inv_temp=1.0)
    weighted.add(make_group("a", [[1], [2]], rewards=[0.0, 1.0]), step=0)
    batch = weighted.sample(1, 4)
    assert {r.completion for r in batch.rollouts[:2]} == {(1,), (2,)}
    assert batch.stats["buffer/repeat_fraction"] == 0.5


def test_min_completions_gates_eligibility() -> None:
    buffer = ReplayBuffer(min_completions=3)
    buffer.add(make_group("a", [[1], [2]]), step=0)
    assert not buffer.can_sample(1)
    buffer.add(make_group("a", [[2], [3]]), step=1)
    assert buffer.can_sample(1) and not buffer.can_sample(2)


def test_buffer_too_small_message() -> None:
    buffer = ReplayBuffer()
    fill(buffer, 3)
    buffer.add(make_group("lonely", [[1]]), step=0)
    with pytest.raises(BufferTooSmall) as err:
        buffer.sample(5, 4)
    message = str(err.value)
    assert "cannot draw 5 distinct prompts" in message
    assert "only 3 of 4 stored prompts" in message
    assert ">= 2 distinct completions" in message
    assert "trainer.batch_prompts" in message and "buffer.min_groups" in message


@pytest.mark.parametrize(
    "kwargs, text",
    [
        ({"capacity": 0}, "capacity"),
        ({"min_completions": 0}, "min_completions"),
        ({"per_prompt_capacity": 1}, "per_prompt_capacity 1 is below min_completions 2"),
        ({"recent_prob": 1.5}, "recent_prob"),
        ({"recent_prob": -0.1}, "recent_prob"),
        ({"reward_inv_temp": float("nan")}, "reward_inv_temp"),
        ({"flat_weight": 1.5}, "flat_weight"),
        ({"flat_weight": float("nan")}, "flat_weight"),
    ],
)
def test_constructor_validation(kwargs: dict, text: str) -> None:
    with pytest.raises(ValueError, match=text):
        ReplayBuffer(**kwargs)


def test_sample_argument_validation() -> None:
    buffer = ReplayBuffer()
    fill(buffer, 2)
    with pytest.raises(ValueError, match="group_size"):
        buffer.sample(1, 0)


def test_stats_counters() -> None:
    buffer = ReplayBuffer(capacity=6, per_prompt_capacity=4)
    buffer.add(make_group("a", [[1], [2], [3]]), step=0)
    buffer.add(make_group("a", [[3], [4], [5]]), step=1)  # 1 duplicate, 1 over the per-prompt cap
    buffer.add(make_group("b", [[1], [2], [3]]), step=2)  # 1 over the global cap
    assert buffer.stats() == {
        "buffer/size": 6.0,
        "buffer/prompts": 2.0,
        "buffer/eligible_prompts": 2.0,
        "buffer/evicted": 2.0,
        "buffer/duplicates": 1.0,
    }


def test_state_dict_round_trip_resumes_identically() -> None:
    buffer = ReplayBuffer(capacity=50, per_prompt_capacity=6, recent_prob=0.5, reward_inv_temp=1.0, seed=11)
    for step in range(12):
        for p in range(4):
            completions = [[step % 5, p, j] for j in range(4)]
            buffer.add(
                make_group(f"p{(step + p) % 9}", completions, rewards=[0.1 * j for j in range(4)], version=step),
                step=step,
            )
        if step % 3 == 2:
            buffer.mark_sync()
        buffer.sample(3, 4)
    state = pickle.loads(pickle.dumps(buffer.state_dict()))
    restored = ReplayBuffer()
    restored.load_state_dict(state)
    assert len(restored) == len(buffer) and restored.stats() == buffer.stats()
    assert restored.recent_prob == 0.5 and restored.capacity == 50

    def run(b: ReplayBuffer) -> list:
        out = []
        for step in range(12, 20):
            b.add(make_group(f"p{step % 11}", [[step, j] for j in range(3)]), step=step)
            if step % 3 == 0:
                b.mark_sync()
            batch = b.sample(4, 5)
            out.append((batch.prompt_ids, batch.rollouts, batch.stats))
        return out + [b.stats()]

    assert run(buffer) == run(restored)


def _contrast_window(buffer: ReplayBuffer, spread: int, flat: int) -> None:
    """``spread`` prompts whose group has rewards 0 and 1, ``flat`` prompts with all zero."""
    for p in range(spread):
        buffer.add(make_group(f"s{p}", [[p, j] for j in range(4)], rewards=[0.0, 1.0, 0.0, 0.0]), step=0)
    for p in range(flat):
        buffer.add(make_group(f"f{p}", [[p, j] for j in range(4)], rewards=[0.5] * 4), step=0)


def _flat_share(batch) -> float:
    return sum(batch.flat(g) for g in range(batch.num_groups)) / batch.num_groups


def test_one_flat_group_definition_for_the_buffer_the_metrics_online_dpo_and_the_loss_shares() -> None:
    import torch

    from tba.objectives import online_dpo_loss
    from tba.trainer import group_metrics, loss_shares

    # rewards equal up to a reward model's rounding (flat), and apart by 1e-3 (contrast)
    rounding, apart = [0.7, 0.7 + 1e-12, 0.7, 0.7 - 1e-12], [0.7, 0.701, 0.7, 0.7]
    buffer = ReplayBuffer(recent_prob=1.0, flat_weight=0.0, seed=0)
    buffer.add(make_group("flat", [[0, j] for j in range(4)], rewards=rounding), step=0)
    buffer.add(make_group("spread", [[1, j] for j in range(4)], rewards=apart), step=0)
    batch = buffer.sample(2, 4)
    assert [r.prompt_id for r in batch.rollouts[::4]] == ["spread", "flat"]  # contrast first
    assert batch.stats["buffer/recent_flat"] == 0.5
    assert [batch.flat(0), batch.flat(1)] == [False, True]
    assert group_metrics(batch)["train/flat_groups"] == 0.5
    assert loss_shares(batch, [[0], [1]], pairs_only=True) == [1.0, 0.0]  # only the group with a pair weighs
    reward = torch.tensor([r.reward for r in batch.rollouts], dtype=torch.float64)
    logp = torch.zeros(8, dtype=torch.float64)
    _, m = online_dpo_loss(logp, logp, reward, 0.1, 4)
    assert m["pairs"] == 1.0


def test_flat_weight_zero_takes_groups_with_contrast_first() -> None:
    for seed in range(20):
        buffer = ReplayBuffer(recent_prob=1.0, flat_weight=0.0, seed=seed)
        _contrast_window(buffer, spread=2, flat=5)
        batch = buffer.sample(2, 4)
        assert sorted({r.prompt_id for r in batch.rollouts}) == ["s0", "s1"]
        assert batch.stats["buffer/recent_flat"] == pytest.approx(5 / 7)  # what the window held
        assert _flat_share(batch) == 0.0
        # more than the prompts with contrast: the rest are flat ones, none twice
        batch = buffer.sample(4, 4)
        ids = [r.prompt_id for r in batch.rollouts[::4]]
        assert sorted(ids[:2]) == ["s0", "s1"] and all(i.startswith("f") for i in ids[2:]) and len(set(ids)) == 4
        assert _flat_share(batch) == 0.5


def test_flat_weight_sets_the_odds_of_a_flat_group() -> None:
    # one prompt with contrast, one flat, one group a batch: P(flat) = w / (1 + w)
    for weight in (0.25, 1.0):
        buffer = ReplayBuffer(recent_prob=1.0, flat_weight=weight, seed=5)
        _contrast_window(buffer, spread=1, flat=1)
        n = 4000
        flat = sum(_flat_share(buffer.sample(1, 4)) for _ in range(n))
        p = weight / (1 + weight)
        assert abs(flat / n - p) < 5 * (p * (1 - p) / n) ** 0.5  # five binomial standard deviations


def test_flat_weight_reads_the_newest_group_and_leaves_the_replay_path_alone() -> None:
    buffer = ReplayBuffer(recent_prob=1.0, flat_weight=0.0, seed=1)
    _contrast_window(buffer, spread=0, flat=2)
    # f0's newest four rewards now differ (older rollouts were flat): it has contrast
    buffer.add(make_group("f0", [[7, j] for j in range(4)], rewards=[0.0, 0.0, 1.0, 0.0]), step=1)
    for _ in range(20):
        assert buffer.sample(1, 4).rollouts[0].prompt_id == "f0"
    # the replay path (recent_prob 0) still draws every eligible prompt
    buffer.recent_prob = 0.0
    assert {buffer.sample(1, 4).rollouts[0].prompt_id for _ in range(60)} == {"f0", "f1"}


def test_flat_weight_survives_a_checkpoint() -> None:
    buffer = ReplayBuffer(recent_prob=1.0, flat_weight=0.3, seed=2)
    _contrast_window(buffer, spread=3, flat=3)
    restored = ReplayBuffer()
    restored.load_state_dict(buffer.state_dict())
    assert restored.flat_weight == 0.3
    assert [buffer.sample(2, 4).rollouts[0].prompt_id for _ in range(10)] == [
        restored.sample(2, 4).rollouts[0].prompt_id for _ in range(10)
    ]
