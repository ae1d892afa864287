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
- :class:`HFContinuousStream`: transformers' own continuous batching (``init_continuous_batching``:
  a generation thread over a paged KV cache, requests added and finished one by one; on CPU it
  packs every sequence of a step into one row with a block-diagonal mask). Weights load with the
  engine paused between two of its steps (``in_flight``) or after it emptied (``drain``).
- :class:`HFRefillStream`: over plain ``generate``, the waiting prompts in refill batches of
  ``refill`` prompts: short batches drain sooner than one large batch, at the cost of fewer
  sequences per forward pass. It is the HF stream's fallback: what the continuous engine cannot do
  (:func:`hf_continuous_problem`) runs here.

All three are streams (:class:`Stream`), and :func:`open_stream` builds the one the run plan names
(``plan.stream``), falling back from continuous to refill batches with a warning that says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
import time
import warnings
from abc import ABC, abstractmethod
from collections import deque
from dataclasses import dataclass
from typing import Literal

from tba.generation.base import Completion, Generator, SamplingParams
from tba.models.logprobs import truncate_at_eos

WeightUpdate = Literal["drain", "in_flight"]


@dataclass
class Finished:
    """One prompt's completions, all of them finished (or cut at the token limit)."""

    key: object  # what the caller submitted the prompt with
    completions: list[Completion]
    oldest_version: int  # the oldest policy version that produced a token of the group
    newest_version: int  # and the newest


class Stream(ABC):
    """What a streaming searcher drives: prompts in, finished groups out, weights between two advances.

    ``generator`` is the backend whose weights the stream generates with; its ``version`` (the
    trainer step of those weights, -1 before the first load) is the stream's."""

    generator: Generator

    @property
    def version(self) -> int:
        return self.generator.version

    @abstractmethod
    def in_flight(self) -> int:
        """Prompts submitted whose group has not come out yet."""

    @abstractmethod
    def submit(self, key, prompt_ids: list[int], length: int | None = None) -> None:
        """Start generating ``prompt_ids``'s K completions, to come out as one :class:`Finished` with
        ``key``; ``length``: exactly that many tokens each (every end id held back: for benchmarks
        and tests of lengths set in advance)."""

    @abstractmethod
    def advance(self) -> list[Finished]:
        """Run the engine a little; the groups that finished meanwhile."""

    @abstractmethod
    def load_weights(self, state_dict, version: int, mode: WeightUpdate) -> list[Finished]:
        """Load new weights (``drain``: after the prompts in flight finished with the old ones;
        ``in_flight``: with them still going); the groups that finished on the way."""

    @abstractmethod
    def abort(self) -> list[object]:
        """Stop every prompt in flight; the keys they were submitted with."""

    def close(self) -> None:  # noqa: B027 - most streams run nothing besides their requests
        """Stop what the stream runs besides its requests (an engine thread); after :meth:`abort`."""


def open_stream(
    kind: str,
    generator,
    params: SamplingParams,
    max_in_flight: int,
    refill: int,
    seed: int = 0,
    loader=None,
) -> Stream:
    """The stream ``kind`` names (the run plan's ``stream``: ``vllm``, ``hf_continuous`` or
    ``hf_refill``). ``hf_continuous`` falls back to refill batches of ``refill`` prompts, with a
    warning, where transformers' continuous batching cannot serve ``params`` or ``generator``.
    ``loader``: what loads weights into a vLLM engine, if not ``generator`` itself (a LoRA policy)."""
    if kind == "vllm":
        return VLLMStream(generator, params, loader=loader)
    if kind == "hf_continuous":
        why = hf_continuous_problem(generator, params)
        if why is None:
            return HFContinuousStream(generator, params, max_in_flight, seed=seed)
        warnings.warn(f"generation.hf_stream=continuous cannot serve this run ({why}); refilling instead", stacklevel=2)
    elif kind != "hf_refill":
        raise ValueError(f"no stream is called {kind!r}: vllm, hf_continuous or hf_refill")
    return HFRefillStream(generator, params, refill=refill)


class VLLMStream(Stream):
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
        return len(self._requests)

    def submit(self, key, prompt_ids: list[int], length: int | None = None) -> None:
        request_id = f"stream-{next(self._ids)}"
        prompt = self.generator.vllm.inputs.TokensPrompt(
            prompt_token_ids=list(prompt_ids), cache_salt=f"v{self.generator.version}"
        )
        sampling = self.sampling
        if length is not None:
            sampling = sampling.clone()
            sampling.max_tokens = sampling.min_tokens = length
        lora = {"lora_request": self.generator.lora_request} if self.generator.lora_request is not None else {}
        self.engine.add_request(request_id, prompt, sampling, **lora)
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
        keys = [key for key, _ in self._requests.values()]
        if self._requests:
            self.engine.abort_request(list(self._requests))
        self._requests.clear()
        return keys


def hf_continuous_problem(generator, params: SamplingParams) -> str | None:
    """Why transformers' continuous batching cannot serve this stream (None: it can)."""
    try:
        from transformers.generation import ContinuousBatchingConfig  # noqa: F401
    except ImportError:
        return "this transformers has no continuous batching (ContinuousBatchingConfig)"
    if not hasattr(generator.model, "init_continuous_batching"):
        return "the model has no init_continuous_batching"
    if hasattr(generator.model, "peft_config"):
        return "a LoRA policy (its reference is the same module, adapter off, called between engine steps)"
    if params.logprobs:
        return (
            "the objective needs the sampler's token log-probs at temperature 1, which the engine does not give "
            "(for tb: its band, objective.tb_trust_region; null is plain TB)"
        )
    if params.min_new_tokens:
        return "generation.min_new_tokens (continuous batching has no minimum length)"
    return None


