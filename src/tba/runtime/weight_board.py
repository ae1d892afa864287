"""Published weights over Ray. A :class:`WeightBoard` actor holds a reference to the newest state
dict in Ray's object store: publishing is one ``ray.put`` and a small call, so a slow or dead
searcher cannot block it. :class:`RayWeightStore` is the ``WeightStore`` interface over a board,
usable from any process (the trainer, trainer rank 0, searchers)."""

from __future__ import annotations

import ray
import torch

from tba.weights import to_host


@ray.remote(num_cpus=0)
class WeightBoard:
    """The newest published weights: a version and an object-store reference."""

    def __init__(self) -> None:
        self.version = -1
        self.ref = None

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def set(self, version: int, boxed_ref: list) -> None:
        if version > self.version:  # a list keeps Ray from resolving the reference on the way in
            self.version, self.ref = version, boxed_ref[0]

    @ray.method(enable_task_events=False)  # called several times a second: no per-call events kept in Ray's GCS
    def get_if_newer(self, version: int):
        return (self.version, [self.ref]) if self.version > version else None


class RayWeightStore:
    """The ``WeightStore`` interface over a ``WeightBoard`` actor, usable from any process."""

    def __init__(self, board) -> None:
        self.board = board

    def publish(self, state_dict: dict[str, torch.Tensor], version: int) -> None:
        ref = ray.put(to_host(state_dict))
        ray.get(self.board.set.remote(version, [ref]))

    def latest_version(self) -> int:
        newest = ray.get(self.board.get_if_newer.remote(-1))
        return -1 if newest is None else newest[0]

    def fetch(self, newer_than: int) -> tuple[int, dict[str, torch.Tensor]] | None:
        newest = ray.get(self.board.get_if_newer.remote(newer_than))
        if newest is None:
            return None
        version, (ref,) = newest
        return version, ray.get(ref)
