"""Continuous generation: prompts enter the engine as others leave, and each prompt's K completions
leave it as one group the moment the last of them finishes.

A batch generator (``Generator.generate``) returns when the batch's longest completion is done:
every slot whose completion finished earlier idles until then, and new weights wait for the whole
batch. A stream keeps the engine busy instead. The caller :meth:`~Stream.submit`\\ s prompts (up to
how many it wants in flight), calls :meth:`~Stream.advance` to run the engine a little and get
the groups that finished, submits new prompts in their place, and loads new weights between two
advances, either after the prompts in flight have finished (``drain``) or with them still in
flight (``in_flight``: they go on with the new weights, PipelineRL's way).

Each finished group carries the oldest and the newest policy version that produced any of its
tokens (:class:`Finished`), so lag can be counted from the oldest.

- :class:`VLLMStream` drives a vLLM engine request by request (``LLMEngine.add_request`` and
  ``step``; one request of ``n=K`` samples per prompt, returned once all K are done). Token by
  token versions come from the engine's own record (``set_weight_version`` labels the tokens each
  weight version produced). New prompts are salted with the weight version in vLLM's prefix cache,
  so a prefix cached under old weights is never reused under new ones (the cache cannot be reset
  while requests run).
- :class:`HFStream`: Hugging Face ``generate`` has no request-level engine, so a stream over it
  generates the waiting prompts in refill batches of ``refill`` prompts: short batches drain
  sooner than one large batch, at the cost of fewer sequences per forward pass.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque
from dataclasses import dataclass
from typing import Literal

from tba.generation.base import Completion, SamplingParams

WeightUpdate = Literal["drain", "in_flight"]


@dataclass
class Finished:
    """One prompt's completions, all of them finished (or cut at the token limit)."""

    key: object  # what the caller submitted the prompt with
    completions: list[Completion]
    oldest_version: int  # the oldest policy version that produced a token of the group
    newest_version: int  # and the newest


class VLLMStream:
    """Continuous generation on a :class:`~tba.generation.vllm_backend.VLLMGenerator`'s engine."""

    def __init__(self, generator, params: SamplingParams, loader=None):
        """``loader``: what loads published weights into the engine, if not ``generator`` itself (a
        LoRA policy's :class:`~tba.generation.vllm_backend.MergedLoraGenerator`)."""
        if params.greedy:
            raise ValueError("a stream samples: greedy generation goes through Generator.generate")
        self.generator = generator
        self.loader = loader if loader is not None else generator
        self.engine = generator.llm.llm_engine
        self.params = params
        self.sampling = generator.sampling_params(params, final_only=True)
        self._ids = itertools.count()
        self._requests: dict[str, tuple[object, int]] = {}  # request id -> (key, version at submission)
        self.engine.set_weight_version(str(generator.version))

    def in_flight(self) -> int:
        """Prompts submitted whose group has not come out yet."""
        return len(self._requests)

    def submit(self, key, prompt_ids: list[int], length: int | None = None) -> None:
        """Start generating ``prompt_ids``'s K completions; ``length``: exactly that many tokens each
        (every end id held back: for benchmarks and tests of lengths set in advance)."""
        request_id = f"stream-{next(self._ids)}"
        prompt = self.generator.vllm.inputs.TokensPrompt(
            prompt_token_ids=list(prompt_ids), cache_salt=f"v{self.generator.version}"
        )
        sampling = self.sampling
        if length is not None:
            sampling = sampling.clone()
            sampling.max_tokens = sampling.min_tokens = length
        self.engine.add_request(request_id, prompt, sampling)
        self._requests[request_id] = (key, self.generator.version)

    def advance(self) -> list[Finished]:
        """One engine step; the groups that finished in it."""
        if not self._requests:
            return []
        finished = []
        for output in self.engine.step():
            if not output.finished or output.request_id not in self._requests:
                continue
            key, submitted = self._requests.pop(output.request_id)
            completions = [self.generator.completion(c, self.params.logprobs) for c in output.outputs]
            spans = [int(s.version) for c in output.outputs for s in (c.weight_versions or ()) if s.version]
            oldest, newest = (min(spans), max(spans)) if spans else (submitted, self.generator.version)
            finished.append(Finished(key, completions, min(oldest, submitted), newest))
        return finished

    def load_weights(self, state_dict, version: int, mode: WeightUpdate) -> list[Finished]:
        """Load new weights; ``drain`` first runs the prompts in flight to their end (their groups are
        returned), ``in_flight`` loads them between two engine steps, and the requests in flight go on
        with the new weights from their next token."""
        done = []
        if mode == "drain":
            while self._requests:
                done += self.advance()
        self.loader.load_weights(state_dict, version)
        self.engine.set_weight_version(str(version))
        return done

    def abort(self) -> list[object]:
        """Stop every request in flight; the keys they were submitted with."""
        keys = [key for key, _ in self._requests.values()]
        if self._requests:
            self.engine.abort_request(list(self._requests))
        self._requests.clear()
        return keys


class HFStream:
    """A stream over Hugging Face ``generate``: the waiting prompts in batches of ``refill``."""

    def __init__(self, generator, params: SamplingParams, refill: int):
        if refill < 1:
            raise ValueError(f"refill must be at least 1 prompt, got {refill}")
        self.generator = generator
        self.params = params
        self.refill = refill
        self._waiting: deque[tuple[object, list[int], int | None]] = deque()

    @property
    def version(self) -> int:
        return getattr(self.generator, "version", -1)

    def in_flight(self) -> int:
        return len(self._waiting)

    def submit(self, key, prompt_ids: list[int], length: int | None = None) -> None:
        """Queue ``prompt_ids``; ``length``: exactly that many tokens per completion (as
        :meth:`VLLMStream.submit`)."""
        self._waiting.append((key, list(prompt_ids), length))

    def advance(self) -> list[Finished]:
        """Generate the next ``refill`` waiting prompts; their groups."""
        batch = [self._waiting.popleft() for _ in range(min(self.refill, len(self._waiting)))]
        if not batch:
            return []
        params = self.params
        lengths = [length for _, _, length in batch]
        if any(n is not None for n in lengths):  # one generate call: every EOS held to the longest, then cut
            longest = max(n if n is not None else params.max_new_tokens for n in lengths)
            params = dataclasses.replace(params, max_new_tokens=longest, min_new_tokens=longest)
        outputs = self.generator.generate([ids for _, ids, _ in batch], params)
        v = self.version
        return [
            Finished(key, outs if n is None else [_cut(c, n) for c in outs], v, v)
            for (key, _, n), outs in zip(batch, outputs, strict=True)
        ]

    def load_weights(self, state_dict, version: int, mode: WeightUpdate) -> list[Finished]:
        """Nothing is ever half generated here: both modes load at once (waiting prompts are
        generated with the new weights)."""
        self.generator.load_weights(state_dict, version)
        return []

    def abort(self) -> list[object]:
        keys = [key for key, _, _ in self._waiting]
        self._waiting.clear()
        return keys


def _cut(completion: Completion, length: int) -> Completion:
    """The first ``length`` tokens, unfinished (it ran to its set length, not to an end token)."""
    logps = completion.token_logps[:length] if completion.token_logps is not None else None
    return Completion(completion.token_ids[:length], False, logps)
