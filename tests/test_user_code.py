"""User code named in a config: one loader for reward functions, tools and environments, and one
bridge that runs their ``async`` forms on one long-lived event loop."""

from __future__ import annotations

import asyncio
import textwrap

import pytest

from tba.environments import load_environment
from tba.rewards import RewardFunctionError, RewardStats, compute_rewards, load_reward_functions
from tba.tasks.base import Prompt
from tba.tools import ToolCall, ToolError, load_tools, run_tool
from tba.user_code import call

USER_FILE = '''
import asyncio

LOOPS = []


class Client:
    """Binds to the loop it first ran on, as httpx and aiohttp clients do."""

    def __init__(self):
        self.loop = None

    async def get(self, x):
        loop = asyncio.get_running_loop()
        if self.loop is None:
            self.loop = loop
        if loop is not self.loop:
            raise RuntimeError("client used on another event loop")
        LOOPS.append(id(loop))
        await asyncio.sleep(0)
        return x


CLIENT = Client()


async def score(prompts, completions, completion_ids, **kwargs):
    return [float(await CLIENT.get(len(c))) for c in completions]


async def double(x: int) -> int:
    """Twice x.

    Args:
        x: a number
    """
    return await CLIENT.get(2 * x)


class Game:
    def __init__(self, goal=1):
        self.goal = goal

    async def reset(self, prompt):
        return [{"role": "user", "content": str(await CLIENT.get(prompt.text))}]

    async def step(self, messages):
        return [], float(await CLIENT.get(self.goal)), True
'''


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "my_code.py"
    path.write_text(textwrap.dedent(USER_FILE))
    return path


def test_rewards_tools_and_environments_load_from_one_file_and_share_one_event_loop(user_file):
    base = user_file.parent
    (reward,) = load_reward_functions(["my_code.py:score"], base_dir=base)
    (tool,) = load_tools(["my_code.py:double"], base=base)
    env = load_environment("my_code.py:Game", base=base, goal=3)
    module = type(env).__module__
    assert reward.fn.__module__ == tool.__module__ == module  # the file is loaded once, whatever names it

    for _ in range(2):  # a client bound to its first loop keeps working on later calls
        assert compute_rewards([reward], ["p", "p"], ["ab", "abc"], [[1], [2]], {}, RewardStats()) == [2.0, 3.0]
        assert run_tool(ToolCall("double", {"x": 4}), [tool], timeout=5).content == "8"
        assert call(env.reset, Prompt(id="q", text="hi")) == [{"role": "user", "content": "hi"}]
        assert call(env.step, []) == ([], 3.0, True)

    loops = __import__("sys").modules[module].LOOPS
    assert len(loops) == 10 and len(set(loops)) == 1


def test_a_bad_spec_is_said_the_same_way_for_every_kind_of_user_code(user_file):
    base = user_file.parent
    for load, what, error in [
        (lambda s: load_reward_functions([s], base_dir=base), "reward function", RewardFunctionError),
        (lambda s: load_tools([s], base=base), "task.tools", ToolError),
        (lambda s: load_environment(s, base=base), "task.environment", ToolError),
    ]:
        with pytest.raises(error, match=f"{what} 'my_code.py:nope': my_code.py has no attribute 'nope'; it defines: "):
            load("my_code.py:nope")
        with pytest.raises(error, match=f"{what} 'missing.py:f': file .*missing.py' does not exist"):
            load("missing.py:f")
        with pytest.raises(error, match=f"{what} 'my_code' is malformed; write 'pkg.module:name'"):
            load("my_code")
        with pytest.raises(error, match=f"{what} 'no_such_pkg:f': cannot import module 'no_such_pkg'"):
            load("no_such_pkg:f")


def test_the_bridge_runs_coroutines_from_a_thread_whose_loop_is_running():
    async def inner():
        await asyncio.sleep(0)
        return 7

    async def outer():  # user code called from inside an event loop (a notebook, an async server)
        return call(inner)

    assert asyncio.run(outer()) == 7
