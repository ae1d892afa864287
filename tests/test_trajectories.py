"""Multi-turn trajectories in the buffer and the trainer: the tokens an environment added (action
mask 0) are conditioning, never trained on; they survive the buffer's checkpoints."""

from __future__ import annotations

import pickle

import pytest
import torch
from tests.helpers.numerics import assert_reordered_close, model_terms

from tba.buffer import ReplayBuffer
from tba.types import Batch, Rollout, RolloutGroup

ENV = [9, 9, 12]  # a tool's answer, three tokens


def _batch(env_tokens: list[int], masked: bool = True) -> Batch:
    """Two groups of two trajectories: a model turn, and an environment's answer that ends it (a
    turn limit reached right after a tool call); one trajectory of each group is a plain answer.
    ``masked`` False: the environment's tokens marked as the policy's, as if the mask were lost."""
    prompts = [[1, 5, 6, 7], [1, 8, 9]]
    rollouts = []
    for g in range(len(prompts)):
        turn = [3 + g, 4, 5, 2]  # the model's call, ending with the turn's end token (EOS)
        trajectory = tuple(turn + env_tokens)
        mask = tuple([1] * len(turn) + [0 if masked else 1] * len(env_tokens))
        rollouts.append(Rollout(f"p{g}", trajectory, 1.0, -6.0, 0, 0, finished=False, action_mask=mask))
        rollouts.append(Rollout(f"p{g}", (10 + g, 11, 2), 0.0, -4.0, 0, 0))
    return Batch(prompts, rollouts, 2)


def test_environment_tokens_are_not_trained_on(tiny_model, tokenizer):
    from tests.helpers.gradients import step_gradients

    base, m_base = step_gradients(tiny_model, tokenizer, _batch(ENV), "tb")
    # another tool output, the same model tokens: nothing of the step moves (the environment's
    # tokens come after the last model token here, so they condition none of them)
    other, m_other = step_gradients(tiny_model, tokenizer, _batch([13, 4, 4]), "tb")
    terms = model_terms(tiny_model.config, 30)
    assert_reordered_close(other, base, terms=terms)
    assert_reordered_close(m_other["train/loss"], m_base["train/loss"], terms=terms)
    # the same trajectories with the tool's tokens marked as the policy's: other gradients, another loss
    unmasked, m_unmasked = step_gradients(tiny_model, tokenizer, _batch(ENV, masked=False), "tb")
    assert abs(m_unmasked["train/loss"] - m_base["train/loss"]) > 1e-3
    assert any(not torch.allclose(unmasked[n], base[n], atol=1e-6) for n in base)


def test_a_trajectory_is_not_cut_at_its_first_turns_end(tiny_model, tokenizer):
    """Each turn ends with EOS (token 2 here); a plain completion is cut there, a trajectory is not:
    with every token the policy's, a later model turn changes the step."""
    from tests.helpers.gradients import step_gradients

    def batch(second_turn):
        rollout = Rollout("p0", (3, 4, 2, *second_turn), 1.0, -6.0, 0, 0, action_mask=(1,) * (3 + len(second_turn)))
        return Batch([[1, 5, 6]], [rollout, Rollout("p0", (10, 11, 2), 0.0, -4.0, 0, 0)], 2)

    _, a = step_gradients(tiny_model, tokenizer, batch([7, 8, 2]), "tb")
    _, b = step_gradients(tiny_model, tokenizer, batch([13, 12, 2]), "tb")
    assert abs(a["train/loss"] - b["train/loss"]) > 1e-3


def test_groups_check_their_action_masks_and_the_buffer_keeps_them_across_a_checkpoint():
    with pytest.raises(ValueError, match="completion 0 has 3 tokens and an action mask of 2"):
        RolloutGroup("p", [1], [[3, 4, 5], [6]], [0.0, 1.0], [-1.0, -1.0], 0, action_masks=[[1, 0], [1]])
    buffer = ReplayBuffer(capacity=20, seed=3)
    group = RolloutGroup("p", [1], [[3, 4, 9, 9], [6]], [0.0, 1.0], [-1.0, -1.0], 0, action_masks=[[1, 1, 0, 0], [1]])
    buffer.add(group, step=0)
    buffer.add(RolloutGroup("q", [1], [[7], [8, 2]], [0.0, 1.0], [-1.0, -1.0], 0), step=0)  # one turn: no mask
    restored = ReplayBuffer()
    restored.load_state_dict(pickle.loads(pickle.dumps(buffer.state_dict())))
    masks = {r.completion: r.action_mask for r in restored.sample(2, 2).rollouts}
    assert masks == {(3, 4, 9, 9): (1, 1, 0, 0), (6,): (1,), (7,): None, (8, 2): None}
    old = buffer.state_dict()
    del old["rollouts"]["action_mask"]  # a checkpoint from before trajectories
    restored.load_state_dict(old)
    assert all(r.action_mask is None for r in restored.sample(2, 2).rollouts)
