"""What only a CUDA device can show: bf16 numerics of the trainer there, its memory by CUDA's own
count, and that every tensor of a step stays on the device. Skipped by ``make test``
(``-m 'not gpu'``) and wherever no CUDA device is visible; run with ``pytest -m gpu``."""

from __future__ import annotations

import pytest
import torch
from tests.helpers.direct_logprobs import full_logits_token_logprobs
from tests.helpers.gradients import random_sequences, uneven_batch
from tests.helpers.numerics import assert_reordered_close, bf16_operand_terms
from tests.helpers.trainers import make_trainer, synthetic_groups
from transformers import Qwen2Config, Qwen2ForCausalLM

from tba.buffer import ReplayBuffer
from tba.models.logprobs import token_logprobs
from tba.models.precision import PeakMemory, Precision, resolve_precision
from tba.runtime.policy import enable_gradient_checkpointing
from tba.weights import LocalWeightStore

pytestmark = [
    pytest.mark.slow,  # end to end (make test-fast leaves it out)
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
CUDA = torch.device("cuda")


def qwen(vocab: int = 32_000, layers: int = 2, hidden: int = 256) -> Qwen2ForCausalLM:
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=False,
    )
    return Qwen2ForCausalLM(config).to(CUDA).train()


def peak_bytes(fn) -> int:
    """CUDA's maximum allocated bytes during ``fn()`` (forward and backward), above what was there.
    ``fn`` runs once before, unmeasured: a first call allocates what stays (cuBLAS workspaces, the
    gradients), which would count against whichever variant ran first."""
    fn()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def test_auto_precision_is_bf16_mixed_on_a_bf16_gpu():
    expected = "bf16-mixed" if torch.cuda.is_bf16_supported() else "fp32"
    assert resolve_precision("auto", CUDA) == expected


def test_lean_logprobs_take_less_cuda_memory_and_agree():
    model = qwen()
    prompts, completions = random_sequences(16)
    # long prompts, short completions (what the lean path is for): the full path holds the logits of
    # every position (16 x ~410 x 32000 in bf16, ~420 MB), the lean one of the ~20 completion positions
    prompts = [p + [7] * 400 for p in prompts]
    results = {}
    for name, fn in (("lean", token_logprobs), ("full", full_logits_token_logprobs)):

        def run(fn=fn, name=name):
            # gradients stay allocated (zeroed in place), so the peaks compare activations alone: on an
            # H200, with them reallocated inside the measured pass and 100-token prompts, the two
            # variants' 66 MB of gradients made lean 130 MB against full 183 MB
            model.zero_grad(set_to_none=False)
            with Precision("bf16-mixed", "cuda").autocast():
                logp, _ = fn(model, prompts, completions, 0, {1})
            logp.sum().backward()
            results[name] = logp.detach()

        results[name + "_peak"] = peak_bytes(run)
    assert results["lean"].dtype == torch.float32
    # bf16 logits both ways, but the head's product is cut in chunks, which may round a logit to the
    # neighbouring bf16 value (and reorders the fp32 log-softmax over the vocabulary)
    assert_reordered_close(
        results["lean"], results["full"], dtype=torch.bfloat16, terms=bf16_operand_terms(model.config)
    )
    assert results["lean_peak"] < 0.5 * results["full_peak"], (results["lean_peak"], results["full_peak"])


def test_gradient_checkpointing_lowers_cuda_peak():
    peaks = []
    for checkpointing in (False, True):
        model = qwen(vocab=4096, layers=6)
        if checkpointing:
            enable_gradient_checkpointing(model)
        prompts, completions = random_sequences(32, vocab=4096)  # ids the model's vocabulary holds
        prompts = [p + [7] * 200 for p in prompts]

        def run(model=model, prompts=prompts, completions=completions):
            with Precision("bf16-mixed", "cuda").autocast():
                logp, _ = token_logprobs(model, prompts, completions, 0, {1})
            logp.sum().backward()

        peaks.append(peak_bytes(run))
    assert peaks[1] < 0.7 * peaks[0], peaks


def test_bf16_mixed_moves_weights_like_fp32_on_cuda_and_pure_bf16_does_not(tokenizer):
    from tba.models.tiny import TinySpec, build_tiny_llama

    torch.manual_seed(0)
    start = build_tiny_llama(tokenizer, TinySpec(hidden_size=64, layers=2, heads=2, intermediate_size=128))
    results = {}
    for mode in ("fp32", "bf16-mixed", "bf16"):
        model = type(start)(start.config)
        model.load_state_dict(start.state_dict())
        model = model.to(CUDA, Precision(mode).weights_dtype).train()
        buffer = ReplayBuffer(capacity=1000, recent_prob=1.0, seed=0)
        trainer = make_trainer(model, tokenizer, buffer, LocalWeightStore(), batch_prompts=6, lr=1e-6, grad_clip=None)
        trainer.precision = Precision(mode, "cuda")
        for g in synthetic_groups(tokenizer, n_prompts=6, k=4):
            buffer.add(g, step=0)
        batch = buffer.sample(6, 4)
        for _ in range(10):
            trainer.step(batch)
        results[mode] = torch.cat([p.detach().float().cpu().flatten() for p in model.parameters()])
    init = torch.cat([p.detach().float().flatten() for p in start.parameters()])
    init_bf16 = torch.cat([p.detach().bfloat16().float().flatten() for p in start.parameters()])
    assert (results["bf16"] == init_bf16).float().mean() > 0.9
    fp32, mixed = results["fp32"] - init, results["bf16-mixed"] - init
    assert (mixed == 0).float().mean() < 0.01
    assert (mixed - fp32).norm() / fp32.norm() < 0.2


