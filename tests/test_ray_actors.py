"""The ray runtime's actors alone, in one local Ray instance. The weight transports
(``tba.weights.ray``) through their contract (:class:`tba.weights.Sender` and
:class:`tba.weights.Receiver`), each behind the object-store fallback as a run opens it: the byte
layout; the object store's board; the broadcast's real group over gloo between this process (the
trainer's side) and searcher-side receivers in Ray actors: what they load equals what was published
bit for bit, a receiver that dies in the middle of a broadcast does not block the trainer and is
named in the log and counted, and a restarted one joins the group again; the shared slots (host
memory here): exact delivery, a slot a reader copies is never overwritten, a dead reader's lease is
dropped, logged and counted. For every transport, live weights that the optimizer changes right
after the hand-over (also with a layout the transport cannot carry) arrive as they were handed
over, and an error in a transport's thread fails the trainer's next call, naming the transport.
The inbox's cap on what searchers produce ahead of the trainer."""

from __future__ import annotations

import os
import threading
import time
from multiprocessing import shared_memory

import pytest
import ray
import torch
from tests.conftest import start_local_ray
from tests.helpers.states import random_state

from tba.runtime.inbox import Inbox
from tba.searcher.counters import declared
from tba.types import SearcherReport
from tba.weights import BackgroundPublisher
from tba.weights.layout import Layout
from tba.weights.ray.board import ObjectStoreReceiver, ObjectStoreSender
from tba.weights.ray.boards import GroupBoard, SlotBoard, WeightBoard
from tba.weights.ray.broadcast import BroadcastReceiver, BroadcastSender
from tba.weights.ray.channel import channel_receiver, channel_sender, open_channel
from tba.weights.ray.fallback import FallbackReceiver, FallbackSender
from tba.weights.ray.ipc import SharedReceiver, SharedSender

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


def grown_state(seed: int) -> dict[str, torch.Tensor]:
    """``random_state`` with one more tensor: a layout the shared buffers and the group do not hold."""
    return {**random_state(seed), "extra.weight": torch.full((5,), float(seed))}


def test_the_layout_holds_every_dtype_exactly_and_keeps_ties():
    state = random_state(0)
    layout = Layout.of(state)
    buffer = torch.empty(layout.nbytes, dtype=torch.uint8)
    layout.fill(buffer, state)
    out = layout.views(buffer)
    assert list(out) == list(state)
    for name, t in state.items():
        assert out[name].dtype == t.dtype and torch.equal(out[name], t), name
    assert out["lm_head.weight"] is out["embed.weight"]  # stored once
    assert layout.nbytes == 50 * 24 * 4 + 24 * 24 * 2 + 64 + 64  # the 14-byte bias and the count take 64 each
    assert Layout.of(random_state(1)) == layout  # same names and shapes, same layout


@ray.remote(num_cpus=0)
class Receiver:
    """A searcher's side of the broadcast alone, in its own process, behind the object store as a
    run opens it. ``die_mid_broadcast``: the process exits after the header of the next broadcast,
    before its data."""

    def __init__(self, index: int, token: str) -> None:
        primary = BroadcastReceiver(ray.get_actor("group-board"), index, token, timeout_s=20)
        self.receiver = FallbackReceiver(primary, ObjectStoreReceiver(ray.get_actor("board")))

    def fetch(self, newer_than: int):
        got = self.receiver.fetch(newer_than)
        received = self.receiver.metrics()["weights/received"]
        return None if got is None else (got[0], {k: v.clone() for k, v in got[1].items()}, received)

    def counters(self) -> dict[str, float]:
        return self.receiver.metrics()

    def joined(self) -> int:
        primary = self.receiver.primary
        return primary.generation if primary.group is not None else 0

    def die_mid_broadcast(self) -> None:
        import tba.weights.ray.broadcast as broadcast

        real = broadcast._broadcast

        def header_then_exit(group, tensor):
            real(group, tensor)
            if tensor.dtype == torch.int64:
                os._exit(1)

        broadcast._broadcast = header_then_exit


def wait_for(condition, timeout: float = 60.0, what: str = "") -> None:
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def step_after_settle(publisher: BackgroundPublisher, live: dict[str, torch.Tensor], version: int) -> None:
    """Hand ``live`` over as live weights, then change them as an optimizer step would once
    :meth:`~BackgroundPublisher.settle` returns, and wait for the publication to land."""
    publisher.publish(live, version, aliases=True)
    publisher.settle()
    for t in {id(t): t for t in live.values()}.values():
        t.add_(1)  # the optimizer's step
    publisher.flush()


