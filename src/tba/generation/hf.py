"""Generation with Hugging Face ``generate``: batched, left-padded, K samples per prompt."""

from __future__ import annotations

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from tba.generation.base import Completion, SamplingParams
from tba.models.logprobs import token_logprobs, truncate_at_eos, unwrap
from tba.models.lora import load_published_state


class SampledLogprobs(StoppingCriteria):
    """Each sampled token's log-prob at temperature 1 from the logits ``generate`` computed to sample
    it: no second forward pass. A forward hook on the transformers model keeps the last position's
    logits (the model's own output: soft-capped or scaled ones included, before any sampling
    processor); ``generate`` calls a stopping criterion once per new token, after appending it, so
    the criterion reads the token and takes its log-prob from the logits just kept. It never stops
    generation. ``rows()`` is ``[N, steps]`` fp32, or None if a step came without its forward (the
    caller then takes the teacher-forced pass)."""

    def __init__(self, model: torch.nn.Module):
        self._logits: torch.Tensor | None = None
        self._rows: list[torch.Tensor] = []
        self._complete = True
        self._handle = unwrap(model).register_forward_hook(self._keep)

    def _keep(self, module, args, output) -> None:
        logits = getattr(output, "logits", None)
        self._logits = None if logits is None else logits[:, -1]

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        if self._logits is None:
            self._complete = False
        elif self._complete:
            logits = self._logits.float()
            token = input_ids[:, -1:].to(logits.device)
            self._rows.append(logits.gather(1, token).squeeze(1) - logits.logsumexp(-1))
        self._logits = None
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    def rows(self) -> torch.Tensor | None:
        self._handle.remove()
        return torch.stack(self._rows, 1).cpu() if self._complete and self._rows else None


class HFGenerator:
    def __init__(self, model: torch.nn.Module, pad_id: int, eos_ids: set[int], batch_size: int = 512):
        self.model = model
        self.pad_id = pad_id
        self.eos_ids = eos_ids
        self.batch_size = batch_size  # sequences per generate call
        self.version = -1  # the weights it was built with, until a published version loads

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[list[Completion]]:
        flat = [p for p in prompts for _ in range(params.n)]  # K copies of each prompt, consecutive
        outputs: list[Completion] = []
        for i in range(0, len(flat), self.batch_size):
            outputs.extend(self._generate_batch(flat[i : i + self.batch_size], params))
        return [outputs[i * params.n : (i + 1) * params.n] for i in range(len(prompts))]

    def _generate_batch(self, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
        device = next(self.model.parameters()).device
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        attn = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            attn[i, width - len(p) :] = 1
        was_training = self.model.training
        self.model.eval()
        sampling = {} if params.greedy else {"temperature": params.temperature, "top_p": params.top_p, "top_k": 0}
        sampled = SampledLogprobs(self.model) if params.logprobs and params.sampled_logprobs else None
        try:
            out = self.model.generate(
                input_ids=ids.to(device),
                attention_mask=attn.to(device),
                do_sample=not params.greedy,
                max_new_tokens=params.max_new_tokens,
                min_new_tokens=params.min_new_tokens or None,  # masks every EOS id until then
                eos_token_id=sorted(self.eos_ids),
                pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([sampled]) if sampled else None,
                **sampling,
            )
        finally:
            logps = sampled.rows() if sampled else None
        self.model.train(was_training)
        new = out[:, width:].tolist()  # [N, <=max_new_tokens]
        completions = []
        for row in new:
            tokens = truncate_at_eos(row, self.eos_ids)
            finished = bool(tokens) and tokens[-1] in self.eos_ids
            completions.append(Completion(tokens, finished))
        if logps is not None:  # from the sampling pass itself
            for i, c in enumerate(completions):
                c.token_logps = logps[i, : len(c.token_ids)].tolist() if c.token_ids else None
        elif params.logprobs:  # teacher-forced, with the same code the trainer uses: ratios start at 1
            nonempty = [i for i, c in enumerate(completions) if c.token_ids]
            if nonempty:
                logp, mask = token_logprobs(
                    self.model,
                    [prompts[i] for i in nonempty],
                    [completions[i].token_ids for i in nonempty],
                    self.pad_id,
                    self.eos_ids,
                )
                rows = logp.cpu()  # one copy from the device, not one per completion
                for row, i in enumerate(nonempty):
                    n = len(completions[i].token_ids)
                    completions[i].token_logps = rows[row, :n].tolist()
        return completions

    def load_weights(self, state_dict: dict, version: int) -> None:
        """Load published weights: a full state dict, or a LoRA adapter's tensors into a PEFT model."""
        load_published_state(self.model, state_dict)
        self.version = version
