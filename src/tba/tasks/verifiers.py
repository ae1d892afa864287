"""Environments of the ``verifiers`` library (``task.name: verifiers``), trained as they are.

The environment's dataset gives the prompts (its evaluation dataset, or ``eval_size`` held-out
rows, the held-out ones); each rollout is the environment's own ``run_rollout`` against the
searcher's OpenAI-compatible endpoint (:mod:`tba.endpoint`), one client per rollout, and its
rubric's reward is the rollout's reward. tba trains on the tokens the endpoint generated, so the
environment's own message handling never changes what is trained on.

A rubric function that raises costs its rollout only: verifiers would score it 0 and go on, which
would train on a reward nobody computed; here the rollout is dropped, counted in
``searcher/environment_errors`` and its traceback written to ``errors.log``. A rollout the
environment ended with an error (``state["error"]``) is dropped the same way.

Written against the classic API (``import verifiers as vf``: ``vf.SingleTurnEnv``,
``vf.ToolEnv``, ``vf.Rubric``, ``load_environment``), which the Environments Hub's environments
use and verifiers 0.3 keeps (``tba[verifiers]`` pins ``verifiers>=0.3.1,<0.4``; 0.4 keeps only its
new ``verifiers.v1`` API).
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import json
from typing import Any

from tba.config import ConfigError
from tba.tasks.base import Prompt
from tba.tasks.data import DatasetLoadError, DataTask, held_out, prompt_hash
from tba.user_code import describe_exception, load_object

INSTALL = "pip install 'tba[verifiers]'"
MODEL = "policy"  # the model name the environment's requests carry (the endpoint serves one)

_RUBRIC_ERRORS: contextvars.ContextVar[list | None] = contextvars.ContextVar("tba_rubric_errors", default=None)
_ENVIRONMENTS: dict[tuple[str, str], Any] = {}


def import_verifiers():
    """``verifiers`` (its classic API), or a :class:`ConfigError` saying how to install it."""
    try:
        import verifiers as vf

        vf.Environment  # noqa: B018 (loads the classic API, and with it its dependencies)
    except ImportError as err:
        raise ConfigError(f"task.name=verifiers needs the verifiers package ({err}); install it: {INSTALL}") from None
    return vf


def load_vf_environment(spec: str, args: dict) -> Any:
    """The environment ``spec`` names, built with ``args`` once per process; its rubric's functions
    count their failures (:func:`_counted`)."""
    key = (spec, json.dumps(args, sort_keys=True, default=str))
    if key in _ENVIRONMENTS:
        return _ENVIRONMENTS[key]
    vf = import_verifiers()
    if ":" in spec:
        env = load_object(spec, "task.env", ConfigError)(**args)
    else:
        import importlib.util

        from verifiers.utils.env_utils import env_module_name

        if importlib.util.find_spec(env_module_name(spec)) is None:
            raise ConfigError(
                f"task.env: no verifiers environment {spec!r} is installed (no module {env_module_name(spec)!r}); "
                "install it (prime env install <owner>/<name>, or pip install its package), or give "
                "module:function / path/to/file.py:function returning an environment"
            )
        try:
            env = vf.load_environment(spec, **args)
        except TypeError as err:
            raise ConfigError(f"task.env_args {args} are refused by {spec}'s load_environment: {err}") from None
    if not isinstance(env, vf.Environment):
        raise ConfigError(f"task.env {spec!r} gave {type(env).__name__}, not a verifiers Environment")
    for rubric in _rubrics(env.rubric):
        rubric.funcs = [_counted(f) for f in rubric.funcs]
    _ENVIRONMENTS[key] = env
    return env


def _rubrics(rubric) -> list:
    return [rubric, *(r for sub in getattr(rubric, "rubrics", []) for r in _rubrics(sub))]


def _counted(func):
    """``func``, which also notes its exception for the rollout being scored (verifiers then scores
    it 0; :func:`verifiers_agent` drops the rollout instead)."""
    if getattr(func, "_tba_counted", False):
        return func

    @functools.wraps(func)  # (verifiers reads the signature through __wrapped__ to pass arguments)
    async def wrapper(*args, **kwargs):
        try:
            out = func(*args, **kwargs)
            return await out if inspect.isawaitable(out) else out
        except Exception as e:
            errors = _RUBRIC_ERRORS.get()
            if errors is not None:
                errors.append((getattr(func, "__name__", "reward function"), e))
            raise

    wrapper._tba_counted = True
    return wrapper


class RubricError(RuntimeError):
    """A rubric function raised while scoring a rollout."""


def verifiers_agent(env):
    """The agent (:mod:`tba.endpoint.agents`) that runs ``env``'s rollout of a prompt through the
    endpoint's client: its reward, and the rubric's metrics."""
    from verifiers.clients import OpenAIChatCompletionsClient, OpenAICompletionsClient

    completion = getattr(env, "message_type", "chat") == "completion"
    wrap = OpenAICompletionsClient if completion else OpenAIChatCompletionsClient

    async def agent(prompt: Prompt, client) -> dict:
        errors: list = []
        token = _RUBRIC_ERRORS.set(errors)
        try:
            out = await env.run_rollout(dict(prompt.columns), wrap(client), MODEL, {})
        finally:
            _RUBRIC_ERRORS.reset(token)
        if errors:
            name, err = errors[0]
            raise RubricError(f"rubric function {name} raised: {describe_exception(err)}") from err
        if out.get("error"):
            raise RuntimeError(f"the environment ended the rollout with an error: {out['error']}")
        return {"reward": out["reward"], "metrics": out.get("metrics") or {}}

    return agent


class VerifiersTask(DataTask):
    name = "verifiers"
    eval_metric = "reward"

    def __init__(self, cfg, tokenizer=None, chat_template: bool | None = None, log=print, base_dir=None):
        self.env = load_vf_environment(cfg.env, cfg.env_args)
        super().__init__(cfg, tokenizer, chat_template, log)

    @property
    def source(self) -> str:
        return f"verifiers environment {self.cfg.env}"

    def load_columns(self) -> tuple[dict[str, list], list[int], dict[str, list], list[int]]:
        train = self.env.get_dataset().to_dict()
        if self.cfg.max_rows is not None:
            train = {k: v[: self.cfg.max_rows] for k, v in train.items()}
        n = len(train["prompt"])
        if getattr(self.env, "eval_dataset", None) is not None:
            held = self.env.get_eval_dataset().to_dict()
            return train, list(range(n)), held, list(range(len(held["prompt"])))
        if self.cfg.eval_size >= n:
            raise DatasetLoadError(
                f"task.eval_size {self.cfg.eval_size} holds out every row of {self.source} ({n} rows) and it has no "
                "evaluation dataset of its own; lower task.eval_size"
            )
        return train, *held_out(n, self.cfg.eval_size, self.cfg.seed, train)

    def prompt_value(self, columns: dict[str, list], i: int) -> Any:
        value = columns["prompt"][i]
        if isinstance(value, list):  # (Arrow gives every message every key; the unset ones are None)
            return [{k: v for k, v in m.items() if v is not None} for m in value]
        return value

    def prompt_id(self, columns: dict[str, list], i: int) -> str:
        if self.cfg.id_column:
            return str(columns[self.cfg.id_column][i])
        return prompt_hash(self.prompt_value(columns, i))

    def answer_of(self, row: dict[str, Any]) -> str | None:
        answer = row.get("answer")
        return None if answer in (None, "") else str(answer)

    def reward_functions(self) -> list:
        """None: a rollout's reward is its rubric's (an unfinished one gets
        ``generation.unfinished_reward`` if set, else it is dropped unscored)."""
        from tba.rewards import make_reward_fn

        return [make_reward_fn("rubric", lambda completions, **_: [None] * len(completions))]

    def describe(self) -> str:
        return f"{super().describe()}; {type(self.env).__name__} from {self.cfg.env}"
