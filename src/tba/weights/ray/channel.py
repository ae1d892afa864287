"""A run's weight channel: the actors its transport needs (the weight board, and the transport's own
board where it has one), named after the run so that any process of it finds them, and the two
sides opened from it: the trainer's (or trainer rank 0's) sender and each searcher's receiver."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import ray

from tba.weights.base import Receiver, Sender
from tba.weights.ray.board import ObjectStoreReceiver, ObjectStoreSender
from tba.weights.ray.boards import WeightBoard
from tba.weights.ray.fallback import FallbackReceiver, FallbackSender
from tba.weights.transports import Transport, transport


@dataclass(frozen=True)
class Channel:
    """Where a run's weights go: its transport's name, the run's id and its searchers (picklable)."""

    transport: str
    run_id: str
    searchers: int

    @property
    def board_name(self) -> str:
        return f"tba-weights-{self.run_id}"

    @property
    def side_board_name(self) -> str:
        return f"tba-weights-{self.transport}-{self.run_id}"

    @property
    def kind(self) -> Transport:
        return transport(self.transport)

    def side_board(self):
        """The transport's own board, found by name (None: it has none)."""
        return ray.get_actor(self.side_board_name) if self.kind.board else None


def open_channel(name: str, run_id: str, searchers: int) -> tuple[Channel, list]:
    """Start the channel's actors (in the driver, before the searchers): the channel, and the actors'
    handles, which the caller keeps for the run's length (Ray stops an actor whose handles are gone)."""
    channel = Channel(name, run_id, searchers)
    kind = channel.kind
    if not kind.to_processes:
        raise ValueError(f"weight transport {name!r} serves one process; a Ray run needs one between processes")
    actors = [WeightBoard.options(name=channel.board_name).remote()]
    if kind.board is not None:
        actors.append(kind.load("board").options(name=channel.side_board_name).remote())
    return channel, actors


class RankSender(Sender):
    """The driver's side when trainer ranks publish: rank 0 opens the channel's sender in its own
    process (:meth:`spec`), so this one sends nothing itself."""

    def __init__(self, channel: Channel) -> None:
        super().__init__()
        self.channel = channel
        self._metrics: dict[str, float] = {}

    def spec(self) -> Channel:
        return self.channel

    def published_elsewhere(self, version: int, metrics: dict[str, float]) -> None:
        super().published_elsewhere(version, metrics)
        self._metrics = dict(metrics)

    def metrics(self) -> dict[str, float]:
        """Rank 0's sender's counters, as of its latest publication."""
        return self._metrics

    def send(self, state_dict, version: int) -> None:
        raise RuntimeError("with trainer ranks, rank 0 publishes through the channel (RankGroup.publish)")


def channel_sender(channel: Channel, log: Callable[[str], None]) -> Sender:
    """The trainer's side of ``channel``: the object store alone, or a primary with it behind."""
    object_store = ObjectStoreSender(ray.get_actor(channel.board_name), channel)
    kind = channel.kind
    if not kind.primary:
        return object_store
    primary = kind.load("sender").open(channel.side_board(), channel.searchers, log)
    return FallbackSender(primary, object_store, log, kind.name, channel)


def channel_receiver(channel: Channel, index: int, token: str) -> Receiver:
    """A searcher's side of ``channel`` (``token``: its incarnation)."""
    object_store = ObjectStoreReceiver(ray.get_actor(channel.board_name))
    kind = channel.kind
    if not kind.primary:
        return object_store
    return FallbackReceiver(kind.load("receiver").open(channel.side_board(), index, token), object_store)
