"""Weights by Ray's object store (``runtime.weight_transport=object_store``, and every other
transport's fallback). A :class:`~tba.weights.ray.boards.WeightBoard` actor holds the newest version
and a reference to its state dict in the object store: publishing is one ``ray.put`` and a small
call, so a slow or dead searcher cannot block it. :class:`ObjectStoreSender` and
:class:`ObjectStoreReceiver` are the transport's two sides, usable from any process (the trainer,
trainer rank 0, searchers).

The state dict travels as numpy arrays (:func:`pack`; bfloat16 and float16 viewed as 16-bit
integers, which numpy lacks): Ray writes their bytes into the object store with one copy instead of
pickling them, and a process on the same node reads them in place, without a copy
(:func:`unpack` wraps them as read-only tensors, which loading copies from)."""

from __future__ import annotations

import warnings

import numpy as np
import ray
import torch

from tba.weights.base import Receiver, Sender, State, map_shared, to_host

_AS_INT = {torch.bfloat16: torch.int16, torch.float16: torch.int16}
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in (torch.bfloat16, torch.float16)}


def pack(state_dict: dict[str, torch.Tensor]) -> dict:
    """A host state dict as numpy arrays that Ray stores without pickling their data; tied entries
    stay one array (:func:`tba.weights.map_shared`), stored once."""

    def as_array(t: torch.Tensor) -> np.ndarray:
        t = t.detach().contiguous()
        return (t.view(_AS_INT[t.dtype]) if t.dtype in _AS_INT else t).numpy()

    dtypes = {k: str(v.dtype).removeprefix("torch.") for k, v in state_dict.items() if v.dtype in _AS_INT}
    return {"arrays": map_shared(to_host(state_dict), as_array), "views": dtypes}


def unpack(packed: dict) -> dict[str, torch.Tensor]:
    """The tensors of :func:`pack`'s arrays, sharing their memory (read-only when Ray maps them from
    the object store: load from them, do not write to them)."""
    out, done = {}, {}
    with warnings.catch_warnings():  # "The given NumPy array is not writable": nothing writes to them
        warnings.simplefilter("ignore", UserWarning)
        for k, a in packed["arrays"].items():
            if id(a) not in done:
                t = torch.from_numpy(a)
                view = packed["views"].get(k)
                done[id(a)] = t.view(_DTYPE_NAMES[view]) if view else t
            out[k] = done[id(a)]
    return out


class ObjectStoreSender(Sender):
    """Puts each publication in the object store and its reference on the board."""

    def __init__(self, board, channel=None) -> None:
        """``channel``: the run's :class:`~tba.weights.ray.channel.Channel`, for trainer rank 0."""
        super().__init__()
        self.board, self.channel = board, channel
        self.last: tuple[int, ray.ObjectRef] | None = None  # the newest publication from this process

    def send(self, state_dict: State, version: int) -> None:
        ref = ray.put(pack(state_dict))
        ray.get(self.board.set.remote(version, [ref]))
        self.last = (version, ref)

    def spec(self):
        return self.channel

    def object_ref(self, version: int) -> ray.ObjectRef | None:
        return self.last[1] if self.last is not None and self.last[0] == version else None


class ObjectStoreReceiver(Receiver):
    """Reads the newest publication in place from the object store (on the sender's node: mapped,
    not copied)."""

    def __init__(self, board) -> None:
        self.board = board

    def fetch(self, newer_than: int) -> tuple[int, State] | None:
        newest = ray.get(self.board.get_if_newer.remote(newer_than))
        if newest is None:
            return None
        version, (ref,) = newest
        return version, unpack(ray.get(ref))
