"""Weight publishing: the trainer publishes a state dict with its version; searchers fetch the
newest one between two generation batches. For a LoRA policy the state dict holds the adapter's
tensors only (``tba.models.lora.published_state``); every transport treats both kinds alike.

- :mod:`tba.weights.base`: the contract, a :class:`Sender` and a :class:`Receiver`;
- :mod:`tba.weights.transports`: the registry from ``runtime.weight_transport`` to a pair;
- :mod:`tba.weights.local`: one process (the ``sync`` runtime, and tests);
- :mod:`tba.weights.publisher`: a thread in front of any sender, off the trainer's path;
- :mod:`tba.weights.layout`: a state dict as one byte buffer;
- :mod:`tba.weights.ray`: between processes over Ray (the object store, broadcast, shared slots).
"""

import importlib

# Loaded on first use (PEP 562): the config's checks import tba.weights.transports, which must not
# bring torch along.
_WHERE = {
    "BackgroundPublisher": "publisher",
    "CannotCarry": "base",
    "DelayedWeights": "local",
    "LocalWeightStore": "local",
    "NoSender": "base",
    "Receiver": "base",
    "Sender": "base",
    "map_shared": "base",
    "own_copy": "base",
    "publications_to_keep": "local",
    "shares_memory": "base",
    "to_host": "base",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'tba.weights' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tba.weights.{_WHERE[name]}"), name)
