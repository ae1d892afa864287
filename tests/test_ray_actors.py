"""The ray runtime's actors alone, in one local Ray instance. Weights by broadcast
(``tba.runtime.broadcast``) and the board it shares with the object store: the byte layout, the
board's versions, and the real group over gloo between this process (the trainer's side) and
searcher-side receivers in Ray actors: what they load equals what was published bit for bit, a
receiver that dies in the middle of a broadcast does not block the trainer, and a restarted one
joins the group again. Weights through shared slots (``tba.runtime.shared_weights``, host memory
here): exact delivery, and a slot a reader copies is never overwritten. The inbox's cap on what
searchers produce ahead of the trainer."""

from __future__ import annotations

import os
import threading
import time
from multiprocessing import shared_memory

import pytest
import ray
import torch

from tba.runtime.actors import Inbox
from tba.runtime.broadcast import BroadcastReceiver, BroadcastSender, Layout
from tba.runtime.shared_weights import SharedReceiver, SharedSender
from tba.runtime.weight_board import RayWeightStore, WeightBoard
from tba.weights import BackgroundPublisher

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


def random_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    emb = torch.randn(50, 24, generator=g)
    return {
        "embed.weight": emb,
        "layer.weight": torch.randn(24, 24, generator=g).to(torch.bfloat16),
        "layer.bias": torch.randn(7, generator=g).to(torch.float16),  # an odd size: padded to the alignment
        "count": torch.tensor([seed], dtype=torch.int64),
        "lm_head.weight": emb,  # tied to the embedding
    }


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
    """A searcher's side alone: a :class:`BroadcastReceiver` in its own process. ``die_mid_broadcast``:
    the process exits after the header of the next broadcast, before its data."""

    def __init__(self, index: int, token: str) -> None:
        self.receiver = BroadcastReceiver(ray.get_actor("board"), index, token, timeout_s=20)

    def fetch(self, newer_than: int):
        got = self.receiver.fetch(newer_than)
        return None if got is None else (got[0], {k: v.clone() for k, v in got[1].items()}, self.receiver.received)

    def joined(self) -> int:
        return self.receiver.generation if self.receiver.group is not None else 0

    def die_mid_broadcast(self) -> None:
        import tba.runtime.broadcast as broadcast

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


def publish_live_then_step(sender, version: int) -> BackgroundPublisher:
    """Publish ``random_state(version)`` as live weights from a publisher's thread, then change them
    as an optimizer step would once :meth:`~BackgroundPublisher.settle` returns; the publisher."""
    publisher = BackgroundPublisher(sender)
    live = random_state(version)
    publisher.publish(live, version, aliases=True)
    publisher.settle()
    for t in {id(t): t for t in live.values()}.values():
        t.add_(1)  # the optimizer's step
    publisher.flush()
    assert sender.last == (version, None)
    return publisher


@pytest.fixture(scope="module")
def ray_local():
    ray.init(
        address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False
    )
    yield
    ray.shutdown()


def test_the_board_and_object_store_keep_the_newest_version_exactly(ray_local):
    board = WeightBoard.remote()
    store, reader = RayWeightStore(board), RayWeightStore(board)  # a publisher's and a searcher's
    assert reader.fetch(newer_than=-1) is None and reader.latest_version() == -1
    store.publish(random_state(2), 2)
    ray.get(board.set.remote(1, [None]))  # older than the newest: ignored
    version, got = reader.fetch(newer_than=-1)
    assert version == 2 and reader.latest_version() == 2 and store.last[0] == 2
    for name, t in random_state(2).items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    assert got["lm_head.weight"].data_ptr() == got["embed.weight"].data_ptr()  # stored once
    assert reader.fetch(newer_than=2) is None
    ray.get(board.set.remote(3, [None]))  # a version that went by broadcast: not in the object store
    assert reader.latest_version() == 3 and reader.fetch(newer_than=2) is None
    ray.kill(board)