class HFContinuousStream(Stream):
    """Continuous generation on transformers' continuous batching engine (a thread of its own)."""

    def __init__(self, generator, params: SamplingParams, max_in_flight: int, seed: int = 0, page_size: int = 16):
        from transformers import GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        problem = hf_continuous_problem(generator, params)
        if problem or params.greedy:
            raise ValueError(f"continuous batching cannot serve this stream: {problem or 'greedy generation'}")
        self.generator, self.params = generator, params
        self.eos = sorted(generator.eos_ids)
        config = GenerationConfig(
            do_sample=True,
            temperature=params.temperature,
            top_p=params.top_p,
            top_k=0,
            max_new_tokens=params.max_new_tokens,
            # K requests per prompt, not forks of one: a fork takes the engine-wide length and end
            # ids, not its parent's (transformers 5.24), and set lengths must hold for every sample
            num_return_sequences=1,
            eos_token_id=self.eos,
            pad_token_id=generator.pad_id,
        )
        sequences = max_in_flight * params.n
        # a KV cache for every sequence in flight at a prompt of up to 256 tokens; longer ones wait for room
        blocks = sequences * math.ceil((256 + params.max_new_tokens) / page_size) + 16
        settings = {"num_blocks": blocks, "max_batch_tokens": 512, "max_requests_per_batch": sequences, "seed": seed}
        fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
        settings["page_size" if "page_size" in fields else "block_size"] = page_size  # block_size before 5.2x
        cb = ContinuousBatchingConfig(**{k: v for k, v in settings.items() if k in fields})
        generator.model.eval()
        self.manager = generator.model.init_continuous_batching(generation_config=config, continuous_batching_config=cb)
        self.manager.start()
        self._ids = itertools.count()
        # request id -> [key, version at submission, {sample's request id: output}, set length]
        self._requests: dict[str, list] = {}

    def in_flight(self) -> int:
        return len(self._requests)

    def submit(self, key, prompt_ids: list[int], length: int | None = None) -> None:
        request_id = f"s{next(self._ids)}"
        extra = {} if length is None else {"max_new_tokens": length, "eos_token_id": -1}  # every end id held back
        for j in range(self.params.n):
            if self.manager.add_request(list(prompt_ids), request_id=f"{request_id}#{j}", **extra) is None:
                raise RuntimeError("the continuous batching engine refused a request (stopped or failed): see its log")
        self._requests[request_id] = [key, self.version, {}, length]

    def advance(self, wait_s: float = 0.05) -> list[Finished]:
        """The groups whose last completion has come out (waits up to ``wait_s`` for the first result)."""
        if not self._requests:
            return []
        finished, deadline = [], time.monotonic() + wait_s
        while True:
            result = self.manager.get_result(timeout=max(0.0, deadline - time.monotonic()))
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("the continuous batching engine stopped with requests in flight: see its log")
                return finished
            parent = result.request_id.split("#")[0]
            entry = self._requests.get(parent)
            if entry is None or not result.is_finished():
                continue
            if result.error is not None:
                raise RuntimeError(f"continuous batching failed on request {parent}: {result.error}")
            entry[2][result.request_id] = result
            if len(entry[2]) == self.params.n:
                del self._requests[parent]
                key, submitted, outputs, length = entry
                completions = [self._completion(outputs[f"{parent}#{j}"], length) for j in range(self.params.n)]
                finished.append(Finished(key, completions, submitted, self.version))
                deadline = time.monotonic()  # one more sweep without waiting, then return

    def _completion(self, result, length: int | None) -> Completion:
        if length is not None:  # ran to its set length; an end id sampled on the way is a token like any
            return Completion(list(result.generated_tokens)[:length], False)
        tokens = truncate_at_eos(list(result.generated_tokens), set(self.eos))
        return Completion(tokens, bool(tokens) and tokens[-1] in self.eos)

    def load_weights(self, state_dict, version: int, mode: WeightUpdate) -> list[Finished]:
        """``in_flight``: with the engine paused between two of its steps (sequences in flight keep the
        KV cache of the old weights and go on with the new ones); ``drain``: once every prompt in
        flight has come out (their groups are returned)."""
        done = []
        pause = getattr(self.manager, "pause", None)  # transformers before 5.2x cannot pause: drain instead
        if mode == "drain" or pause is None:
            while self._requests:
                done += self.advance(wait_s=0.5)
        with pause() if pause is not None else contextlib.nullcontext():
            self.generator.load_weights(state_dict, version)
        return done

    def abort(self) -> list[object]:
        keys = []
        for request_id, (key, *_) in self._requests.items():
            keys.append(key)
            for j in range(self.params.n):
                self.manager.cancel_request(f"{request_id}#{j}")
        self._requests.clear()
        return keys

    def close(self) -> None:
        self.abort()
        self.manager.stop(block=True, timeout=30, hard_stop=True)


class HFRefillStream(Stream):
    """A stream over Hugging Face ``generate``: the waiting prompts in batches of ``refill``."""

    def __init__(self, generator, params: SamplingParams, refill: int):
        if refill < 1:
            raise ValueError(f"refill must be at least 1 prompt, got {refill}")
        self.generator = generator
        self.params = params
        self.refill = refill
        self._waiting: deque[tuple[object, list[int], int | None]] = deque()

    def in_flight(self) -> int:
        return len(self._waiting)

    def submit(self, key, prompt_ids: list[int], length: int | None = None) -> None:
        """Queue ``prompt_ids`` for the next refill batch."""
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
