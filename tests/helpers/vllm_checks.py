"""The vLLM backend against the HF one on the same weights, run as its own process by
``tests/test_vllm.py``: an in-process vLLM engine changes the process it runs in (it makes
``torch.set_num_threads`` a no-op and initialises ``torch.distributed``), which the rest of the test
session must not inherit. Prints one JSON object of measurements on its last line.

    python tests/helpers/vllm_checks.py MODEL_DIR
    python tests/helpers/vllm_checks.py --all MODEL_DIR CHAT_MODEL_DIR [TRAIN_ARGS...]   # every check, one process

``TRAIN_ARGS``: ``tba train``'s arguments for a sync run with a vLLM engine that ``--all`` makes
last, then evaluates with ``tba eval`` (:func:`sync_run`), and starts once more with an engine that
cannot start (:func:`engine_cannot_start`).
"""

from __future__ import annotations

import gc
import json
import sys

import torch


def moved(model):
    """A copy of ``model`` with new weights: every parameter moved (tied ones once)."""
    other = type(model)(model.config).eval()
    other.load_state_dict(model.state_dict())
    torch.manual_seed(1)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(torch.randn_like(p), alpha=0.5)
    return other


def outputs(groups) -> list[list[list]]:
    """Each completion of each group as [token ids, finished]: what two generators are compared on."""
    return [[[c.token_ids, c.finished] for c in g] for g in groups]


def main(path: str) -> dict:
    from numerics import model_terms  # tests/helpers/ is this script's first path entry
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tba.generation.base import SamplingParams
    from tba.generation.hf import HFGenerator
    from tba.generation.vllm_backend import VLLMGenerator

    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = {tokenizer.eos_token_id}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    hf = HFGenerator(model, tokenizer.pad_token_id, eos)
    torch.set_num_threads(1)  # as a searcher process sets runtime.searcher_cpus before its engine starts
    engine = VLLMGenerator(path, eos, torch.device("cpu"), torch.float32, seed=0, kv_cache_gb=0.25)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+7=", "3-8=", "45+45=", "9+0=", "60-13=")]
    out: dict = {"threads_after_engine": torch.get_num_threads()}

    greedy = SamplingParams(n=2, max_new_tokens=6, greedy=True)
    mine, theirs = engine.generate(prompts, greedy), hf.generate(prompts, greedy)
    out["greedy"] = {"vllm": outputs(mine), "hf": outputs(theirs)}
    out["greedy_copies"] = [len(g) for g in mine]

    sampled = SamplingParams(n=4, temperature=0.7, top_p=0.9, max_new_tokens=6, logprobs=True)
    groups = engine.generate(prompts, sampled)
    flat, tf = teacher_forced(model, prompts, groups, tokenizer, eos)
    diffs = [abs(a - tf[i, j].item()) for i, c in enumerate(flat) for j, a in enumerate(c.token_logps)]
    out["sampled_group_sizes"] = [len(g) for g in groups]
    out["sampled_logp_max_diff"] = max(diffs)
    # what the comparison's tolerance follows from (tests/helpers/numerics.py): the size of the log-probs
    # and the sums of the model's forward (vLLM's kernels add in their own order)
    out["sampled_logp_scale"] = max(abs(tf[i, j].item()) for i, c in enumerate(flat) for j in range(len(c.token_logps)))
    out["sampled_terms"] = model_terms(model.config, max(len(p) for p in prompts) + 6)
    out["sampled_logp_counts"] = [len(c.token_logps) for c in flat]
    out["sampled_token_counts"] = [len(c.token_ids) for c in flat]
    out["sampled_max_len"] = max(len(c.token_ids) for g in groups for c in g)
    out["sampled_distinct"] = max(len({tuple(c.token_ids) for c in g}) for g in groups)

    at_least = SamplingParams(n=4, temperature=1.0, max_new_tokens=6, min_new_tokens=4)
    out["min_len"] = min(len(c.token_ids) for g in engine.generate(prompts, at_least) for c in g)

    other = moved(model)
    engine.load_weights(other.state_dict(), version=3)
    reloaded = engine.generate(prompts, greedy)
    expected = HFGenerator(other, tokenizer.pad_token_id, eos).generate(prompts, greedy)
    out["reload"] = {"vllm": outputs(reloaded), "hf": outputs(expected), "before": outputs(mine)}
    out["version"] = engine.version
    out["published"] = published_while_training(engine, model, prompts, greedy, tokenizer, eos)
    return out


