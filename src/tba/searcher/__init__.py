"""The searcher role: turn the newest published policy into scored rollout groups.

:class:`Searcher` (:mod:`tba.searcher.base`) generates a batch at a time; :class:`StreamingSearcher`
(:mod:`tba.searcher.streaming`) keeps its engine full and sends groups as they finish. Both score
and attach reference log-probs the same way, in the base class.
"""

from tba.searcher.base import Searcher, SearcherStats
from tba.searcher.streaming import StreamingSearcher

__all__ = ["Searcher", "SearcherStats", "StreamingSearcher"]
