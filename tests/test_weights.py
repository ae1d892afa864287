"""Weight publication: the in-process store, the object-store packing, and the background
publisher that takes publication off the trainer's path."""

from __future__ import annotations

import threading

import pytest
import torch
from tests.helpers.trainers import make_trainer, synthetic_groups

from tba.buffer import ReplayBuffer
from tba.weights import BackgroundPublisher, LocalWeightStore, shares_memory
from tba.weights.ray.board import pack, unpack


class GatedStore(LocalWeightStore):
    """A real in-process store whose publications wait until the test opens a gate, as a slow
    transport would; ``fail`` makes the next one raise."""

    def __init__(self) -> None:
        super().__init__(keep=10)
        self.gate = threading.Event()
        self.started = threading.Event()
        self.fail: Exception | None = None

    def send(self, state_dict, version):
        self.started.set()
        self.gate.wait()
        if self.fail is not None:
            raise self.fail
        super().send(state_dict, version)

    def versions(self) -> list[int]:
        return [v for v, _ in self._history]


def state(value: float) -> dict[str, torch.Tensor]:
    return {"w": torch.full((3,), value)}


def test_the_local_store_keeps_copies_and_only_newer_versions():
    store = LocalWeightStore(keep=3)
    assert store.fetch(newer_than=-1) is None and store.visible_version == -1
    live = state(1.0)
    store.publish(live, 0)
    live["w"].add_(5.0)  # a later optimizer step does not leak into what searchers load
    version, got = store.fetch(newer_than=-1)
    assert version == 0 and torch.equal(got["w"], state(1.0)["w"])
    assert store.fetch(newer_than=0) is None
    with pytest.raises(ValueError, match="not newer"):
        store.publish(state(2.0), 0)
    for v in (1, 2, 3):
        store.publish(state(float(v)), v)
    assert store.fetch_delayed(-1, 2)[0] == 1  # the newest at least two versions behind the newest


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_packing_for_the_object_store_is_exact_and_keeps_ties(dtype):
    g = torch.Generator().manual_seed(0)
    embed = torch.randn(7, 4, generator=g).to(dtype)
    original = {
        "embed.weight": embed,
        "head.weight": embed,  # tied: one array, one tensor after unpacking
        "norm.weight": torch.randn(4, generator=g).to(dtype).t(),
        "strided": torch.randn(4, 6, generator=g).to(dtype)[:, ::2],
        "positions": torch.arange(5),
    }
    packed = pack(original)
    assert packed["arrays"]["embed.weight"] is packed["arrays"]["head.weight"]
    back = unpack(packed)
    assert back.keys() == original.keys()
    for key, tensor in original.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert back["embed.weight"] is back["head.weight"]


def test_the_publisher_hands_over_and_the_version_becomes_visible_when_stored():
    store = GatedStore()
    publisher = BackgroundPublisher(store)
    publisher.publish(state(0.0), 0, aliases=False)  # returns while the store is still busy
    store.started.wait()
    assert publisher.visible_version == -1 and store.visible_version == -1
    store.gate.set()
    publisher.flush()
    assert publisher.visible_version == 0 and store.fetch(-1)[0] == 0
    publisher.close()


def test_the_newest_publication_replaces_one_not_yet_started():
    store = GatedStore()
    publisher = BackgroundPublisher(store)
    publisher.publish(state(0.0), 0, aliases=False)
    store.started.wait()  # version 0 is in flight
    publisher.publish(state(1.0), 1, aliases=False)
    publisher.publish(state(2.0), 2, aliases=False)  # version 1 had not started: dropped for 2
    store.gate.set()
    publisher.close()
    assert store.versions() == [0, 2] and publisher.superseded == 1 and publisher.published == 2
    assert torch.equal(store.fetch(-1)[1]["w"], state(2.0)["w"])