def publish_live_then_step(sender, version: int) -> BackgroundPublisher:
    """Publish ``random_state(version)`` as live weights from a publisher's thread, stepping them
    right after the hand-over; the publisher. The version did not go by the object store."""
    publisher = BackgroundPublisher(sender)
    step_after_settle(publisher, random_state(version), version)
    assert sender.object_ref(version) is None and publisher.visible_version == version
    return publisher


@pytest.fixture(scope="module")
def ray_local(_ray_for_the_session):
    start_local_ray()


def test_the_object_store_keeps_the_newest_version_exactly_and_live_weights_as_handed_over(ray_local):
    channel, boards = open_channel("object_store", "os-test", 1)
    sender, reader = channel_sender(channel, print), channel_receiver(channel, 0, "reader")
    assert isinstance(sender, ObjectStoreSender) and isinstance(reader, ObjectStoreReceiver)
    assert sender.spec() == channel  # trainer rank 0 opens the same channel
    assert reader.fetch(newer_than=-1) is None
    sender.publish(random_state(2), 2)
    board = ray.get_actor(channel.board_name)
    ray.get(board.set.remote(1, [None]))  # older than the newest: ignored
    version, got = reader.fetch(newer_than=-1)
    assert version == 2 and sender.visible_version == 2 and sender.object_ref(2) is not None
    for name, t in random_state(2).items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert got["lm_head.weight"].data_ptr() == got["embed.weight"].data_ptr()  # stored once
    assert reader.fetch(newer_than=2) is None

    # from the publisher's thread: the object store keeps no buffer (stage: None), so the optimizer
    # waits for the copy into the store; what arrives is what was handed over
    publisher = BackgroundPublisher(sender)
    step_after_settle(publisher, random_state(3), 3)
    version, got = reader.fetch(newer_than=2)
    assert version == 3 and all(torch.equal(got[k], t) for k, t in random_state(3).items())
    publisher.close()
    for actor in boards:
        ray.kill(actor)


def test_broadcast_delivers_exact_weights_and_survives_a_searcher_killed_mid_broadcast(ray_local):
    board, group_board = WeightBoard.options(name="board").remote(), GroupBoard.options(name="group-board").remote()
    said: list[str] = []
    primary = BroadcastSender(group_board, searchers=2, log=said.append, timeout_s=20)
    sender = FallbackSender(primary, ObjectStoreSender(board), said.append, "broadcast")
    receivers = [Receiver.remote(i, f"first-{i}") for i in range(2)]

    def received_by_all(version: int, seed: int, counts: list[int] | None = None, state=random_state) -> None:
        for r in receivers:  # a receiver stages a broadcast a moment after the trainer has sent it
            got = None
            end = time.monotonic() + 20
            while got is None and time.monotonic() < end:
                got = ray.get(r.fetch.remote(version - 1))
            assert got is not None and got[0] == version
            for name, t in state(seed).items():
                assert got[1][name].dtype == t.dtype and torch.equal(got[1][name], t), name
            if counts is not None:
                counts.append(got[2])

    sender.publish(random_state(0), 0)  # before the group: by the object store, which gives the layout
    assert sender.object_ref(0) is not None and said == []  # (part of a normal start: counted, not logged)
    received_by_all(0, 0)
    wait_for(lambda: primary.formed and all(ray.get([r.joined.remote() for r in receivers])), what="the group")
    assert said == ["weights: broadcast group formed (the trainer and 2 searcher(s), generation 1)"]
    for v in (1, 2):
        sender.publish(random_state(v), v)
        assert sender.object_ref(v) is None  # went by broadcast: nothing in the object store
        counts: list[int] = []
        received_by_all(v, v, counts)
        assert counts == [v, v]  # both staged it from the broadcast
    assert sender.metrics() == {
        "weights/broadcast_group": 1.0,
        "weights/broadcasts": 2.0,
        "weights/broadcast_failures": 0.0,
        "weights/by_object_store": 1.0,
        "weights/fallbacks": 0.0,
    }

    # searcher 1 dies after the next broadcast's header: the trainer is not held past its timeout,
    # says which version and which searcher, and that version reaches the survivor by the object store
    ray.get(receivers[1].die_mid_broadcast.remote())
    start = time.monotonic()
    sender.publish(random_state(3), 3)
    assert time.monotonic() - start < primary.timeout_s
    assert sender.object_ref(3) is not None and not primary.formed
    assert said[-1].startswith("weights: version 3 went by the object store, not by broadcast: failed: ")
    assert "searcher(s) 1 stopped answering" in said[-1], said[-1]
    got = ray.get(receivers[0].fetch.remote(2))
    assert got[0] == 3 and all(torch.equal(got[1][k], t) for k, t in random_state(3).items())
    assert sender.metrics()["weights/fallbacks"] == 1.0 and sender.metrics()["weights/broadcast_failures"] == 1.0
    counters = ray.get(receivers[0].counters.remote())  # the survivor's, as its searcher reports them
    assert counters["weights/received"] >= 2.0 and all(declared(k) for k in counters)  # (3: it got v3 too)

    # it restarts (a new incarnation registers under its index): the group forms again with it
    receivers[1] = Receiver.remote(1, "second-1")
    wait_for(lambda: primary.formed and primary.generation == 2, what="the second group")
    wait_for(lambda: ray.get(receivers[0].joined.remote()) == 2 and ray.get(receivers[1].joined.remote()) == 2)
    sender.publish(random_state(4), 4)
    assert sender.object_ref(4) is None
    received_by_all(4, 4)
    assert ray.get(board.get_if_newer.remote(-1))[0] == 3  # the object store's newest: the fallback's
    assert sender.metrics()["weights/broadcasts"] == 3.0 and sender.metrics()["weights/fallbacks"] == 1.0

    # from the publisher's thread, as a run publishes: live fp32 weights (no cast copies them) are
    # free once staged in the send buffer, so the optimizer step after settle() changes nothing sent
    publisher = publish_live_then_step(sender, 5)
    received_by_all(5, 5)  # the weights as they were handed over

    # a state of another layout: the group holds one, so it goes by the object store (said once),
    # and the optimizer still waits for its copy
    step_after_settle(publisher, grown_state(6), 6)
    assert sender.object_ref(6) is not None and sender.fallbacks["layout"] == 1
    assert said[-1].startswith("weights: version 6 went by the object store, not by broadcast: layout: ")
    received_by_all(6, 6, state=grown_state)

    # a bug in the group's thread fails the trainer's next call, naming the transport
    primary._form = lambda members: (_ for _ in ()).throw(ValueError("a bug"))
    primary.members = {}  # makes the thread form the group again
    wait_for(lambda: primary._error is not None, what="the group thread's failure")
    with pytest.raises(RuntimeError, match="weights by broadcast: the group's thread failed: ValueError"):
        sender.metrics()
    publisher.publish(random_state(7), 7, aliases=False)
    with pytest.raises(RuntimeError, match=r"publishing weights failed: .*weights by broadcast"):
        publisher.flush()
    sender.close()
    for r in receivers:
        ray.kill(r)
    ray.kill(board)
    ray.kill(group_board)


