"""Rewards from a reward model: any ``AutoModelForSequenceClassification`` with one label.

A :class:`SequenceScorer` scores prompt + completion with its own tokenizer, in batches, and
reads the model's scalar at the last real token (what ``transformers`` sequence classifiers do
with a pad token set). Inputs longer than ``max_length`` are truncated from the left, so the
completion's end, which the score depends on most, is always kept.

The scorer is a task-owned model: tasks create it in ``Task.setup``, which runs in searcher and
evaluation processes only. Completions arrive cut after their first EOS and decoded without
special tokens; completions that never ended get ``generation.unfinished_reward`` in the searcher
before any scorer sees them (-1 in the TL;DR recipe).
"""

from __future__ import annotations

import torch


class SequenceScorer:
    def __init__(
        self,
        name_or_path: str,
        device: torch.device | str = "cpu",
        tokenizer: str | None = None,
        batch_size: int = 32,
        max_length: int = 1024,
        dtype: str = "auto",
        trust_remote_code: bool = False,
    ):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        from tba.models.loading import resolve_dtype

        device = torch.device(device)
        self.name = name_or_path
        self.model = AutoModelForSequenceClassification.from_pretrained(
            name_or_path, dtype=resolve_dtype(dtype, device), trust_remote_code=trust_remote_code
        )
        labels = self.model.config.num_labels
        if labels != 1:
            raise ValueError(
                f"reward model {name_or_path!r} has {labels} labels; a reward model has one (a scalar score). "
                "For a classifier, use a task that reads a label's probability (redteam)"
            )
        self.model.to(device).eval().requires_grad_(False)
        self.tokenizer = AutoTokenizer.from_pretrained(tokenizer or name_or_path, trust_remote_code=trust_remote_code)
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:  # it finds the last real token by the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"  # keep the completion's end
        self.batch_size = batch_size
        self.max_length = max_length
        self.device = device

    @torch.no_grad()
    def score(self, texts: list[str]) -> list[float]:
        """The model's scalar for each full text (prompt + completion)."""
        out: list[float] = []
        for start in range(0, len(texts), self.batch_size):
            chunk = texts[start : start + self.batch_size]
            enc = self.tokenizer(
                chunk, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
            ).to(self.device)
            logits = self.model(**enc).logits  # [B, 1]
            out.extend(logits[:, 0].float().tolist())
        return out

    def score_pairs(self, prompts: list[str], completions: list[str]) -> list[float]:
        """Scores of prompt + completion, concatenated as text (the TL;DR reward models' format)."""
        return self.score([p + c for p, c in zip(prompts, completions, strict=True)])
