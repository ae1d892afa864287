"""Packed (padding-free) forward passes: several sequences in one row, no compute on padding.

A padded batch (:func:`tba.models.logprobs.pack`) spends a position on every pad token up to the
longest sequence; with prompts of 60-250 tokens and completions of 20-500 that is a large share
of a step. A packed batch concatenates whole sequences into rows of at most ``max_tokens``
positions (:func:`plan_rows`, first-fit decreasing), gives each sequence ``position_ids`` that
restart at 0, and passes no attention mask and no KV cache: transformers then builds a
block-diagonal causal mask from the restarts (``sdpa``, ``eager``, ``flex_attention``; flash
attention's variable-length kernels on a GPU), so no sequence sees another. With the KV cache on
(transformers' default) that detection is skipped without a word: every packed forward here passes
``use_cache=False``.

:func:`packed_token_logprobs` returns what :func:`tba.models.logprobs.token_logprobs` returns, the
same log-probs within summation-order rounding, through the same lean head path (the output head
applied to completion positions only, in chunks). :func:`packing_problem` says why a model cannot
take it (the caller then pads).
"""

from __future__ import annotations

import torch

from tba.models.logprobs import head_logprobs, output_head, truncate_at_eos, unwrap


def plan_rows(lengths: list[int], max_tokens: int) -> list[list[int]]:
    """Indices of the sequences in each row, every sequence whole, rows of at most ``max_tokens``
    positions where a sequence fits (a longer one gets a row of its own): first-fit decreasing,
    rows in the order they were opened, indices in each row ascending."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(row) for row in rows]


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot take packed rows here (None: it can)."""
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    attention = getattr(config, "_attn_implementation", None)
    if attention not in ("sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"):
        return f"attention {attention!r} builds no mask from restarting position_ids"
    if output_head(model) is None:
        return "its logits are not a plain output head's (soft-capped or scaled logits, an adapter on the head)"
    return None


def packed_token_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    eos_ids: int | set[int] | None = None,
    temperature: float = 1.0,
    max_tokens: int | None = None,
    pad_id: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[N, C]`` of the completion tokens in fp32 (0 where masked) and the
    mask ``[N, C]``, as :func:`tba.models.logprobs.token_logprobs`, from rows of packed sequences
    (``max_tokens`` positions a row; default: all in one row). ``pad_id`` fills the end of rows
    shorter than the longest: it is attended by nothing."""
    problem = packing_problem(model)
    if problem is not None:
        raise ValueError(f"this model cannot be packed: {problem}")
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
    completions = [truncate_at_eos(c, eos_ids) for c in completions]
    lengths = [len(p) + len(c) for p, c in zip(prompts, completions, strict=True)]
    rows = plan_rows(lengths, max_tokens or sum(lengths))
    width = max(sum(lengths[i] for i in row) for row in rows)
    device = next(model.parameters()).device
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    where: list[tuple[int, int]] = [(0, 0)] * len(prompts)  # sequence → (row, offset of its first token)
    for r, row in enumerate(rows):
        offset = 0
        for i in row:
            seq = prompts[i] + completions[i]
            ids[r, offset : offset + len(seq)] = torch.tensor(seq, dtype=torch.long)
            positions[r, offset : offset + len(seq)] = torch.arange(len(seq))
            where[i] = (r, offset)
            offset += len(seq)
        positions[r, offset:] = torch.arange(width - offset)  # the tail: one more "sequence", never read
    ids, positions = ids.to(device), positions.to(device)
    out = model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1, output_hidden_states=True)
    hidden = out.hidden_states[-1]  # [R, W, H]
    head = output_head(model)
    with torch.no_grad():  # the head path holds only where the model's logits are its head's output
        last = head(hidden[:, -1:]).float()
    if last.shape != out.logits[:, -1:].shape or not torch.allclose(
        last, out.logits[:, -1:].float(), rtol=1e-3, atol=1e-3
    ):
        raise ValueError("this model cannot be packed: its logits are not its output head's (scaled or capped)")
    # position t predicts token t+1: from each sequence's last prompt position to its last token,
    # C + 1 positions (the last one predicts past the end: a dummy target, dropped below)
    c_len = max(1, max(len(c) for c in completions))
    row_of = torch.zeros((len(prompts), c_len + 1), dtype=torch.long)
    col_of = torch.zeros_like(row_of)
    targets = torch.zeros_like(row_of)
    mask = torch.zeros((len(prompts), c_len), dtype=torch.float32)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        r, offset = where[i]
        start = offset + len(p) - 1
        row_of[i] = r
        col_of[i, : len(c) + 1] = torch.arange(start, start + len(c) + 1)
        col_of[i, len(c) + 1 :] = start  # padding of the gathered block: any real position, masked out
        targets[i, : len(c)] = torch.tensor(c, dtype=torch.long)
        mask[i, : len(c)] = 1.0
    picked = hidden[row_of.to(device), col_of.to(device)]  # [N, C+1, H]
    logp = head_logprobs(head, picked, targets.to(device), temperature)[:, :c_len]
    mask = mask.to(device)
    return logp * mask, mask