@ray.remote(num_cpus=0)
class SharedReader:
    """A searcher's side of ``runtime.weight_transport=ipc`` alone, in its own process, behind the
    object store as a run opens it."""

    def __init__(self, token: str, index: int) -> None:
        primary = SharedReceiver(ray.get_actor("slot-board"), token, index)
        self.receiver = FallbackReceiver(primary, ObjectStoreReceiver(ray.get_actor("shared-board")))

    def fetch(self, newer_than: int):
        got = self.receiver.fetch(newer_than)
        if got is None:
            return None
        ties = got[1]["lm_head.weight"].data_ptr() == got[1]["embed.weight"].data_ptr()
        copies = self.receiver.metrics()["weights/slot_copies"]
        return got[0], {k: v.clone() for k, v in got[1].items()}, copies, ties


def test_ipc_delivers_exact_weights_through_shared_slots_and_never_overwrites_a_leased_one(ray_local):
    board, slot_board = WeightBoard.options(name="shared-board").remote(), SlotBoard.options(name="slot-board").remote()
    said: list[str] = []
    primary = SharedSender(slot_board, said.append, lease_timeout_s=60)
    sender = FallbackSender(primary, ObjectStoreSender(board), said.append, "ipc")
    assert sender.keeps_device  # a background publisher hands it GPU tensors as they are
    readers = [SharedReader.remote(f"reader-{i}", i) for i in range(2)]

    def received_by_all(version: int, seed: int, copies: int | None, state=random_state) -> None:
        for r in readers:
            got = ray.get(r.fetch.remote(version - 1))
            assert got is not None and got[0] == version and got[3]  # tied entries: one tensor
            for name, t in state(seed).items():
                assert got[1][name].dtype == t.dtype and torch.equal(got[1][name], t), name
            if copies is not None:
                assert got[2] == copies  # copied from a shared slot, not fetched from the object store
            assert ray.get(r.fetch.remote(version)) is None  # nothing newer

    assert ray.get(readers[0].fetch.remote(-1)) is None  # nothing published yet
    for v in (0, 1):
        sender.publish(random_state(v), v)
        assert sender.object_ref(v) is None
        received_by_all(v, v, v + 1)
    assert primary.newest == 1 and sender.metrics()["weights/shared_publications"] == 2.0

    # a reader holds a lease on the newest slot (1): the next version goes to slot 0 at once; the one
    # after it needs slot 1 and waits, without touching it, until the lease is returned
    assert ray.get(slot_board.lease.remote(0, "slow")) == (1, 1)
    sender.publish(random_state(2), 2)
    assert primary.newest == 0
    done = threading.Event()
    worker = threading.Thread(target=lambda: (sender.publish(random_state(3), 3), done.set()))
    worker.start()
    assert not done.wait(0.5)  # cannot finish while the lease is held
    held = primary.layout.views(primary.slots.buffers[1])
    assert all(torch.equal(held[k], t) for k, t in random_state(1).items())  # slot 1 still holds version 1
    ray.get(slot_board.release.remote("slow"))
    worker.join(timeout=30)
    assert done.is_set() and primary.newest == 1
    received_by_all(3, 3, 3)

    # a version that went by the object store reaches the readers from there
    ObjectStoreSender(board).publish(random_state(4), 4)
    received_by_all(4, 4, 3)

    # a lease whose reader died mid-copy is dropped after the timeout, said and counted
    primary.lease_timeout_s = 0.3
    ray.get(slot_board.set.remote(5, primary.newest))  # (the newest bytes are version 3's; only the slot matters)
    assert ray.get(slot_board.lease.remote(4, "dead", 7)) == (5, 1)
    sender.publish(random_state(6), 6)  # slot 0
    sender.publish(random_state(7), 7)  # slot 1: waits out the dead lease
    assert said == ["weights: searcher 7 held slot 1 for over 0.3 s (it died while copying); its lease is dropped"]
    assert sender.metrics()["weights/expired_leases"] == 1.0
    received_by_all(7, 7, 4)

    # from the publisher's thread, as a run publishes: live weights are free once copied into a slot
    publisher = publish_live_then_step(sender, 8)
    received_by_all(8, 8, 5)
    # another layout: by the object store, and the optimizer waits for that copy
    step_after_settle(publisher, grown_state(9), 9)
    assert sender.object_ref(9) is not None and sender.metrics()["weights/fallbacks"] == 1.0
    assert said[-1].startswith("weights: version 9 went by the object store, not by ipc: layout: ")
    received_by_all(9, 9, 5, state=grown_state)
    # a sender whose first publication comes staged (the publisher's path for fp32 weights)
    first = SharedSender(SlotBoard.remote())
    staged = first.stage(random_state(10))
    first.publish(staged, 10)
    assert first.newest == 0 and first.publications == 1 and Layout.holds(first.slots.buffers[0], staged)
    first.close()
    names = [s.name for s in primary.slots.shm]
    for r in readers:
        ray.kill(r)
    publisher.close()  # closes the sender: the shared memory is gone with it
    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    ray.kill(board)
    ray.kill(slot_board)


