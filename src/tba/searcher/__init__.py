"""The searcher role: turn the newest published policy into scored rollout groups.

:class:`Searcher` (:mod:`tba.searcher.base`) generates a batch at a time; :class:`StreamingSearcher`
(:mod:`tba.searcher.streaming`) keeps its engine full and sends groups as they finish. Both score
and attach reference log-probs the same way, in the base class.
"""

import importlib

# Loaded on first use (PEP 562): the inbox's process imports tba.searcher.counters, which must not
# bring torch along.
_WHERE = {"Searcher": "base", "SearcherStats": "state", "StreamingSearcher": "streaming"}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'tba.searcher' has no attribute {name!r}")
    return getattr(importlib.import_module(f"tba.searcher.{_WHERE[name]}"), name)
