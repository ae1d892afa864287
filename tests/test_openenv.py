"""OpenEnv environments (``task.environment: openenv:<url>``) with the real ``openenv-core``: a
server started here with its own ``create_app`` on 127.0.0.1, for an environment defined here
(two tries at a sum), trained against in both runtimes with one session per conversation; a
server that goes away costs its conversations (counted) and a new one is used again; a URL where
nothing answers is refused in one line."""

from __future__ import annotations

import json
import random
import re
import socket
import threading
import time

import pytest
import uvicorn
from openenv.core.env_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from tests.helpers.sources import THREE_STEPS, trained_three_steps

from tba.config import ConfigError, load_config
from tba.conversations import make_conversations
from tba.demo.index import SHIPPED_DIR
from tba.generation.base import SamplingParams
from tba.runtime.async_loop import run_ray
from tba.runtime.sync_loop import run_sync
from tba.tools import ToolError

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

MODEL = next(SHIPPED_DIR.glob("tiny-tools-*"))  # a tiny chat model


class Reply(Action):
    message: str


class Task(Observation):
    prompt: str = ""


class TwoTries(Environment):
    """A sum to answer, from the prompt it is reset with (or its seed); a wrong answer gets one
    more try. Reward 1 for the right answer, else 0."""

    SUPPORTS_CONCURRENT_SESSIONS = True
    resets = 0  # every session of the server (one per conversation)

    def __init__(self):
        super().__init__()
        self._state = State(step_count=0)

    def reset(self, seed=None, episode_id=None, prompt=None, **kwargs) -> Task:
        TwoTries.resets += 1
        if prompt is not None:
            self.a, self.b = map(int, re.findall(r"\d+", prompt)[:2])
        else:
            rng = random.Random(seed)
            self.a, self.b = rng.randint(1, 9), rng.randint(1, 9)
        self._state = State(step_count=0)
        return Task(prompt=f"{self.a}+{self.b}=")

    def step(self, action: Reply, timeout_s=None, **kwargs) -> Task:
        self._state.step_count += 1
        right = action.message.strip() == str(self.a + self.b)
        if right or self._state.step_count >= 2:
            return Task(done=True, reward=float(right))
        return Task(prompt=f"No. {self.a}+{self.b}=", reward=0.0)

    @property
    def state(self) -> State:
        return self._state


class Server:
    """The environment's server (OpenEnv's create_app under uvicorn) on a thread, on ``port``."""

    def __init__(self, port: int = 0):
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        self.sock, self.port = sock, sock.getsockname()[1]
        app = create_app(TwoTries, Reply, Task, max_concurrent_envs=256)
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off"))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()


@pytest.fixture
def server():
    s = Server()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def sums(tmp_path_factory):
    root = tmp_path_factory.mktemp("sums")
    rows = [{"prompt": f"{a}+{b}=", "answer": a + b} for a in range(1, 10) for b in range(1, 5)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text("def none(completions, **kwargs):\n    return [None] * len(completions)\n")
    return root


def args(sums, server_url, tmp_path, runtime: str, *extra: str) -> list[str]:
    return [
        f"--runtime.type={runtime}",
        f"--model.policy={MODEL}",
        "--task.name=dataset",
        f"--task.path={sums / 'data.jsonl'}",
        f"--task.reward_funcs=[{sums / 'rewards.py'}:none]",
        "--task.answer_column=answer",
        "--task.eval_size=6",
        f"--task.environment=openenv:{server_url}",
        "--task.environment_args={reset_with_prompt: true, observation_field: prompt}",
        "--task.max_turns=2",
        "--generation.max_new_tokens=16",
        *THREE_STEPS,
        f"--run.output_dir={tmp_path}",
        "--run.name=o",
        *extra,
    ]


@pytest.mark.parametrize("runtime", ["sync", "ray"])
def test_an_openenv_environment_trains_with_a_session_per_conversation(sums, server, tmp_path, runtime, request):
    if runtime == "ray":
        request.getfixturevalue("local_ray")  # joined by the run (tests/conftest.py)
    TwoTries.resets = 0
    run = run_sync if runtime == "sync" else run_ray
    run_dir, summary = run(load_config(None, args(sums, server.url, tmp_path, runtime)))
    records, train = trained_three_steps(run_dir, summary)
    last = train[-1]
    assert last["searcher/environment_errors"] == 0
    # a wrong first answer gets its second try
    assert 1 < max(r["searcher/turns_per_conversation"] for r in train) <= 2
    evals = [r for r in records if "eval/problems" in r]  # (a reward where a conversation ended in time)
    assert [r["step"] for r in evals] == [0, 3] and all(r["eval/turns"] >= 1 for r in evals)
    # one server session per conversation: every sampled one and every evaluated one
    assert TwoTries.resets >= last["searcher/completions"] + 2 * 6


def test_a_server_that_goes_away_costs_its_conversations_and_a_new_one_serves_again(sums, server):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tba.generation.hf import HFGenerator
    from tba.tasks.base import Prompt

    cfg = load_config(None, args(sums, server.url, sums, "sync"))
    tok = AutoTokenizer.from_pretrained(MODEL)
    convs = make_conversations(cfg.task, tok, {tok.eos_token_id})
    generator = HFGenerator(AutoModelForCausalLM.from_pretrained(MODEL), tok.pad_token_id, {tok.eos_token_id})
    prompts = [Prompt(f"p{i}", f"{i}+2=") for i in range(1, 4)]
    params = SamplingParams(n=2, max_new_tokens=8)
    try:
        _, before = convs.rollout(generator, prompts, params)
        assert not any(t.failed for g in before for t in g) and convs.take_counts().environment_errors == 0
        port = server.port
        server.stop()  # gone: every conversation of the next batch fails to open, counted
        _, gone = convs.rollout(generator, prompts, params)
        assert all(t.failed for g in gone for t in g) and convs.take_counts().environment_errors == 6
        assert "an environment's reset raised" in "\n".join(convs.take_new_errors())
        again = Server(port)  # the server is back where it was: conversations open there again
        try:
            _, after = convs.rollout(generator, prompts, params)
        finally:
            again.stop()
        assert not any(t.failed for g in after for t in g) and convs.take_counts().environment_errors == 0
        assert all(t.reward in (0.0, 1.0) for g in after for t in g if t.finished)
    finally:
        convs.close()


def test_a_url_where_no_server_answers_is_refused_in_one_line(sums, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed again: nothing listens there)
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(ToolError, match=rf"openenv:{url}: no OpenEnv server answers there .*start the environment"):
        run_sync(load_config(None, args(sums, url, tmp_path, "sync")))
    assert not (tmp_path / "o").exists()
    with pytest.raises((ToolError, ConfigError), match="give the server's base URL"):
        run_sync(load_config(None, args(sums, "127.0.0.1:1", tmp_path, "sync")))


def test_without_openenv_installed_the_line_names_the_extra(sums, tmp_path, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "openenv.core", None)  # what an absent package looks like to import
    with pytest.raises(ToolError, match=r"needs the openenv-core package .*pip install 'tba\[openenv\]'"):
        run_sync(load_config(None, args(sums, "http://127.0.0.1:1", tmp_path, "sync")))
