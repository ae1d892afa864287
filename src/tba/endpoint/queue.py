"""Requests to one generator, batched: the endpoint's handlers submit prompts, one thread runs
them through ``generator.generate`` a batch at a time."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import torch

from tba.generation.base import Completion, SamplingParams


class GenerationQueue:
    """Batches the requests that wait together. A batch starts once every open rollout
    (``waiting_for()``) has a request in, or ``linger_s`` after the last request came with none
    following; requests with the same sampling settings go in one ``generate`` call."""

    def __init__(self, waiting_for: Callable[[], int] = lambda: 0, linger_s: float = 0.02):
        self.generator = None  # set by the owner before requests come
        # the intra-op threads of the thread that owns the generator: a thread starts with the
        # process's default, and vLLM's CPU attention refuses a count other than its engine's
        self.threads: int | None = None
        self.waiting_for = waiting_for
        self.linger_s = linger_s
        self.generate_s = 0.0
        self._pending: list[tuple[list[int], SamplingParams, Future]] = []
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="tba-endpoint-generate", daemon=True)
        self._thread.start()

    def submit(self, prompt_ids: list[int], params: SamplingParams) -> Future:
        """A future of ``params.n`` completions of ``prompt_ids``."""
        future: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("the generation queue is closed")
            self._pending.append((prompt_ids, params, future))
            self._cv.notify_all()
        return future

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed:
                    for *_, f in self._pending:
                        f.cancel()
                    return
                while len(self._pending) < self.waiting_for():
                    seen = len(self._pending)
                    self._cv.wait(self.linger_s)
                    if len(self._pending) == seen:  # nothing came meanwhile: go with what waits
                        break
                batch, self._pending = self._pending, []
            self._generate(batch)

    def _generate(self, batch: list[tuple[list[int], SamplingParams, Future]]) -> None:
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)
        by_params: dict[SamplingParams, list[tuple[list[int], Future]]] = {}
        for ids, params, future in batch:
            if future.set_running_or_notify_cancel():
                by_params.setdefault(params, []).append((ids, future))
        for params, items in by_params.items():
            start = time.perf_counter()
            try:
                outs: list[list[Completion]] = self.generator.generate([ids for ids, _ in items], params)
            except Exception as e:  # the requests fail with it (the endpoint answers 500), the queue goes on
                for _, future in items:
                    future.set_exception(e)
                continue
            finally:
                self.generate_s += time.perf_counter() - start
            for (_, future), out in zip(items, outs, strict=True):
                future.set_result(out)

    def take_generate_s(self) -> float:
        out, self.generate_s = self.generate_s, 0.0
        return out

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        self._thread.join(timeout=5)