def test_a_trainer_step_stays_on_the_device_and_reports_cuda_peak(tiny_model, tokenizer):
    model = tiny_model.to(CUDA).train()
    batch = uneven_batch(tokenizer)
    trainer = make_trainer(model, tokenizer, ReplayBuffer(), LocalWeightStore(), batch_prompts=batch.num_groups)
    trainer.precision = Precision("bf16-mixed", "cuda")
    peak = PeakMemory(CUDA)
    metrics = trainer.step(batch)
    assert all(p.device.type == "cuda" for p in model.parameters())
    assert all(s["exp_avg"].device.type == "cuda" for s in trainer.optimizer.state.values())
    assert torch.isfinite(torch.tensor(metrics["train/loss"]))
    assert peak.read() > 0
    published = trainer.published_state()
    assert all(v.device.type == "cuda" for v in published.values())


def test_a_gpu_publication_is_staged_in_pinned_buffers_and_frees_the_optimizer_early():
    from tba.weights import BackgroundPublisher

    store = LocalWeightStore(keep=4)
    publisher = BackgroundPublisher(store)
    live = {"w": torch.randn(1024, 1024, device=CUDA), "b": torch.arange(7, device=CUDA)}
    expected = {k: v.cpu() for k, v in live.items()}
    publisher.publish(live, 0, aliases=True)  # fp32 without a cast: the live weights
    publisher.settle()  # the copy to the host has landed
    live["w"].add_(1.0)  # an optimizer step now cannot reach the publication
    publisher.flush()
    version, got = store.fetch(-1)
    assert version == 0 and all(torch.equal(got[k], expected[k]) for k in expected)
    first = publisher._pinned["w"]
    assert first.is_pinned() and not got["w"].is_cuda
    publisher.publish(live, 1, aliases=True)
    publisher.flush()
    assert publisher._pinned["w"] is first  # allocated once, reused
    assert torch.equal(store.fetch(0)[1]["w"], live["w"].cpu())
    publisher.close()


def test_ipc_slots_carry_gpu_weights_exactly_to_a_searcher_process_on_the_same_gpu():
    """``runtime.weight_transport=ipc`` on a GPU: the trainer's publication lands in a slot of GPU
    memory that a Ray actor on the same GPU maps by CUDA IPC handle and copies device to device;
    what it holds equals what was published, bit for bit, dtypes and ties kept."""
    ray = pytest.importorskip("ray")
    from tests.helpers.states import random_state

    from tba.weights import BackgroundPublisher
    from tba.weights.ray.boards import SlotBoard
    from tba.weights.ray.ipc import SharedReceiver, SharedSender

    @ray.remote(num_gpus=0.5)
    class Reader:
        def __init__(self):
            self.receiver = SharedReceiver(ray.get_actor("gpu-ipc-board"), "reader")

        def fetch(self, newer_than):
            got = self.receiver.fetch(newer_than)
            state = got[1]
            assert all(v.is_cuda for v in state.values())
            ties = state["lm_head.weight"].data_ptr() == state["embed.weight"].data_ptr()
            return got[0], {k: v.cpu() for k, v in state.items()}, ties

    ray.init(num_gpus=1, num_cpus=2, include_dashboard=False, configure_logging=False)
    try:
        board = SlotBoard.options(name="gpu-ipc-board").remote()
        sender = SharedSender(board)
        publisher = BackgroundPublisher(sender)  # as a run publishes: from its thread, GPU to GPU
        reader = Reader.remote()
        for v in range(3):
            state = {k: t.to(CUDA) for k, t in random_state(v).items()}
            state["lm_head.weight"] = state["embed.weight"]  # tied on the GPU too
            publisher.publish(state, v, aliases=True)
            publisher.flush()
            assert sender.slots.buffers[0].is_cuda and sender.publications == v + 1
            version, got, ties = ray.get(reader.fetch.remote(v - 1))
            assert version == v and ties
            for name, t in random_state(v).items():
                assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
        ray.kill(reader)
        publisher.close()  # and the sender: its slots are freed
    finally:
        ray.shutdown()