def published_while_training(engine, model, prompts, greedy, tokenizer, eos) -> dict:
    """The engine's weights from a transport (the sync runtime's: a store behind the background
    publisher, which copies the live weights on its thread) while the optimizer writes into them:
    the engine must generate with what was published, not with what the step wrote after."""
    from tba.generation.hf import HFGenerator
    from tba.weights import BackgroundPublisher, LocalWeightStore

    live = moved(model)  # the trainer's weights at version 4
    published = moved(model)
    store = LocalWeightStore()
    publisher = BackgroundPublisher(store)
    publisher.publish(live.state_dict(), 4, aliases=True)  # the live tensors themselves
    publisher.settle()  # the optimizer waits until no publication reads them, then steps
    torch.manual_seed(2)
    with torch.no_grad():
        for p in live.parameters():
            p.add_(torch.randn_like(p), alpha=0.5)
    publisher.flush()
    version, state = store.fetch(newer_than=3)
    engine.load_weights(state, version)
    publisher.close()
    hf = lambda m: outputs(HFGenerator(m, tokenizer.pad_token_id, eos).generate(prompts, greedy))  # noqa: E731
    return {
        "vllm": outputs(engine.generate(prompts, greedy)),
        "hf_published": hf(published),
        "hf_after_the_step": hf(live),
        "version": engine.version,
    }


def chat(path: str) -> dict:
    """A BPE chat model whose end-of-turn token (``<|im_end|>``) is not its EOS: prompts through
    the chat template, every end id found the way searchers find them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tba.generation.base import SamplingParams
    from tba.generation.hf import HFGenerator
    from tba.generation.vllm_backend import VLLMGenerator
    from tba.models.loading import encode_prompts, eos_ids

    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eos = eos_ids(tokenizer, model)
    end_of_turn = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = VLLMGenerator(path, eos, torch.device("cpu"), torch.float32, seed=0, kv_cache_gb=0.25)
    hf = HFGenerator(model, tokenizer.pad_token_id, eos)
    prompts = encode_prompts(tokenizer, ["What is 3 + 4?", "Natalia sold clips.", "How many clips?"])
    out: dict = {"end_of_turn": end_of_turn, "eos": tokenizer.eos_token_id, "end_ids": sorted(eos)}
    for name, params in (
        ("greedy", SamplingParams(n=1, max_new_tokens=12, greedy=True)),
        ("greedy_min3", SamplingParams(n=1, max_new_tokens=12, min_new_tokens=3, greedy=True)),
    ):
        out[name] = {"vllm": outputs(engine.generate(prompts, params)), "hf": outputs(hf.generate(prompts, params))}
    try:  # (its own failure, not the chat checks')
        out["endpoint"] = endpoint_on(engine, tokenizer, eos)
    except Exception:
        import traceback

        out["endpoint"] = {"error": traceback.format_exc()}
    return out


def endpoint_on(engine, tokenizer, eos) -> dict:
    """An agent's request to the endpoint over this vLLM engine (tba.endpoint), against the
    engine's own answer to the context the endpoint says it generated after."""
    from tba.endpoint.agents import AgentConversations
    from tba.generation.base import SamplingParams
    from tba.tasks.base import Prompt

    seen = {}

    def agent(prompt, client):
        r = client.with_options(max_retries=0).chat.completions.create(
            model="policy", messages=list(prompt.messages), logprobs=True, extra_body={"return_token_ids": True}
        )
        seen["answer"] = (
            r.prompt_token_ids,
            r.choices[0].token_ids,
            [c.logprob for c in r.choices[0].logprobs.content],
        )
        return 1.0

    params = SamplingParams(n=1, max_new_tokens=12, greedy=True, logprobs=True)
    convs = AgentConversations(tokenizer, agent, eos, max_turns=2)
    question = {"role": "user", "content": "What is 3 + 4?"}
    try:
        prompt_ids, groups = convs.rollout(engine, [Prompt("q", question["content"], messages=(question,))], params)
    finally:
        convs.close()
    if "answer" not in seen:
        raise RuntimeError(f"the agent got no answer: {convs.take_new_errors()}")
    context, tokens, logps = seen["answer"]
    direct = engine.generate([context], params)[0][0]
    return {
        "context_is_the_prompt": context == prompt_ids[0],
        "answered": tokens,
        "direct": direct.token_ids,
        "trajectory": groups[0][0].token_ids,
        "logps": logps,
        "direct_logps": direct.token_logps,
        "vocab": len(tokenizer),
    }


