"""TL;DR summarisation with a reward model (``task.name: tldr``), the paper's preference task.

Prompts are the dataset's formatted queries (``SUBREDDIT: ...\\n\\nTITLE: ...\\n\\nPOST: ...\\n\\nTL;DR:``).
The reward is a one-label reward model's score of prompt + summary (``tba.tasks.reward_model``),
loaded in searcher processes by :meth:`TLDRTask.setup`; summaries that never reach EOS get
``generation.unfinished_reward`` instead (-1 in the recipe), in the searcher.

Evaluation (:meth:`TLDRTask.evaluate`), after the paper and the code it follows:

- greedy summaries of the evaluation split (``eval.limit`` cuts it; the reference code samples at
  temperature 0.01, which is greedy in all but ties);
- ``eval/win_rate``: the fraction of prompts whose summary the judge (``task.judge``, a larger reward
  model; default the training one) scores strictly higher than the dataset's reference summary;
  ``eval/judge_score`` and ``eval/judge_score_reference``: the mean raw judge scores;
- ``eval/kl``: the full-vocabulary KL(π ‖ π_ref) at each summary position, averaged per sample,
  then over samples, on the policy's own greedy summaries; ``eval/ref_perplexity``: exp of the mean
  per-token negative log-likelihood of those summaries under π_ref (all tokens pooled).

The judge loads in the evaluating process at the first evaluation (the trainer's process today:
moving evaluation into its own actor is separate work); the reference is the runtime's.
"""

from __future__ import annotations

import math
from typing import Any

from tba.eval_metrics import win_rate
from tba.models.divergence import kl_and_ref_nll
from tba.models.loading import encode_prompts
from tba.rewards import RewardFn, make_reward_fn
from tba.tasks.base import EvalContext
from tba.tasks.data import DatasetLoadError, DataTask
from tba.tasks.reward_model import SequenceScorer
from tba.types import EvalResult


class TLDRTask(DataTask):
    name = "tldr"
    eval_metric = "win_rate"
    success_scores = False
    needs_reference = True  # the evaluation measures KL to the reference

    def __init__(self, cfg, tokenizer=None, chat_template: bool | None = None, log=print, base_dir=None):
        self._scorer: SequenceScorer | None = None
        self._judge: SequenceScorer | None = None
        self.device = "cpu"
        super().__init__(cfg, tokenizer, chat_template, log)

    def check_columns(self, columns: dict[str, list], where: str) -> None:
        for col, key in ((self.cfg.prompt_column, "prompt_column"), (self.cfg.reference_column, "reference_column")):
            if col not in columns:
                raise DatasetLoadError(
                    f"{where} has no column {col!r} (task.{key}); its columns are: {', '.join(columns)}"
                )

    def prompt_value(self, columns: dict[str, list], i: int) -> Any:
        return columns[self.cfg.prompt_column][i]

    def answer_of(self, row: dict[str, Any]) -> str | None:
        reference, prompt = str(row[self.cfg.reference_column]), str(row[self.cfg.prompt_column])
        return reference[len(prompt) :] if reference.startswith(prompt) else reference

    # ------------------------------------------------------------ rewards

    def setup(self, device=None) -> None:
        if self._scorer is None:
            self.device = device or "cpu"
            c = self.cfg
            self._scorer = SequenceScorer(
                c.reward_model, self.device, c.reward_model_tokenizer, c.reward_batch_size, c.reward_max_length
            )

    def reward_functions(self) -> list[RewardFn]:
        return [make_reward_fn("reward_model", self._reward)]

    def _reward(self, prompts, completions, completion_ids, **_) -> list[float]:
        if self._scorer is None:
            raise RuntimeError("the reward model is not loaded: Task.setup() runs in searcher processes first")
        return self._scorer.score_pairs(prompts, completions)

    def checkable_reward_functions(self) -> list[RewardFn]:
        return []  # the reward is a model: nothing to dry-run before it loads

    # ------------------------------------------------------------ evaluation

    def judge(self) -> SequenceScorer:
        if self._judge is None:
            c = self.cfg
            if c.judge is None:
                self.setup(self.device)
                self._judge = self._scorer
            else:
                self._judge = SequenceScorer(
                    c.judge, self.device, c.judge_tokenizer, c.reward_batch_size, c.reward_max_length
                )
        return self._judge

    def evaluate(self, ctx: EvalContext) -> EvalResult:
        from tba.generation.base import SamplingParams

        prompts = self.eval_prompts()[: ctx.settings.limit]
        ids = encode_prompts(ctx.tokenizer, prompts, ctx.chat_template)
        greedy = SamplingParams(n=1, greedy=True, max_new_tokens=ctx.settings.max_new_tokens)
        outs = [o[0] for o in ctx.generator.generate(ids, greedy)]
        texts = ctx.tokenizer.batch_decode(
            [[t for t in o.token_ids if t not in ctx.eos_ids] for o in outs], skip_special_tokens=True
        )
        judge = self.judge()
        mine = judge.score_pairs([p.text for p in prompts], texts)
        refs = judge.score_pairs([p.text for p in prompts], [p.answer or "" for p in prompts])
        metrics = {
            "eval/win_rate": win_rate(mine, refs),
            "eval/judge_score": sum(mine) / len(mine),
            "eval/judge_score_reference": sum(refs) / len(refs),
            "eval/completion_len": sum(len(o.token_ids) for o in outs) / len(outs),
            "eval/finished": sum(o.finished for o in outs) / len(outs),
            "eval/problems": float(len(prompts)),
        }
        if ctx.reference is not None:
            nonempty = [i for i, o in enumerate(outs) if o.token_ids]
            if nonempty:
                kl, nll, n_tok = kl_and_ref_nll(
                    ctx.generator.model,
                    ctx.reference,
                    [ids[i] for i in nonempty],
                    [outs[i].token_ids for i in nonempty],
                    ctx.tokenizer.pad_token_id,
                    ctx.eos_ids,
                    packed=ctx.settings.packing,
                )
                metrics["eval/kl"] = kl.mean().item()
                metrics["eval/ref_perplexity"] = math.exp(nll.sum().item() / max(n_tok.sum().item(), 1))
        samples = [
            {"id": p.id, "prompt": p.text, "completion": t, "score": s, "answer": p.answer, "answer_score": r}
            for p, t, s, r in list(zip(prompts, texts, mine, refs, strict=True))[: ctx.settings.log_samples]
        ]
        return EvalResult(metrics, samples)
