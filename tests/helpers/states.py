"""Weight states to publish: every dtype a transport carries, and tied tensors."""

from __future__ import annotations

import torch


def random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(50, 24, generator=g)
    return {
        "embed.weight": emb,
        "layer.weight": torch.randn(24, 24, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(7, generator=g).to(torch.float16),  # an odd size: padded to the alignment
        "count": torch.tensor([seed], dtype=torch.int64),
        "lm_head.weight": emb,  # tied to the embedding
    }