def teacher_forced(model, prompts, groups, tokenizer, eos):
    """The non-empty completions of ``groups`` and HF's teacher-forced log-prob of each of their tokens."""
    from tba.models.logprobs import token_logprobs

    flat = [c for g in groups for c in g if c.token_ids]
    with torch.no_grad():
        tf, _ = token_logprobs(
            model,
            [p for p, g in zip(prompts, groups, strict=True) for c in g if c.token_ids],
            [c.token_ids for c in flat],
            tokenizer.pad_token_id,
            eos,
        )
    return flat, tf


def lora(path: str) -> dict:
    """A LoRA policy as searchers run it with vLLM: the adapter the trainer publishes after
    training steps, loaded into the searcher's PEFT copy, merged into the engine's weights; then the
    same adapter run by vLLM's own LoRA (``generation.vllm.lora=adapter``) on an engine of its own."""
    from numerics import model_terms  # tests/helpers/ is this script's first path entry
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tba.config import LoraConfig
    from tba.generation.base import SamplingParams
    from tba.generation.hf import HFGenerator
    from tba.generation.vllm_backend import MergedLoraGenerator, VLLMGenerator
    from tba.models.lora import add_adapter, published_state
    from tba.models.packing import Passes

    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = {tokenizer.eos_token_id}
    settings = LoraConfig(r=8, alpha=16)
    policy = add_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), settings)
    sampler = add_adapter(AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), settings).eval()
    engine = VLLMGenerator(path, eos, torch.device("cpu"), torch.float32, seed=0, kv_cache_gb=0.25)
    generator = MergedLoraGenerator(engine, sampler)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+7=", "3-8=", "45+45=", "9+0=", "60-13=")]
    greedy = SamplingParams(n=1, max_new_tokens=6, greedy=True)
    before = generator.generate(prompts, greedy)

    # Training steps on the adapter: raise the log-likelihood of fixed completions until greedy moves.
    targets = [tokenizer("777")["input_ids"][-3:] + [tokenizer.eos_token_id]] * len(prompts)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=3e-2)
    for _ in range(30):
        loss = -Passes().sequence_logprobs(policy, prompts, targets, tokenizer.pad_token_id, eos).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    state = published_state(policy.eval())
    generator.load_weights(state, version=5)
    after = generator.generate(prompts, greedy)
    expected = HFGenerator(policy, tokenizer.pad_token_id, eos).generate(prompts, greedy)
    out = {
        "published_not_adapter": sorted(k for k in state if "lora_" not in k),
        "lora": {"vllm": outputs(after), "hf": outputs(expected), "before": outputs(before)},
        "lora_version": generator.version,
    }
    del generator, engine
    gc.collect()
    from tba.generation.vllm_backend import AdapterLoraGenerator

    engine = VLLMGenerator(path, eos, torch.device("cpu"), torch.float32, seed=0, kv_cache_gb=0.25, lora_rank=8)
    adapter = AdapterLoraGenerator(engine, sampler)
    adapter.load_weights(published_state(policy.eval()), version=6)
    sampled = SamplingParams(n=4, max_new_tokens=6, temperature=1.0, logprobs=True)
    runs = adapter.generate(prompts, sampled)
    # the engine's log-prob of each token it sampled is the adapted policy's, by teacher forcing in HF
    flat, tf = teacher_forced(policy, prompts, runs, tokenizer, eos)
    pairs = [(a, tf[i, j].item()) for i, c in enumerate(flat) for j, a in enumerate(c.token_logps)]
    config, r = policy.config, settings.r
    h, inner = config.hidden_size, config.intermediate_size
    out.update(
        adapter={"vllm": outputs(adapter.generate(prompts, greedy)), "hf": outputs(expected)},
        adapter_version=adapter.version,
        adapter_logp_max_diff=max(abs(a - b) for a, b in pairs),
        adapter_logp_scale=max(abs(b) for _, b in pairs),
        # the model's sums, and each adapted projection's two more: over its input and over the rank
        adapter_terms=model_terms(config, max(len(p) for p in prompts) + 6)
        + config.num_hidden_layers * (3 * h + inner + 4 * r),
    )
    return out


