"""Continuous generation (``tba.generation.stream``): the HF stream here; the vLLM stream's checks
run in their own process (``tests/helpers/vllm_checks.py --stream``, from ``tests/test_vllm.py``)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch
from tests.conftest import assert_reports_declared

from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.generation.stream import HFContinuousStream, HFRefillStream, hf_continuous_problem, open_stream
from tba.plan.auto import streams as auto_streams

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)


def _prompts(tokenizer) -> list[list[int]]:
    return [tokenizer(text)["input_ids"] for text in ("1+2=", "50-7=", "3=", "12+12=", "9-9=")]


def test_hf_stream_generates_waiting_prompts_in_refill_batches_each_once(tiny_model, tokenizer):
    torch.manual_seed(0)
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    gen.version = 4
    stream = HFRefillStream(gen, SamplingParams(n=3, temperature=1.0, max_new_tokens=8), refill=2)
    for key, ids in enumerate(_prompts(tokenizer)):
        stream.submit(key, ids)
    assert stream.in_flight() == 5
    sizes, keys = [], []
    while stream.in_flight():
        finished = stream.advance()
        sizes.append(len(finished))
        keys += [f.key for f in finished]
        for f in finished:
            assert len(f.completions) == 3 and (f.oldest_version, f.newest_version) == (4, 4)
            assert all(1 <= len(c.token_ids) <= 8 for c in f.completions)
    assert sizes == [2, 2, 1] and keys == [0, 1, 2, 3, 4]
    assert stream.advance() == []


def test_hf_stream_set_lengths_and_greedy_prefix(tiny_model, tokenizer):
    eos = tokenizer.eos_token_id
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {eos})
    prompts = _prompts(tokenizer)[:3]
    stream = HFRefillStream(gen, SamplingParams(n=2, temperature=1.0, max_new_tokens=8, logprobs=True), refill=3)
    for key, (ids, length) in enumerate(zip(prompts, (5, 2, 9), strict=True)):
        stream.submit(key, ids, length=length)
    finished = stream.advance()
    assert [[len(c.token_ids) for c in f.completions] for f in finished] == [[5, 5], [2, 2], [9, 9]]
    # run to a set length, not to an end token: unfinished, one log-prob per token, no EOS inside
    for f in finished:
        for c in f.completions:
            assert not c.finished and len(c.token_logps) == len(c.token_ids) and eos not in c.token_ids


def test_hf_stream_loads_weights_for_what_waits_and_abort_returns_the_keys(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    gen.version = 1
    greedy_like = SamplingParams(n=1, temperature=1e-4, max_new_tokens=6)  # a stream samples; this one as greedy
    stream = HFRefillStream(gen, greedy_like, refill=1)
    prompts = _prompts(tokenizer)
    for key, ids in enumerate(prompts[:3]):
        stream.submit(key, ids)
    torch.manual_seed(0)
    (first,) = stream.advance()
    other = type(tiny_model)(tiny_model.config).eval()
    torch.manual_seed(1)
    with torch.no_grad():
        for p, q in zip(other.parameters(), tiny_model.parameters(), strict=True):
            p.copy_(q + 0.5 * torch.randn_like(q))
    for mode in ("drain", "in_flight"):  # nothing is half generated here: both load at once
        assert stream.load_weights(other.state_dict(), version=2, mode=mode) == []
    (second,) = stream.advance()
    assert (first.oldest_version, second.oldest_version, second.newest_version) == (1, 2, 2)
    expected = HFGenerator(other, tokenizer.pad_token_id, {tokenizer.eos_token_id}).generate(
        [prompts[1]], SamplingParams(n=1, greedy=True, max_new_tokens=6)
    )
    assert second.completions[0].token_ids == expected[0][0].token_ids  # the new weights generated it
    assert stream.abort() == [2] and stream.in_flight() == 0 and stream.advance() == []


def test_hf_stream_refuses_an_empty_refill(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    with pytest.raises(ValueError, match="refill"):
        HFRefillStream(gen, SamplingParams(), refill=0)


# ---------------------------------------------------------------- the streaming searcher


def _streaming_searcher(tiny_model, tokenizer, weights, in_flight=6, refill=2, min_out=2, task=None, **kwargs):
    from tba.searcher import StreamingSearcher
    from tba.tasks.arithmetic import ArithmeticTask

    eos = {tokenizer.eos_token_id}
    sampler = type(tiny_model)(tiny_model.config).eval()
    gen = HFGenerator(sampler, tokenizer.pad_token_id, eos)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    return StreamingSearcher(
        task or ArithmeticTask(digits=1, operators="+-", eval_size=10),
        tokenizer,
        gen,
        tiny_model,  # the reference
        weights,
        params,
        in_flight,
        eos,
        seed=0,
        stream=HFRefillStream(gen, params, refill=refill),
        max_in_flight=in_flight,
        weight_update="in_flight",
        min_groups_out=min_out,
        **kwargs,
    )


def test_streaming_searcher_keeps_its_engine_full_and_accounts_for_every_prompt(tiny_model, tokenizer):
    from tba.weights import LocalWeightStore

    torch.manual_seed(0)
    weights = LocalWeightStore()
    # one scoring thread: groups are scored, so sent, in the order they left the engine (all of
    # version 0 before any of version 2), whatever the threads' speed
    searcher = _streaming_searcher(tiny_model, tokenizer, weights, reward_workers=1)
    with pytest.raises(RuntimeError, match="publish"):
        searcher.step()
    weights.publish(tiny_model.state_dict(), 0)
    seen, floors = [], []
    # at most 10 prompts in flight when version 2 is published (12 at most, 2 just sent), each step
    # sends at least 2: after 5 more steps every group generated with version 0 is sent or dropped
    for i in range(9):
        if i == 3:
            weights.publish(tiny_model.state_dict(), 2)  # picked up between two refills
        groups = searcher.step()
        m = searcher.metrics()
        assert_reports_declared(m)
        # the staleness bound's floor: no group sent later is older than a floor reported before
        assert all(g.policy_version >= f for g in groups for f in floors)
        waiting = [key[3] for key, _, _ in searcher.stream._waiting]
        oldest = searcher.report().oldest_version  # (control data: not a metric)
        assert "searcher/oldest_version" not in m and oldest <= min([searcher.version, *waiting])
        if i == 3 and 0 in waiting:  # prompts taken under version 0 wait in the engine: the floor stays at 0
            assert oldest == 0 and m["searcher/version"] == 2
        floors.append(oldest)
        # every prompt taken: sent, dropped (fewer than two usable completions) or still in flight
        assert (
            m["searcher/prompts_taken"]
            == m["searcher/groups_sent"] + m["searcher/dropped_groups"] + m["searcher/in_flight"]
        )
        # six in the engine, and at most six more out of it (scoring, the reference pass)
        assert m["searcher/in_flight"] <= 12 and m["searcher/prompts_taken"] >= 6
        assert all(2 <= len(g.completions) <= 4 and g.newest_version is None for g in groups)
        seen.append(sorted({g.policy_version for g in groups}))
    assert seen[0] == [0] and seen[-1] == [2]
    assert floors[0] == 0 and floors[-1] <= 2
    assert searcher.metrics()["searcher/versions_per_group"] == 1.0  # HF loads between refills only


def test_streaming_searcher_config_is_checked_and_built_for_the_ray_runtime(tmp_path):
    from tba.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="keeps its engine awake: set generation.vllm.sleep=false"):
        load_config(None, ["--generation.stream=true", "--generation.backend=vllm", "--generation.vllm.sleep=true"])
    with pytest.raises(ConfigError, match="no generation.explore_prob"):
        load_config(None, ["--generation.stream=true", "--generation.explore_prob=0.3"])
    cfg = load_config(None, ["--generation.stream=true", "--generation.weight_update=drain"])
    assert (cfg.generation.max_in_flight, cfg.generation.weight_update) == (None, "drain")

    def streams(*args, device="cuda"):  # the ray runtime unless the arguments say sync
        cfg = load_config(None, ["--runtime.type=ray", *args])
        return auto_streams(cfg.generation, cfg.runtime.type, device)

    # auto: the ray runtime streams long completions on vLLM or a GPU; true and false are kept as given
    assert streams("--generation.max_new_tokens=256") and not streams("--generation.max_new_tokens=255")
    assert not streams("--generation.max_new_tokens=512", device="cpu")  # HF continuous batching on a CPU
    assert streams("--generation.max_new_tokens=512", "--generation.backend=vllm", device="cpu")
    assert not streams()  # the demo: 8 tokens
    assert not streams("--runtime.type=sync", "--generation.max_new_tokens=512")
    assert not streams("--generation.max_new_tokens=512", "--generation.explore_prob=0.3")
    assert streams("--runtime.type=sync", "--generation.stream=true")
    assert not streams("--generation.max_new_tokens=512", "--generation.stream=false")


class _NumberedTask:
    """The arithmetic task with each prompt taken numbered (``n<i>:`` in its id), and a reward that
    holds every third prompt until ``release`` is set (``held``: when each call began to wait), and
    the ``hang`` prompts until ``unhang`` is set (``hung``: their threads), after calling ``on_hang``.
    No clock ends a wait: the test sets the events (the 60 s are a guard against a stuck test only)."""

    def __new__(
        cls,
        release: threading.Event | None = None,
        hang: set[int] = frozenset(),
        unhang: threading.Event | None = None,
        on_hang=lambda: None,
    ):
        import dataclasses
        import time

        from tba.tasks.arithmetic import ArithmeticTask

        class Numbered(ArithmeticTask):
            def sample_prompts(self, n, rng):
                out = []
                for p in super().sample_prompts(n, rng):
                    out.append(dataclasses.replace(p, id=f"n{self.taken}:{p.id}"))
                    self.taken += 1
                return out

            def rewards(self, prompts, completions, completion_ids, stats):
                numbers = {int(p.id[1:].split(":")[0]) for p in prompts}
                if numbers & set(hang):
                    self.hung.append(threading.current_thread())
                    on_hang()
                    if not unhang.wait(60):
                        raise AssertionError(f"the reward call of {sorted(numbers)} was waited for")
                elif release is not None and any(i % 3 == 0 for i in numbers):
                    self.held.update(dict.fromkeys(numbers, time.perf_counter()))
                    if not release.wait(60):
                        raise AssertionError(f"prompts {sorted(numbers)} held for good: the test never released them")
                return super().rewards(prompts, completions, completion_ids, stats)

        task = Numbered(digits=1, operators="+-", eval_size=10)
        task.taken, task.held, task.hung = 0, {}, []
        return task


class _PoolClock:
    """``time`` for :mod:`tba.scoring`: a clock that stands still until the test moves it, so a
    call is given up because the test moved it past the call's deadline, and never because a
    thread ran slowly (a busy machine)."""

    def __init__(self):
        self.now = 0.0

    def monotonic(self) -> float:
        return self.now


def test_streaming_searcher_sends_groups_as_they_are_scored_none_lost_or_twice(tiny_model, tokenizer):
    """A reward that holds every third prompt until two other groups were sent: the groups behind it
    are sent first; every prompt taken is sent once, dropped, or in flight."""
    import time

    from tba.weights import LocalWeightStore

    torch.manual_seed(0)
    weights = LocalWeightStore()
    weights.publish(tiny_model.state_dict(), 0)
    release = threading.Event()
    task = _NumberedTask(release=release)
    searcher = _streaming_searcher(tiny_model, tokenizer, weights, task=task, refill=1, min_out=1, reward_workers=3)
    sent, released_at = [], None
    try:
        for _ in range(10):
            sent += [int(g.prompt_id[1:].split(":")[0]) for g in searcher.step()]
            if released_at is None and sum(i % 3 != 0 for i in sent) >= 2:
                released_at = time.perf_counter()
                release.set()  # the held groups go on only now, after two fast ones were sent
            m = searcher.metrics()
            assert m["searcher/prompts_taken"] == task.taken
            assert task.taken == m["searcher/groups_sent"] + m["searcher/dropped_groups"] + m["searcher/in_flight"]
    finally:
        release.set()
    assert released_at is not None and 0 in task.held, (sent, sorted(task.held))
    assert len(sent) == len(set(sent)) == searcher.groups_sent  # none twice
    assert sent != sorted(sent)  # out of order: fast groups overtook the slow ones
    overtaken = [i for i in sent if i % 3 == 0 and any(j > i for j in sent[: sent.index(i)])]
    assert 0 in overtaken, f"the first, held group was not overtaken: {sent}"
    # its latency (taken → sent) covers the time it was held: taken before its reward call began
    # to wait, sent after the release
    assert searcher.latencies[sent.index(0)] >= released_at - task.held[0]
    assert 0 < m["searcher/group_latency_p50_s"] <= m["searcher/group_latency_p95_s"]
    assert 0 < m["searcher/engine_busy"] <= 1
    searcher.close()
    after = searcher.metrics()  # what was in flight at shutdown stays counted
    assert after["searcher/in_flight"] == m["searcher/in_flight"] > 0


def test_streaming_searcher_gives_up_a_hanging_reward_and_goes_on(tiny_model, tokenizer, monkeypatch):
    """Prompt 1's reward call never returns (until the test ends); the pool's clock stands still but
    for the test moving it past that call's deadline once the call began, so no other call (all
    quick) ever reaches its deadline, however slowly its thread runs."""
    from tba.weights import LocalWeightStore

    clock = _PoolClock()
    monkeypatch.setattr("tba.scoring.time", clock)
    torch.manual_seed(0)
    weights = LocalWeightStore()
    weights.publish(tiny_model.state_dict(), 0)
    unhang = threading.Event()
    timeout = 5.0

    def past_its_deadline():  # on the call's own thread, after the pool noted its start
        clock.now += timeout

    task = _NumberedTask(hang={1}, unhang=unhang, on_hang=past_its_deadline)
    searcher = _streaming_searcher(
        tiny_model, tokenizer, weights, task=task, refill=1, min_out=1, reward_workers=1, reward_timeout=timeout
    )
    sent = []
    try:
        while len(sent) < 8:
            sent += [int(g.prompt_id[1:].split(":")[0]) for g in searcher.step()]
        m = searcher.metrics()
        # not held by the call: eight groups came through while it still hangs
        assert len(task.hung) == 1 and task.hung[0].is_alive() and not unhang.is_set()
        assert 1 not in sent and m["searcher/reward_timeouts"] == 4  # prompt 1's four samples, dropped
        assert searcher.pool.timed_out == 1
        assert task.taken == m["searcher/groups_sent"] + m["searcher/dropped_groups"] + m["searcher/in_flight"]
        searcher.close()
    finally:
        unhang.set()  # the hung call returns; its result is ignored
    task.hung[0].join(60)


def test_streaming_searcher_reference_thread_computes_the_same_log_probs(tiny_model, tokenizer):
    from tests.helpers.numerics import assert_reordered_close, model_terms

    from tba.models.packing import Passes
    from tba.weights import LocalWeightStore

    torch.manual_seed(0)
    weights = LocalWeightStore()
    weights.publish(tiny_model.state_dict(), 0)
    searcher = _streaming_searcher(tiny_model, tokenizer, weights, reference_thread=True)
    groups = [g for _ in range(4) for g in searcher.step()]
    assert groups and searcher._ref_thread is not None
    for g in groups:
        expected = Passes().sequence_logprobs(
            tiny_model, [g.prompt_ids] * len(g.completions), g.completions, tokenizer.pad_token_id,
            {tokenizer.eos_token_id},
        )  # fmt: skip
        tokens = max(len(g.prompt_ids) + len(c) for c in g.completions)
        assert_reordered_close(g.ref_logps, expected, terms=model_terms(tiny_model.config, tokens))
    searcher.close()


def test_scoring_pool_returns_results_gives_up_at_deadlines_and_raises_call_errors(monkeypatch):
    import time

    from tba.scoring import ScoringPool

    clock = _PoolClock()  # the pool's clock: moves only when the test moves it
    monkeypatch.setattr("tba.scoring.time", clock)
    started, unhang = threading.Event(), threading.Event()

    def hang():
        started.set()
        unhang.wait(60)  # set at the test's end (60 s: a guard against a stuck test only)
        return "late"

    pool = ScoringPool(workers=1, timeout=0.3)
    try:
        pool.submit("hang", hang)
        pool.submit("queued", lambda: 7)  # behind the hung call on the only worker
        assert started.wait(60)
        assert pool.collect() == ([], [])  # running, not past its deadline: waited for
        clock.now += 0.3  # the hung call's deadline
        done, expired = pool.collect()
        assert (done, expired, pool.timed_out) == ([], ["hang"], 1)
        guard = time.monotonic() + 60  # the real clock, against a stuck test only
        while pool.pending() and time.monotonic() < guard:
            d, e = pool.collect(wait_s=0.1)
            done += d
            expired += e
        assert expired == ["hang"] and done == [("queued", 7)] and pool.timed_out == 1  # the queued call moved on
        pool.submit("bad", lambda: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            for _ in range(600):  # (a guard against a stuck test only)
                pool.collect(wait_s=0.1)
        with pytest.raises(ValueError, match="worker"):
            ScoringPool(workers=0)
        pool.close()
    finally:
        unhang.set()


# ---------------------------------------------------------------- transformers' continuous batching


def test_hf_continuous_stream_groups_leave_as_they_finish_with_set_lengths(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    gen.version = 3
    stream = HFContinuousStream(gen, SamplingParams(n=3, temperature=1.0, max_new_tokens=8), max_in_flight=4)
    try:
        lengths = {0: 40, 1: 3, 2: None, 3: 12}
        for key, ids in zip(lengths, _prompts(tokenizer), strict=False):
            stream.submit(key, ids, length=lengths[key])
        assert stream.in_flight() == 4
        order, seen = [], {}
        while stream.in_flight():
            for f in stream.advance():
                order.append(f.key)
                seen[f.key] = f
        # the short ones first, the 40-token group last: out of submission order
        assert order[-1] == 0 and order.index(1) < order.index(3) and sorted(order) == [0, 1, 2, 3]
        for key, n in lengths.items():
            f = seen[key]
            assert len(f.completions) == 3 and (f.oldest_version, f.newest_version) == (3, 3)
            if n is None:  # its own end: at most max_new_tokens, finished iff it ends with EOS
                assert all(1 <= len(c.token_ids) <= 8 for c in f.completions)
                assert all(c.finished == (c.token_ids[-1] == tokenizer.eos_token_id) for c in f.completions)
            else:
                assert [len(c.token_ids) for c in f.completions] == [n] * 3
        # weights loaded with requests in flight (paused engine) reach the requests that follow; a
        # transformers that cannot pause its engine (before 5.2x) drains it first
        stream.submit("long", _prompts(tokenizer)[0], length=60)
        out = {f.key: f for f in stream.load_weights(tiny_model.state_dict(), version=4, mode="in_flight")}
        pauses = hasattr(stream.manager, "pause")
        assert list(out) == ([] if pauses else ["long"])
        stream.submit("after", _prompts(tokenizer)[1], length=2)
        while stream.in_flight():
            out.update({f.key: f for f in stream.advance()})
        assert (out["long"].oldest_version, out["long"].newest_version) == ((3, 4) if pauses else (3, 3))
        assert (out["after"].oldest_version, out["after"].newest_version) == (4, 4)
        stream.submit("x", _prompts(tokenizer)[2], length=50)
        assert stream.abort() == ["x"] and stream.in_flight() == 0
    finally:
        stream.close()


def test_hf_continuous_stream_says_what_it_cannot_serve(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    assert hf_continuous_problem(gen, SamplingParams(n=2)) is None
    assert "log-probs" in hf_continuous_problem(gen, SamplingParams(n=2, logprobs=True))
    assert "min_new_tokens" in hf_continuous_problem(gen, SamplingParams(n=2, min_new_tokens=3))
    with pytest.raises(ValueError, match="log-probs"):
        HFContinuousStream(gen, SamplingParams(n=2, logprobs=True), max_in_flight=2)


def test_open_stream_falls_back_to_refill_batches_and_reads_the_generators_version(tiny_model, tokenizer):
    gen = HFGenerator(tiny_model, tokenizer.pad_token_id, {tokenizer.eos_token_id})
    with pytest.warns(UserWarning, match=r"cannot serve this run \(the objective needs the sampler's token log-probs"):
        stream = open_stream("hf_continuous", gen, SamplingParams(n=2, logprobs=True), max_in_flight=4, refill=3)
    assert isinstance(stream, HFRefillStream) and stream.refill == 3
    assert stream.version == -1  # built weights, nothing published loaded yet
    state = {k: v.clone() for k, v in tiny_model.state_dict().items()}
    assert stream.load_weights(state, 7, "drain") == [] and stream.version == gen.version == 7
    stream.close()  # nothing to stop besides its requests
    refill = open_stream("hf_refill", gen, SamplingParams(n=2), max_in_flight=4, refill=2)
    assert isinstance(refill, HFRefillStream) and refill.refill == 2
    with pytest.raises(ValueError, match="no stream is called 'batch'"):
        open_stream("batch", gen, SamplingParams(n=2), max_in_flight=4, refill=2)


def test_streaming_searcher_on_continuous_batching_accounts_for_every_prompt(tiny_model, tokenizer):
    from tba.searcher import StreamingSearcher
    from tba.tasks.arithmetic import ArithmeticTask
    from tba.weights import LocalWeightStore

    torch.manual_seed(0)
    weights = LocalWeightStore()
    weights.publish(tiny_model.state_dict(), 0)
    eos = {tokenizer.eos_token_id}
    # a config of its own: continuous batching switches its model's attention (in its config)
    sampler = type(tiny_model)(copy.deepcopy(tiny_model.config)).eval()
    gen = HFGenerator(sampler, tokenizer.pad_token_id, eos)
    params = SamplingParams(n=4, temperature=1.0, max_new_tokens=6)
    searcher = StreamingSearcher(
        ArithmeticTask(digits=1, operators="+-", eval_size=10), tokenizer, gen, tiny_model, weights, params, 6, eos,
        stream=HFContinuousStream(gen, params, max_in_flight=6), max_in_flight=6, weight_update="in_flight",
        min_groups_out=2,
    )  # fmt: skip
    try:
        versions = set()
        for i in range(8):
            if i == 4:
                weights.publish(tiny_model.state_dict(), 2)
            groups = searcher.step()
            assert len(groups) >= 2 and all(2 <= len(g.completions) <= 4 for g in groups)
            versions |= {(g.policy_version, g.newest_version or g.policy_version) for g in groups}
            m = searcher.metrics()
            assert m["searcher/prompts_taken"] == (
                m["searcher/groups_sent"] + m["searcher/dropped_groups"] + m["searcher/in_flight"]
            )
        assert (0, 0) in versions and any(newest == 2 for _, newest in versions)
    finally:
        searcher.close()


def test_streaming_searcher_fails_loudly_when_its_reward_worker_raises(tiny_model, tokenizer):
    """Not a per-sample problem (those are counted): the task's reward call itself breaks. The step
    raises it, so the runtime ends the run with the searcher's traceback (tba.runtime.restarts)."""
    from tba.tasks.arithmetic import ArithmeticTask
    from tba.weights import LocalWeightStore

    class Broken(ArithmeticTask):
        def rewards(self, prompts, completions, completion_ids, stats):
            raise RuntimeError("the grader's connection broke")

    weights = LocalWeightStore()
    weights.publish(tiny_model.state_dict(), 0)
    task = Broken(digits=1, operators="+-", eval_size=10)
    searcher = _streaming_searcher(tiny_model, tokenizer, weights, task=task, refill=1, min_out=1)
    with pytest.raises(RuntimeError, match="grader's connection broke"):
        for _ in range(5):
            searcher.step()
    searcher.close()