def test_settle_waits_for_a_publication_that_reads_the_live_weights():
    store = GatedStore()
    publisher = BackgroundPublisher(store)
    publisher.publish(state(0.0), 0, aliases=True)
    store.started.wait()
    waiter = threading.Thread(target=publisher.settle)
    waiter.start()
    waiter.join(timeout=0.2)
    assert waiter.is_alive()  # the gate is closed: the copy has not been made, the optimizer must wait
    store.gate.set()
    waiter.join()
    publisher.close()


def test_settle_does_not_wait_for_a_publication_of_its_own_copy():
    store = GatedStore()
    publisher = BackgroundPublisher(store)
    publisher.publish(state(0.0), 0, aliases=False)  # a cast made its own tensors
    store.started.wait()
    publisher.settle()  # returns with the gate still closed
    assert store.visible_version == -1
    store.gate.set()
    publisher.close()


def test_a_cast_on_the_thread_frees_the_optimizer_before_the_store_is_done():
    store = GatedStore()
    publisher = BackgroundPublisher(store)
    live = state(1.5)
    publisher.publish(live, 0, aliases=True, prepare=lambda s: {k: v.to(torch.bfloat16) for k, v in s.items()})
    store.started.wait()  # the cast ran; the store is still busy
    publisher.settle()  # returns with the gate closed: the publication reads its own copy
    live["w"].add_(1.0)
    store.gate.set()
    publisher.close()
    got = store.fetch(-1)[1]["w"]
    assert got.dtype == torch.bfloat16 and torch.equal(got, torch.full((3,), 1.5, dtype=torch.bfloat16))


def test_a_publisher_error_reaches_the_trainer_on_its_next_call():
    store = GatedStore()
    publisher = BackgroundPublisher(store)
    store.fail = OSError("object store full")
    publisher.publish(state(0.0), 0, aliases=False)
    store.gate.set()
    with pytest.raises(RuntimeError, match="publishing weights failed: OSError") as raised:
        publisher.flush()
    assert isinstance(raised.value.__cause__, OSError)
    with pytest.raises(RuntimeError, match="closed"):
        publisher.publish(state(1.0), 1)


@pytest.mark.parametrize("publish_dtype", [None, torch.bfloat16])
def test_steps_with_publication_in_flight_train_the_same_weights(tokenizer, publish_dtype):
    """fp32 weights alias what is published (None: no cast; bfloat16: cast on the publisher's
    thread): the optimizer waits for each copy or cast, and the result is the same, bit for bit, as
    publishing in line; every version lands in the store."""
    from tests.conftest import SMALL

    from tba.models.tiny import build_tiny_llama

    def run(background: bool) -> tuple[dict[str, torch.Tensor], list]:
        torch.manual_seed(0)
        model = build_tiny_llama(tokenizer, SMALL)
        store = LocalWeightStore(keep=10)
        weights = BackgroundPublisher(store) if background else store
        buffer = ReplayBuffer(capacity=1000, recent_prob=1.0, seed=0)
        trainer = make_trainer(model, tokenizer, buffer, weights, sync_interval=1)
        trainer.publish_dtype = publish_dtype
        for g in synthetic_groups(tokenizer, n_prompts=6, k=4):
            buffer.add(g, step=0)
        trainer.publish()
        trainer.flush_publication()
        metrics = [trainer.step() for _ in range(4)]
        if background:
            assert shares_memory(trainer.published_state(), model) == (publish_dtype is None)
            assert all(m["weights/publish_background_s"] > 0 for m in metrics)
            weights.close()
        assert all(m["train/publish_s"] > 0 for m in metrics)  # every step publishes (sync_interval 1)
        return {k: v.clone() for k, v in model.state_dict().items()}, list(store._history)

    inline, inline_published = run(background=False)
    threaded, threaded_published = run(background=True)
    assert [v for v, _ in inline_published] == [v for v, _ in threaded_published] == [0, 1, 2, 3, 4]
    for key in inline:
        assert torch.equal(inline[key], threaded[key]), key
    for (version, a), (_, b) in zip(inline_published, threaded_published, strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a), version  # no publication caught a step midway