def test_broadcast_delivers_exact_weights_and_survives_a_searcher_killed_mid_broadcast(ray_local):
    board = WeightBoard.options(name="board").remote()
    said: list[str] = []
    sender = BroadcastSender(board, searchers=2, log=said.append, timeout_s=20)
    receivers = [Receiver.remote(i, f"first-{i}") for i in range(2)]

    def received_by_all(version: int, seed: int, counts: list[int] | None = None) -> None:
        for r in receivers:  # a receiver stages a broadcast a moment after the trainer has sent it
            got = None
            end = time.monotonic() + 20
            while got is None and time.monotonic() < end:
                got = ray.get(r.fetch.remote(version - 1))
            assert got is not None and got[0] == version
            for name, t in random_state(seed).items():
                assert got[1][name].dtype == t.dtype and torch.equal(got[1][name], t), name
            if counts is not None:
                counts.append(got[2])

    sender.publish(random_state(0), 0)  # before the group: by the object store, which gives the layout
    received_by_all(0, 0)
    wait_for(lambda: sender.formed and all(ray.get([r.joined.remote() for r in receivers])), what="the group")
    assert said == ["weights: broadcast group formed (the trainer and 2 searcher(s), generation 1)"]
    for v in (1, 2):
        sender.publish(random_state(v), v)
        assert sender.last == (v, None)  # went by broadcast: nothing in the object store
        counts: list[int] = []
        received_by_all(v, v, counts)
        assert counts == [v, v]  # both staged it from the broadcast
    assert sender.metrics() == {"weights/broadcast_group": 1.0, "weights/broadcasts": 2.0, "weights/fallbacks": 0.0}

    # searcher 1 dies after the next broadcast's header: the trainer is not held past its timeout,
    # and that version reaches the survivor by the object store
    ray.get(receivers[1].die_mid_broadcast.remote())
    start = time.monotonic()
    sender.publish(random_state(3), 3)
    assert time.monotonic() - start < sender.timeout_s
    assert sender.last[0] == 3 and sender.last[1] is not None and not sender.formed
    assert "the broadcast of version 3 failed" in said[-1] and "object store" in said[-1]
    got = ray.get(receivers[0].fetch.remote(2))
    assert got[0] == 3 and all(torch.equal(got[1][k], t) for k, t in random_state(3).items())
    assert sender.metrics()["weights/fallbacks"] == 1.0

    # it restarts (a new incarnation registers under its index): the group forms again with it
    receivers[1] = Receiver.remote(1, "second-1")
    wait_for(lambda: sender.formed and sender.generation == 2, what="the second group")
    wait_for(lambda: ray.get(receivers[0].joined.remote()) == 2 and ray.get(receivers[1].joined.remote()) == 2)
    sender.publish(random_state(4), 4)
    assert sender.last == (4, None)
    received_by_all(4, 4)
    # every version was published once, by one path, in order
    assert ray.get(board.get_if_newer.remote(-1))[0] == 4
    assert sender.metrics() == {"weights/broadcast_group": 1.0, "weights/broadcasts": 3.0, "weights/fallbacks": 1.0}

    # from the publisher's thread, as a run publishes: live fp32 weights (no cast copies them) are
    # free once staged in the send buffer, so the optimizer step after settle() changes nothing sent
    publisher = publish_live_then_step(sender, 5)
    received_by_all(5, 5)  # the weights as they were handed over
    publisher.close()
    sender.close()


@ray.remote(num_cpus=0)
class SharedReader:
    """A searcher's side of ``runtime.weight_transport=ipc`` alone, in its own process."""

    def __init__(self, token: str) -> None:
        self.receiver = SharedReceiver(ray.get_actor("shared-board"), token)

    def fetch(self, newer_than: int):
        got = self.receiver.fetch(newer_than)
        if got is None:
            return None
        ties = got[1]["lm_head.weight"].data_ptr() == got[1]["embed.weight"].data_ptr()
        return got[0], {k: v.clone() for k, v in got[1].items()}, self.receiver.copies, ties


