"""Teacher-forced sequence log-probs of completions.

log π(y|x) = Σ_t log π(y_t | x, y_<t) over completion tokens, EOS counted once, no length
normalisation. Completions are cut after their first EOS *before* padding, and the mask comes
from those lengths, never from comparing ids with the pad token: that is what keeps the EOS
log-prob when pad and EOS are the same token (a pitfall of the paper's reference code).

Layout of one forward batch (prompts left-padded, completions right-padded):

    [pad pad x x x | y y y EOS pad pad]
     <---- P ----->  <------ C ------>
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def truncate_at_eos(tokens: list[int], eos_ids: int | set[int] | None) -> list[int]:
    """``tokens`` up to and including the first EOS."""
    if eos_ids is None:
        return list(tokens)
    eos = {eos_ids} if isinstance(eos_ids, int) else eos_ids
    for i, t in enumerate(tokens):
        if t in eos:
            return list(tokens[: i + 1])
    return list(tokens)


def pack(
    prompts: list[list[int]], completions: list[list[int]], pad_id: int, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Left-pad prompts, right-pad completions, concatenate.

    Returns ``input_ids [N, P+C]``, ``attention_mask [N, P+C]``, ``completion_mask [N, C]`` and P.
    """
    if len(prompts) != len(completions):
        raise ValueError(f"{len(prompts)} prompts for {len(completions)} completions")
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt: every prompt needs at least one token (e.g. BOS)")
    n = len(prompts)
    p_len = max(len(p) for p in prompts)
    c_len = max(1, max(len(c) for c in completions))
    ids = torch.full((n, p_len + c_len), pad_id, dtype=torch.long)
    attn = torch.zeros((n, p_len + c_len), dtype=torch.long)
    for i, (p, c) in enumerate(zip(prompts, completions, strict=True)):
        ids[i, p_len - len(p) : p_len] = torch.tensor(p, dtype=torch.long)
        ids[i, p_len : p_len + len(c)] = torch.tensor(c, dtype=torch.long)
        attn[i, p_len - len(p) : p_len + len(c)] = 1
    comp_mask = attn[:, p_len:].clone()
    return ids.to(device), attn.to(device), comp_mask.to(device), p_len


def token_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    eos_ids: int | set[int] | None = None,
    temperature: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs ``[N, C]`` of completion tokens (0 where masked) and the mask ``[N, C]``."""
    completions = [truncate_at_eos(c, eos_ids) for c in completions]
    device = next(model.parameters()).device
    ids, attn, comp_mask, p_len = pack(prompts, completions, pad_id, device)
    # Positions count real tokens only, so a left-padded prompt sees the same positions as an
    # unpadded one.
    position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
    logits = model(input_ids=ids, attention_mask=attn, position_ids=position_ids).logits  # [N, P+C, V]
    logits = logits[:, p_len - 1 : -1].float()  # [N, C, V]: position t predicts token t+1
    if temperature != 1.0:
        logits = logits / temperature
    targets = ids[:, p_len:]  # [N, C]
    logp = torch.gather(F.log_softmax(logits, dim=-1), -1, targets.unsqueeze(-1)).squeeze(-1)  # [N, C]
    mask = comp_mask.to(logp.dtype)
    return logp * mask, mask


def sequence_logprobs(
    model: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    eos_ids: int | set[int] | None = None,
    temperature: float = 1.0,
    micro_batch: int | None = None,
) -> torch.Tensor:
    """Sum of completion-token log-probs per sequence, ``[N]``; differentiable unless under no_grad.

    ``micro_batch`` splits the forward passes (the results are concatenated).
    """
    if micro_batch is None or micro_batch >= len(prompts):
        logp, _ = token_logprobs(model, prompts, completions, pad_id, eos_ids, temperature)
        return logp.sum(-1)
    parts = [
        token_logprobs(
            model, prompts[i : i + micro_batch], completions[i : i + micro_batch], pad_id, eos_ids, temperature
        )[0].sum(-1)
        for i in range(0, len(prompts), micro_batch)
    ]
    return torch.cat(parts)


@torch.no_grad()
def kl_and_ref_nll(
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    eos_ids: int | set[int] | None = None,
    micro_batch: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: the mean over completion positions of the full-vocabulary KL(π ‖ π_ref), the
    summed negative log-likelihood of the completion under π_ref, and its length in tokens.

    KL_t = Σ_v π(v | x, y_<t) (log π(v | ·) − log π_ref(v | ·)), on the completion that π produced;
    averaged over its positions, so every sample counts once whatever its length.
    """
    completions = [truncate_at_eos(c, eos_ids) for c in completions]
    kls, nlls, lens = [], [], []
    for i in range(0, len(prompts), micro_batch):
        ps, cs = prompts[i : i + micro_batch], completions[i : i + micro_batch]
        device = next(policy.parameters()).device
        ids, attn, comp_mask, p_len = pack(ps, cs, pad_id, device)
        position_ids = (attn.cumsum(-1) - 1).clamp(min=0)
        logp = [
            F.log_softmax(
                m(
                    input_ids=ids.to(next(m.parameters()).device),
                    attention_mask=attn.to(next(m.parameters()).device),
                    position_ids=position_ids.to(next(m.parameters()).device),
                )
                .logits[:, p_len - 1 : -1]
                .float()
                .to(device),
                dim=-1,
            )
            for m in (policy, reference)
        ]  # 2 x [n, C, V]
        mask = comp_mask.float()  # [n, C]
        kl_t = (logp[0].exp() * (logp[0] - logp[1])).sum(-1)  # [n, C]
        nll_t = -torch.gather(logp[1], -1, ids[:, p_len:].unsqueeze(-1)).squeeze(-1)  # [n, C]
        n_tok = mask.sum(-1)
        kls.append((kl_t * mask).sum(-1) / n_tok.clamp(min=1))
        nlls.append((nll_t * mask).sum(-1))
        lens.append(n_tok)
    return torch.cat(kls).cpu(), torch.cat(nlls).cpu(), torch.cat(lens).cpu()
