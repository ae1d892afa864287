"""The replay buffer's rollouts as plain columns for a checkpoint (numbers, strings, lists and numpy
arrays: nothing to unpickle), and back."""

from __future__ import annotations

import random
from itertools import islice

import numpy as np

from tba.types import Rollout


def rollout_columns(rows: list[Rollout]) -> dict[str, object]:
    """The fields of ``rows``, a column each (ragged ones as flat values and lengths)."""
    return {
        "completion": ragged([r.completion for r in rows], np.int64),
        "reward": np.array([r.reward for r in rows], dtype=np.float64),
        "ref_logp": np.array([r.ref_logp for r in rows], dtype=np.float64),
        "policy_version": np.array([r.policy_version for r in rows], dtype=np.int64),
        "arrival_step": np.array([r.arrival_step for r in rows], dtype=np.int64),
        "sampler_logp": np.array([r.sampler_logp or 0.0 for r in rows], dtype=np.float64),
        "has_sampler_logp": np.array([r.sampler_logp is not None for r in rows], dtype=bool),
        "finished": np.array([r.finished for r in rows], dtype=bool),
        "searcher_id": np.array([r.searcher_id for r in rows], dtype=np.int64),
        "sampler_token_logps": ragged([r.sampler_token_logps for r in rows], np.float64),
        "action_mask": ragged([r.action_mask for r in rows], np.int8),
    }


def prompts_from_columns(state: dict) -> list[tuple[str, list[int], list[Rollout]]]:
    """(prompt id, prompt tokens, its rollouts in stored order) of a buffer's state dict."""
    r = state["rollouts"]
    completions = unragged(r["completion"])
    token_logps = unragged(r["sampler_token_logps"])
    # checkpoints from before multi-turn trajectories have no action masks: every token the policy's
    actions = unragged(r["action_mask"]) if "action_mask" in r else [None] * len(completions)
    columns = zip(
        completions,
        r["reward"].tolist(),
        r["ref_logp"].tolist(),
        r["policy_version"].tolist(),
        r["arrival_step"].tolist(),
        r["sampler_logp"].tolist(),
        r["has_sampler_logp"].tolist(),
        r["finished"].tolist(),
        r["searcher_id"].tolist(),
        token_logps,
        actions,
        strict=True,
    )
    out = []
    counts = state["rollouts_per_prompt"].tolist()
    for pid, prompt_ids, n in zip(state["prompt_ids"], unragged(state["prompt_tokens"]), counts, strict=True):
        rollouts = [
            Rollout(pid, completion, reward, ref, version, arrival, logp if has_logp else None, *rest)
            for completion, reward, ref, version, arrival, logp, has_logp, *rest in islice(columns, n)
        ]
        out.append((pid, list(prompt_ids), rollouts))
    return out


def ragged(seqs: list, dtype) -> dict[str, np.ndarray]:
    """Sequences (None allowed) as one flat array and their lengths (-1 for None)."""
    lengths = np.array([-1 if s is None else len(s) for s in seqs], dtype=np.int64)
    flat = [x for s in seqs if s is not None for x in s]
    return {"values": np.array(flat, dtype=dtype), "lengths": lengths}


def unragged(ragged: dict[str, np.ndarray]) -> list[tuple | None]:
    values, out, pos = ragged["values"].tolist(), [], 0
    for n in ragged["lengths"].tolist():
        if n < 0:
            out.append(None)
            continue
        out.append(tuple(values[pos : pos + n]))
        pos += n
    return out


def rng_state(rng: random.Random) -> list:
    """``random.Random`` state as plain lists: [version, internal state, next gaussian]."""
    version, internal, gauss = rng.getstate()
    return [version, list(internal), gauss]


def rng_from_state(state) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss
