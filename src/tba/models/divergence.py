"""How far the policy has moved from the reference on given completions: the full-vocabulary KL
and the reference's likelihood (TL;DR's evaluation), from padded or packed forward passes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tba.models.logprobs import completion_logits, pack, truncate_at_eos
from tba.models.packing import packed_completion_logits, row_tokens, worth_packing
from tba.models.packing_choice import can_pack


@torch.no_grad()
def kl_and_ref_nll(
    policy: torch.nn.Module,
    reference: torch.nn.Module,
    prompts: list[list[int]],
    completions: list[list[int]],
    pad_id: int,
    eos_ids: int | set[int] | None = None,
    micro_batch: int = 16,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sample: the mean over completion positions of the full-vocabulary KL(π ‖ π_ref), the
    summed negative log-likelihood of the completion under π_ref, and its length in tokens.

    KL_t = Σ_v π(v | x, y_<t) (log π(v | ·) − log π_ref(v | ·)), on the completion that π produced;
    averaged over its positions, so every sample counts once whatever its length. ``packed``: each
    model whose sequences can be packed (:func:`tba.models.packing_choice.can_pack`) runs packed passes
    where they save positions (:func:`tba.models.packing.worth_packing`), the other pads; the
    numbers are the same within rounding.
    """
    completions = [truncate_at_eos(c, eos_ids) for c in completions]
    models = (policy, reference)
    packs = [packed and can_pack(m) for m in models]
    device = next(policy.parameters()).device
    kls, nlls, lens = [], [], []
    for i in range(0, len(prompts), micro_batch):
        ps, cs = prompts[i : i + micro_batch], completions[i : i + micro_batch]
        c_len = max(1, max(len(c) for c in cs))
        targets = torch.zeros((len(cs), c_len), dtype=torch.long)
        mask = torch.zeros((len(cs), c_len))
        for j, c in enumerate(cs):
            targets[j, : len(c)] = torch.tensor(c, dtype=torch.long)
            mask[j, : len(c)] = 1.0
        targets, mask = targets.to(device), mask.to(device)
        logp = []
        for m, packs_m in zip(models, packs, strict=True):
            if packs_m and worth_packing([len(p) for p in ps], [len(c) for c in cs], row_tokens(m)):
                logits, _ = packed_completion_logits(m, ps, cs, None, row_tokens(m), pad_id)  # [n, C, V]
            else:
                m_device = next(m.parameters()).device
                ids, attn, _, p_len = pack(ps, cs, pad_id, m_device)
                logits = completion_logits(m, ids, attn, p_len)[:, :-1]  # [n, C, V]
            logp.append(F.log_softmax(logits.float().to(device), dim=-1))
        kl_t = (logp[0].exp() * (logp[0] - logp[1])).sum(-1)  # [n, C]
        nll_t = -torch.gather(logp[1], -1, targets.unsqueeze(-1)).squeeze(-1)  # [n, C]
        n_tok = mask.sum(-1)
        kls.append((kl_t * mask).sum(-1) / n_tok.clamp(min=1))
        nlls.append((nll_t * mask).sum(-1))
        lens.append(n_tok)
    return torch.cat(kls).cpu(), torch.cat(nlls).cpu(), torch.cat(lens).cpu()
