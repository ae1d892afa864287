"""The replay buffer (:mod:`tba.buffer.replay`: storage, deduplication, the recency and reward
sampling rule), its checkpoint columns (:mod:`tba.buffer.columns`), and fresh batches without
replay (:mod:`tba.buffer.fresh`)."""

from tba.buffer.fresh import fresh_batch
from tba.buffer.replay import BufferTooSmall, ReplayBuffer

__all__ = ["BufferTooSmall", "ReplayBuffer", "fresh_batch"]
