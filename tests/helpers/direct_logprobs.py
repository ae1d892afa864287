"""Log-probs computed the direct way, for the tests and benchmarks that check the lean ones against it."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tba.models.logprobs import pack_for


def full_logits_token_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    eos_ids: int | set[int] | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`tba.models.logprobs.token_logprobs` the direct way, as it was computed before the lean
    version: logits of every position, an fp32 copy of the completion part and a full
    ``log_softmax``. The reference that tests and ``benchmarks/bench_memory.py`` compare against."""
    ids, attn, comp_mask, p_len = pack_for(model, prompts, completions, pad_id, eos_ids)
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits  # [N, P+C, V]
    logits = logits[:, p_len - 1 : -1].float()  # [N, C, V]
    if temperature != 1.0:
        logits = logits / temperature
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, ids[:, p_len:].unsqueeze(-1)).squeeze(-1)  # [N, C]
    mask = comp_mask.to(logp.dtype)
    return logp * mask, mask