def test_ipc_delivers_exact_weights_through_shared_slots_and_never_overwrites_a_leased_one(ray_local):
    board = WeightBoard.options(name="shared-board").remote()
    sender = SharedSender(board, lease_timeout_s=60)
    readers = [SharedReader.remote(f"reader-{i}") for i in range(2)]

    def received_by_all(version: int, seed: int, copies: int | None) -> None:
        for r in readers:
            got = ray.get(r.fetch.remote(version - 1))
            assert got is not None and got[0] == version and got[3]  # tied entries: one tensor
            for name, t in random_state(seed).items():
                assert got[1][name].dtype == t.dtype and torch.equal(got[1][name], t), name
            if copies is not None:
                assert got[2] == copies  # copied from a shared slot, not fetched from the object store
            assert ray.get(r.fetch.remote(version)) is None  # nothing newer

    assert ray.get(readers[0].fetch.remote(-1)) is None  # nothing published yet
    for v in (0, 1):
        sender.publish(random_state(v), v)
        assert sender.last == (v, None) and ray.get(board.get_if_newer.remote(-1))[0] == v
        received_by_all(v, v, v + 1)
    assert sender.newest == 1 and sender.metrics()["weights/shared_publications"] == 2.0

    # a reader holds a lease on the newest slot (1): the next version goes to slot 0 at once; the one
    # after it needs slot 1 and waits, without touching it, until the lease is returned
    assert ray.get(board.lease.remote(0, "slow")) == (1, 1)
    sender.publish(random_state(2), 2)
    assert sender.newest == 0
    done = threading.Event()
    worker = threading.Thread(target=lambda: (sender.publish(random_state(3), 3), done.set()))
    worker.start()
    assert not done.wait(0.5)  # cannot finish while the lease is held
    held = sender.layout.views(sender.slots.buffers[1])
    assert all(torch.equal(held[k], t) for k, t in random_state(1).items())  # slot 1 still holds version 1
    ray.get(board.release.remote("slow"))
    worker.join(timeout=30)
    assert done.is_set() and sender.newest == 1
    received_by_all(3, 3, 3)

    # a version that went by the object store reaches the readers from there
    RayWeightStore(board).publish(random_state(4), 4)
    received_by_all(4, 4, 3)

    # a lease whose reader died mid-copy is dropped after the timeout
    sender.lease_timeout_s = 0.3
    ray.get(board.set_slot.remote(5, sender.newest))  # (the newest bytes are version 3's; only the slot matters)
    assert ray.get(board.lease.remote(4, "dead")) == (5, 1)
    sender.publish(random_state(6), 6)  # slot 0
    sender.publish(random_state(7), 7)  # slot 1: waits out the dead lease
    received_by_all(7, 7, 4)

    # from the publisher's thread, as a run publishes: live weights are free once copied into a slot
    publisher = publish_live_then_step(sender, 8)
    received_by_all(8, 8, 5)
    # a sender whose first publication comes staged (the publisher's path for fp32 weights)
    first = SharedSender(WeightBoard.remote())
    staged = first.stage(random_state(9))
    first.publish(staged, 9)
    assert first.newest == 0 and first.publications == 1 and Layout.holds(first.slots.buffers[0], staged)
    first.close()
    publisher.close()
    names = [s.name for s in sender.slots.shm]
    for r in readers:
        ray.kill(r)
    sender.close()  # the shared memory is gone with it
    for name in names:
        with pytest.raises(FileNotFoundError):
            shared_memory.SharedMemory(name=name)
    ray.kill(board)


def test_the_inbox_pauses_searchers_that_run_ahead_of_what_the_trainer_draws(ray_local):
    inbox = Inbox.remote(max_ahead=8)  # runtime.max_ahead=1 at 8 prompts a step
    stats = {"incarnation": "a"}
    assert not ray.get(inbox.ahead.remote())
    assert ray.get(inbox.put.remote(0, ["g"] * 6, stats, []))
    assert not ray.get(inbox.ahead.remote())  # 6 waiting to be drawn: below 8
    ray.get(inbox.put.remote(1, ["g"] * 4, {"incarnation": "b"}, []))
    assert ray.get(inbox.ahead.remote())  # 10
    groups, _, _ = ray.get(inbox.drain.remote(0))  # in the buffer now, but not drawn yet
    assert len(groups) == 10 and ray.get(inbox.ahead.remote())
    ray.get(inbox.drain.remote(8))  # the trainer took a step of 8
    assert not ray.get(inbox.ahead.remote())  # 2 ahead
    ray.get(inbox.put.remote(0, ["g"] * 6, stats, []))
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
