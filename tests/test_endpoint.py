"""The OpenAI-compatible endpoint (tba.endpoint): driven by the ``openai`` client itself, on a real
(tiny, random) Qwen2 chat model and HF generation. What an answer says it generated is what the
engine generated, and a rollout's trajectory is exactly those tokens, with the agent's messages
between replies rendered by the chat template and marked 0."""

from __future__ import annotations

import sys

import openai
import pytest
import torch
from tests.helpers.numerics import assert_reordered_close, model_terms, padded_positions
from tests.helpers.tiny_bpe import EOS, IM_END, build_bpe_chat_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tba.endpoint.agents import AgentConversations
from tba.environments import environment_text
from tba.errors import MissingDependency
from tba.generation.base import SamplingParams
from tba.generation.hf import HFGenerator
from tba.models.logprobs import token_logprobs
from tba.tasks.base import Prompt

VERSION = 3
PARAMS = SamplingParams(n=2, max_new_tokens=12, logprobs=True)


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    path = build_bpe_chat_model(tmp_path_factory.mktemp("chat"))
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    eos = {tok.convert_tokens_to_ids(IM_END), tok.convert_tokens_to_ids(EOS)}
    # a head that ends a turn about one token in four (a random model almost never does): replies
    # that finish, so conversations go on
    head = torch.nn.Linear(model.config.hidden_size, model.config.vocab_size, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.zero_()
        head.bias[tok.convert_tokens_to_ids(IM_END)] = 5.0
    model.lm_head = head
    generator = HFGenerator(model, tok.convert_tokens_to_ids(EOS), eos)
    generator.version = VERSION
    return tok, model, generator, eos


def prompts(k: int) -> list[Prompt]:
    return [
        Prompt(f"p{i}", f"What is {i} + 4?", messages=({"role": "user", "content": f"What is {i} + 4?"},))
        for i in range(k)
    ]


def conversations(engine, agent, max_turns: int = 4, **kwargs) -> AgentConversations:
    tok, _, _, eos = engine
    return AgentConversations(tok, agent, eos, max_turns, **kwargs)


def test_a_rollout_is_the_tokens_the_endpoint_answered_with_and_their_log_probs_the_engines(engine):
    tok, model, generator, eos = engine
    seen: dict[str, list] = {}

    def agent(prompt, client):  # two replies, a user message between them
        messages = [dict(m) for m in prompt.messages]
        answers = []
        for follow_up in ("Say it again.", None):
            r = client.chat.completions.create(
                model="policy", messages=messages, logprobs=True, extra_body={"return_token_ids": True}
            )
            answers.append(r)
            messages.append(r.choices[0].message.model_dump(exclude_none=True))
            if follow_up is None or r.choices[0].finish_reason != "stop":
                break
            messages.append({"role": "user", "content": follow_up})
        seen.setdefault(prompt.id, []).append((answers, messages))
        return 0.25

    convs = conversations(engine, agent)
    torch.manual_seed(0)
    try:
        prompt_ids, groups = convs.rollout(generator, prompts(2), PARAMS)
    finally:
        convs.close()
    assert any(t.turns == 2 for g in groups for t in g), "a conversation with a message between two replies"
    assert convs.take_counts().environment_errors == 0 and convs.take_new_errors() == []
    rows, completions, answered = [], [], []
    for prompt, ids, group in zip(prompts(2), prompt_ids, groups, strict=True):
        opening = tok.apply_chat_template([dict(m) for m in prompt.messages], add_generation_prompt=True)
        assert ids == list(opening["input_ids"] if not isinstance(opening, list) else opening)
        assert len(seen[prompt.id]) == len(group)
        for traj in group:  # (the agents ran side by side: each trajectory found by its first reply)
            answers, messages = next(
                (a, m)
                for a, m in seen[prompt.id]
                if traj.token_ids[: len(a[0].choices[0].token_ids)] == a[0].choices[0].token_ids
            )
            assert not traj.failed and traj.reward == 0.25
            first = answers[0]
            assert first.prompt_token_ids == ids and first.weights_version == VERSION
            tokens, mask, logps = [], [], []
            for k, r in enumerate(answers):
                choice = r.choices[0]
                if k:  # the user's message: the chat template's text after the reply's end-of-turn token
                    so_far = ids + tokens
                    assert r.prompt_token_ids[: len(so_far)] == so_far
                    added = r.prompt_token_ids[len(so_far) :]
                    before = [*prompt.messages, {"role": "assistant", "content": traj.messages[1]["content"]}]
                    text = environment_text(before, [messages[2]], tok, IM_END)
                    assert added == tok.encode(text, add_special_tokens=False)
                    tokens, mask, logps = tokens + added, mask + [0] * len(added), logps + [0.0] * len(added)
                returned = [c.logprob for c in choice.logprobs.content]
                assert len(returned) == len(choice.token_ids) and all(lp <= 0 for lp in returned)
                assert tok.decode([t for t in choice.token_ids if t not in eos], skip_special_tokens=True) == (
                    choice.message.content or ""
                )
                tokens, mask, logps = tokens + choice.token_ids, mask + [1] * len(choice.token_ids), logps + returned
                rows.append(r.prompt_token_ids)
                completions.append(choice.token_ids)
                answered.append(returned)
            assert traj.token_ids == tokens and traj.action_mask == mask and traj.token_logps == logps
            assert traj.turns == len(answers) and traj.finished == (answers[-1].choices[0].finish_reason == "stop")
    # the log-probs an answer carries are the policy's own at temperature 1 (the trainer's pass)
    expected, valid = token_logprobs(model, rows, completions, tok.convert_tokens_to_ids(EOS), eos)
    for i, lps in enumerate(answered):
        assert_reordered_close(
            torch.tensor(lps),
            expected[i, : len(lps)],
            terms=model_terms(model.config, padded_positions(rows, completions)),
        )
        assert valid[i, : len(lps)].all()


def test_greedy_answers_are_the_generators_own_and_say_their_weights_version(engine):
    tok, _, generator, eos = engine

    def agent(prompt, client):
        models = client.models.list()
        assert models.data[0].model_dump()["weights_version"] == VERSION
        chat = client.chat.completions.create(
            model="policy", messages=list(prompt.messages), max_tokens=5, extra_body={"return_token_ids": True}
        )
        text = client.completions.create(
            model="policy", prompt="Natalia sold", max_tokens=5, logprobs=1, extra_body={"return_token_ids": True}
        )
        return {"chat": chat, "text": text}

    # outside a rollout (the endpoint's plain base URL), greedy: the generator's own answer, token for token
    convs = conversations(engine, agent)
    try:
        endpoint = convs.start()
        convs.generator, convs.params, convs.queue.generator = generator, PARAMS, generator
        client = openai.OpenAI(base_url=endpoint.url, api_key="none")
        messages = [{"role": "user", "content": "What is 3 + 4?"}]
        chat = client.chat.completions.create(
            model="p", messages=messages, temperature=0, max_tokens=5, extra_body={"return_token_ids": True}
        )
        ids = chat.prompt_token_ids
        direct = generator.generate([ids], SamplingParams(max_new_tokens=5, greedy=True))[0][0]
        assert chat.choices[0].token_ids == direct.token_ids
        assert chat.choices[0].finish_reason == ("stop" if direct.finished else "length")
        text = client.completions.create(
            model="p",
            prompt="Natalia sold",
            temperature=0,
            max_tokens=5,
            logprobs=1,
            extra_body={"return_token_ids": True},
        )
        choice = text.choices[0]
        assert choice.prompt_token_ids == tok("Natalia sold")["input_ids"]
        direct = generator.generate([choice.prompt_token_ids], SamplingParams(max_new_tokens=5, greedy=True))[0][0]
        assert choice.token_ids == direct.token_ids
        assert choice.text == tok.decode([t for t in direct.token_ids if t not in eos], skip_special_tokens=True)
        assert (
            len(choice.logprobs.token_logprobs) == len(choice.token_ids)
            and text.model_dump()["weights_version"] == VERSION
        )
        # each token's text, and where it starts in the concatenation of those texts
        pieces = [tok.decode([t]) for t in choice.token_ids]
        assert choice.logprobs.tokens == pieces
        assert choice.logprobs.text_offset == [len("".join(pieces[:k])) for k in range(len(pieces))]
    finally:
        convs.close()


def test_an_async_agent_on_the_completions_api_extends_its_own_text(engine):
    tok, _, generator, _ = engine

    async def agent(prompt, client):  # an async agent gets an AsyncOpenAI client
        first = await client.completions.create(
            model="p", prompt=prompt.text, max_tokens=3, extra_body={"return_token_ids": True}
        )
        text = prompt.text + first.choices[0].text + " Then"
        second = await client.completions.create(
            model="p", prompt=text, max_tokens=3, extra_body={"return_token_ids": True}
        )
        return len(first.choices[0].token_ids + second.choices[0].token_ids) / 10

    convs = conversations(engine, agent)
    try:
        prompt_ids, groups = convs.rollout(generator, prompts(1), PARAMS)
    finally:
        convs.close()
    traj = groups[0][0]
    assert prompt_ids[0] == tok(prompts(1)[0].text)["input_ids"] and not traj.failed and traj.turns == 2
    then = tok.encode(" Then", add_special_tokens=False)
    first = traj.action_mask.index(0)
    assert traj.token_ids[first : first + len(then)] == then and traj.action_mask.count(0) == len(then)
    assert traj.reward == traj.action_mask.count(1) / 10


def test_agents_that_break_the_rules_lose_their_rollouts_counted_never_the_batch(engine):
    tok, _, generator, _ = engine

    def agent(prompt, client):
        i = int(prompt.id[1:])
        messages = list(prompt.messages)
        r = client.chat.completions.create(model="p", messages=messages, max_tokens=2 if i == 3 else None)
        messages.append({"role": "assistant", "content": r.choices[0].message.content})
        if i == 0:  # rewrites the question it asked (after a reply that ended its turn)
            assert r.choices[0].finish_reason == "stop"
            messages[0] = {"role": "user", "content": "Something else?"}
            messages.append({"role": "user", "content": "And?"})
            client.chat.completions.create(model="p", messages=messages)
        if i == 1:
            return "good"  # not a reward
        if i == 2:
            raise RuntimeError("the agent's own bug")
        if i == 3:  # asks on until the rollout ends: max_turns=2 replies, or a reply cut at max_tokens
            while True:
                messages.append({"role": "user", "content": "More."})
                r = client.chat.completions.create(model="p", messages=messages, max_tokens=2)
                messages.append({"role": "assistant", "content": r.choices[0].message.content})
        return 1.0

    convs = conversations(engine, agent, max_turns=2)
    try:
        torch.manual_seed(0)
        _, groups = convs.rollout(generator, prompts(5), SamplingParams(n=1, max_new_tokens=12))
        with pytest.raises(openai.NotFoundError, match="no open rollout 'nope'"):
            openai.OpenAI(base_url=convs.endpoint.rollout_url("nope"), api_key="x").chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hi"}]
            )
        with pytest.raises(openai.BadRequestError, match="stop sequences are not served"):
            openai.OpenAI(base_url=convs.endpoint.url, api_key="x").chat.completions.create(
                model="p", messages=[{"role": "user", "content": "hi"}], stop=["."]
            )
    finally:
        convs.close()
    failed = [g[0].failed for g in groups]
    assert failed == [True, True, True, False, False]
    ended = groups[3][0]  # ran out of its budget: kept, unfinished
    assert not ended.finished and 1 <= ended.turns <= 2 and groups[4][0].reward == 1.0
    assert convs.take_counts().environment_errors == 3
    errors = "\n".join(convs.take_new_errors())
    assert "message 0 differs from the conversation so far" in errors
    assert "returned 'good'" in errors and "RuntimeError: the agent's own bug" in errors