def stream(path: str) -> dict:
    """Continuous generation on the engine (``tba.generation.stream.VLLMStream``): groups leave in the
    order they finish, weights load with requests in flight or after draining them, and each group
    knows which weight versions produced its tokens."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tba.generation.base import SamplingParams
    from tba.generation.hf import HFGenerator
    from tba.generation.stream import VLLMStream
    from tba.generation.vllm_backend import VLLMGenerator

    tokenizer = AutoTokenizer.from_pretrained(path)
    eos = {tokenizer.eos_token_id}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    engine = VLLMGenerator(path, eos, torch.device("cpu"), torch.float32, seed=0, kv_cache_gb=0.25)
    engine.load_weights(model.state_dict(), version=1)
    prompts = [tokenizer(text)["input_ids"] for text in ("12+7=", "3-8=", "45+45=", "9+0=", "60-13=")]
    out: dict = {}

    # lengths set in advance: the short ones leave first, whatever the order they came in
    sampled = SamplingParams(n=2, temperature=1.0, max_new_tokens=24)
    s = VLLMStream(engine, sampled)
    for key, length in (("a", 20), ("b", 4), ("c", 12)):
        s.submit(key, prompts[0], length=length)
    order, lengths, versions = [], {}, {}
    while s.in_flight():
        for f in s.advance():
            order.append(f.key)
            lengths[f.key] = [len(c.token_ids) for c in f.completions]
            versions[f.key] = (f.oldest_version, f.newest_version)
    out["order"], out["lengths"], out["versions"] = order, lengths, versions
    out["engine_unfinished"] = engine.llm.llm_engine.has_unfinished_requests()

    # in flight: the new weights take over mid-completion, the old tokens stay
    other = moved(model)
    near_greedy = SamplingParams(n=1, temperature=1e-4, max_new_tokens=16)
    s = VLLMStream(engine, near_greedy)
    s.submit("d", prompts[1], length=16)
    for _ in range(5):
        assert s.advance() == []
    s.load_weights(other.state_dict(), version=2, mode="in_flight")
    s.submit("e", prompts[1], length=16)
    done = {}
    while s.in_flight():
        done.update({f.key: f for f in s.advance()})
    greedy = SamplingParams(n=1, max_new_tokens=16, min_new_tokens=16, greedy=True)
    old = HFGenerator(model, tokenizer.pad_token_id, eos).generate([prompts[1]], greedy)[0][0].token_ids
    new = HFGenerator(other, tokenizer.pad_token_id, eos).generate([prompts[1]], greedy)[0][0].token_ids
    d, e = done["d"].completions[0].token_ids, done["e"].completions[0].token_ids
    out["in_flight_versions"] = {k: (f.oldest_version, f.newest_version) for k, f in done.items()}
    out["in_flight"] = {"d": d, "e": e, "old": old, "new": new}

    # drain: the prompt in flight finishes with the old weights first
    s.submit("f", prompts[2], length=8)
    s.advance()
    drained = s.load_weights(model.state_dict(), version=3, mode="drain")
    out["drained"] = [(f.key, f.oldest_version, f.newest_version, len(f.completions[0].token_ids)) for f in drained]
    s.submit("g", prompts[2], length=8)
    s.submit("h", prompts[3], length=8)
    s.advance()
    out["aborted"] = sorted(s.abort())
    out["after_abort"] = {
        "in_flight": s.in_flight(),
        "engine_unfinished": engine.llm.llm_engine.has_unfinished_requests(),
    }
    return out


def tba_command(args: list[str]) -> tuple[int, str]:
    """``tba *args`` through the command line's entry point in this process (in a process of its
    own it would import vLLM again): its exit status and the end of what it wrote to stderr."""
    import contextlib
    import io

    from tba.cli import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        status = main(args)
    return status, err.getvalue()[-5000:]


def run_dir_of(train_args: list[str], name: str | None = None):
    """The run directory that ``tba train *train_args`` writes (``name``: instead of its run.name)."""
    from pathlib import Path

    def value(key: str) -> str:
        (found,) = [a.split("=", 1)[1] for a in train_args if a.startswith(f"--{key}=")]
        return found

    return Path(value("run.output_dir")) / (name or value("run.name"))


def sync_run(train_args: list[str]) -> dict:
    """``tba train *train_args`` (a sync run with the vLLM backend), then ``tba eval`` of its run
    directory (:func:`tba_command`): their exit statuses and what each wrote to stderr."""
    run_dir = run_dir_of(train_args)
    train, train_stderr = tba_command(["train", *train_args])
    evaluated, eval_stderr = tba_command(["eval", str(run_dir)])
    return {"run_dir": str(run_dir), "train": train, "train_stderr": train_stderr, "eval": evaluated,
            "eval_stderr": eval_stderr}  # fmt: skip


def engine_cannot_start(train_args: list[str]) -> dict:
    """``tba train *train_args`` as run ``f`` with an engine that cannot start (no memory for its
    cache) (:func:`tba_command`): its exit status, stderr, and whether the run directory exists."""
    args = [a for a in train_args if not a.startswith("--run.name=")] + ["--run.name=f"]
    status, stderr = tba_command(["train", *args, "--generation.vllm.kv_cache_gb=1e-6"])
    return {"status": status, "stderr": stderr, "run_dir_exists": run_dir_of(train_args, "f").exists()}


def every_check(path: str, chat_path: str, train_args: list[str] | None = None) -> dict:
    """Every check above in this one process, one engine after another (vLLM's import alone takes
    seconds): ``{name: its measurements}``, or ``{name: {"error": traceback}}`` for a check that
    raised, so that the others still report."""
    import traceback

    out = {}
    for name, check, where in (
        ("main", main, path),
        ("stream", stream, path),
        ("lora", lora, path),
        ("chat", chat, chat_path),
        *([("sync_run", sync_run, train_args)] if train_args else []),
        *([("engine_cannot_start", engine_cannot_start, train_args)] if train_args else []),
    ):
        try:
            out[name] = check(where)
        except Exception:
            out[name] = {"error": traceback.format_exc()}
        gc.collect()  # the check's engine, before the next one starts
    return out


if __name__ == "__main__":
    if sys.argv[1] == "--all":
        print(json.dumps(every_check(sys.argv[2], sys.argv[3], sys.argv[4:])))
    elif sys.argv[1] == "--stream":
        print(json.dumps(stream(sys.argv[2])))
    elif sys.argv[1] == "--chat":
        print(json.dumps(chat(sys.argv[2])))
    elif sys.argv[1] == "--lora":
        print(json.dumps(lora(sys.argv[2])))
    else:
        print(json.dumps(main(sys.argv[1])))