def test_the_inbox_pauses_searchers_that_run_ahead_of_what_the_trainer_draws(ray_local):
    inbox = Inbox.remote(max_ahead=8)  # runtime.max_ahead=1 at 8 prompts a step
    report = SearcherReport(0, {}, incarnation="a")
    assert not ray.get(inbox.ahead.remote())
    assert ray.get(inbox.put.remote(["g"] * 6, report, []))
    assert not ray.get(inbox.ahead.remote())  # 6 waiting to be drawn: below 8
    ray.get(inbox.put.remote(["g"] * 4, SearcherReport(1, {}, incarnation="b"), []))
    assert ray.get(inbox.ahead.remote())  # 10
    groups, _, _ = ray.get(inbox.drain.remote(0))  # in the buffer now, but not drawn yet
    assert len(groups) == 10 and ray.get(inbox.ahead.remote())
    ray.get(inbox.drain.remote(8))  # the trainer took a step of 8
    assert not ray.get(inbox.ahead.remote())  # 2 ahead
    ray.get(inbox.put.remote(["g"] * 6, report, []))
    assert ray.get(inbox.ahead.remote())  # exactly 8 ahead: pause
    # unless the trainer waits for the searchers (the lag bound waits for data with newer weights,
    # which a paused searcher would never make)
    ray.get(inbox.drain.remote(8, True))
    assert not ray.get(inbox.ahead.remote())
    ray.get(inbox.drain.remote(8))
    assert ray.get(inbox.ahead.remote())
    ray.get(inbox.stop.remote())
    assert not ray.get(inbox.ahead.remote())  # a stopped run releases paused searchers (they then see the stop)
    assert not ray.get(Inbox.remote().ahead.remote())  # no cap: never paused