@pytest.mark.parametrize("module", ["fastapi", "uvicorn", "openai"])
def test_an_agent_without_the_extra_installed_is_refused_with_the_install_line(engine, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # what an absent package looks like to import
    with pytest.raises(
        MissingDependency, match=rf"task.agent: .* needs {module}, which is not installed; pip install 'tba\[agents\]'"
    ):
        conversations(engine, lambda prompt, client: None)


def test_a_request_whose_generation_failed_leaves_its_rollout_as_it_was_and_the_retry_goes_on(engine):
    """The engine raises once (the client sees HTTP 500 and, as openai's client does, retries): the
    retry is served as the first try would have been, and the trajectory has one reply."""
    tok, _, generator, eos = engine

    class FailsOnce:
        version = VERSION

        def __init__(self):
            self.failed = False

        def generate(self, prompts, params):
            if not self.failed:
                self.failed = True
                raise RuntimeError("the engine is out of memory")
            return generator.generate(prompts, params)

    answers = []

    def agent(prompt, client):
        messages = [dict(m) for m in prompt.messages]
        answers.append(
            client.chat.completions.create(model="p", messages=messages, extra_body={"return_token_ids": True})
        )
        messages += [answers[0].choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And?"}]
        if answers[0].choices[0].finish_reason == "stop":
            answers.append(
                client.chat.completions.create(model="p", messages=messages, extra_body={"return_token_ids": True})
            )
        return 0.5

    convs = conversations(engine, agent)
    flaky = FailsOnce()
    torch.manual_seed(0)
    try:
        prompt_ids, groups = convs.rollout(flaky, prompts(1), SamplingParams(n=1, max_new_tokens=12))
    finally:
        convs.close()
    (traj,) = groups[0]
    assert flaky.failed and not traj.failed and traj.turns == len(answers)
    assert answers[0].prompt_token_ids == prompt_ids[0]
    last = answers[-1]
    assert traj.token_ids == last.prompt_token_ids[len(prompt_ids[0]) :] + last.choices[0].token_ids


def test_a_request_sent_again_gets_the_same_answer_and_the_rollout_one_reply(engine):
    """A client that did not get its answer (a dropped connection) sends the request again: the
    answer it missed, not a second reply, and not a refusal."""
    _, _, generator, _ = engine
    answers = []

    def agent(prompt, client):
        for _ in range(2):
            answers.append(client.chat.completions.create(model="p", messages=list(prompt.messages)))
        return 1.0

    convs = conversations(engine, agent)
    try:
        _, groups = convs.rollout(generator, prompts(1), SamplingParams(n=1, max_new_tokens=6))
    finally:
        convs.close()
    (traj,) = groups[0]
    assert not traj.failed and traj.turns == 1 and answers[0].id == answers[1].id
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content
