"""User reward functions: loading by spec, the dry run's messages, and safe batched calls during a run."""

from __future__ import annotations

import asyncio
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from tba.rewards import (
    RewardFunctionError,
    RewardStats,
    check_reward_functions,
    compute_rewards,
    load_reward_functions,
    make_reward_fn,
)

PROMPTS = ["1+1=", "2+2="]
COMPLETIONS = ["2", "5"]
IDS = [[50], [53]]
COLUMNS = {"answer": ["2", "4"], "level": [1, 2]}


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


def run(fns, completions=COMPLETIONS, columns=COLUMNS, prompts=None, stats=None):
    n = len(completions)
    prompts = prompts if prompts is not None else [f"p{i}" for i in range(n)]
    stats = stats if stats is not None else RewardStats()
    return compute_rewards(fns, prompts, completions, [[i] for i in range(n)], columns, stats), stats


def check(fns, columns=COLUMNS):
    check_reward_functions(fns, PROMPTS, COMPLETIONS, IDS, columns)


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A uniquely named, importable package; a module written into it is loaded as ``<name>.<module>:fn``."""
    name = f"rewpkg_{uuid.uuid4().hex[:8]}"
    write(tmp_path / name / "__init__.py", "")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, tmp_path / name
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        del sys.modules[key]


def load_source(tmp_path, source: str, fn: str = "f", **options):
    path = write(tmp_path / f"r_{uuid.uuid4().hex[:8]}.py", source)
    return load_reward_functions([f"{path}:{fn}"], **options)


# ---------------------------------------------------------------------------------------------
# Loading and calling


def test_package_form_gets_standard_arguments_and_columns_as_lists(package) -> None:
    name, directory = package
    write(
        directory / "scoring.py",
        """
        CALLS = []

        def exact(prompts, completions, completion_ids, **kwargs):
            CALLS.append((prompts, completion_ids, kwargs))
            return [float(c == a) for c, a in zip(completions, kwargs["answer"])]
        """,
    )
    fns = load_reward_functions([f"{name}.scoring:exact"])
    assert [(f.name, f.spec, f.weight) for f in fns] == [("exact", f"{name}.scoring:exact", 1.0)]
    check(fns)
    rewards, stats = run(fns)
    assert rewards == [1.0, 0.0]
    module = sys.modules[f"{name}.scoring"]
    assert module.CALLS[-1] == (["p0", "p1"], [[0], [1]], {"answer": ["2", "4"], "level": [1, 2]})
    assert stats.metrics() == {
        "searcher/reward_errors": 0.0,
        "searcher/reward_non_finite": 0.0,
        "searcher/no_reward": 0.0,
        "reward/exact_mean": 0.5,
    }


def test_file_form_relative_to_base_dir_and_to_the_current_directory(tmp_path, monkeypatch) -> None:
    write(tmp_path / "rewards" / "mine.py", "def f(completions, **_):\n    return [len(c) for c in completions]\n")
    fns = load_reward_functions(["rewards/mine.py:f"], base_dir=tmp_path)
    assert run(fns, ["ab", "abc"])[0] == [2.0, 3.0]
    monkeypatch.chdir(tmp_path / "rewards")
    assert run(load_reward_functions(["mine.py:f"]), ["a"], columns={})[0] == [1.0]


def test_package_in_base_dir_is_found_without_being_on_sys_path(tmp_path, monkeypatch) -> None:
    name = f"rewpkg_{uuid.uuid4().hex[:8]}"
    write(tmp_path / name / "__init__.py", "")
    write(tmp_path / name / "scoring.py", "def f(completions):\n    return [0.5] * len(completions)\n")
    monkeypatch.setattr(sys, "path", list(sys.path))  # the loader adds base_dir; undo it after the test
    try:
        fns = load_reward_functions([f"{name}.scoring:f"], base_dir=tmp_path)
        assert run(fns)[0] == [0.5, 0.5]
        assert sys.path[0] == str(tmp_path)
    finally:
        for key in [k for k in sys.modules if k.startswith(name)]:
            del sys.modules[key]


def test_same_file_name_in_two_directories_and_same_function_name_do_not_clash(tmp_path) -> None:
    write(tmp_path / "a" / "rewards.py", "def f(completions):\n    return [1.0] * len(completions)\n")
    write(tmp_path / "b" / "rewards.py", "def f(completions):\n    return [10.0] * len(completions)\n")
    fns = load_reward_functions(["a/rewards.py:f", "b/rewards.py:f"], base_dir=tmp_path)
    assert [f.name for f in fns] == ["f", "f_2"]
    rewards, stats = run(fns)
    assert rewards == [11.0, 11.0]
    assert stats.metrics()["reward/f_mean"] == 1.0 and stats.metrics()["reward/f_2_mean"] == 10.0


def test_function_naming_only_some_columns_gets_only_those(tmp_path) -> None:
    fns = load_source(
        tmp_path,
        """
        def f(completions, answer):
            return [float(c == a) for c, a in zip(completions, answer)]
        """,
    )
    check(fns)
    assert run(fns)[0] == [1.0, 0.0]


def test_async_function_also_from_inside_a_running_event_loop(tmp_path) -> None:
    fns = load_source(
        tmp_path,
        """
        import asyncio

        async def f(completions, answer, **_):
            await asyncio.sleep(0)
            return [float(c == a) for c, a in zip(completions, answer)]
        """,
    )
    check(fns)
    assert run(fns)[0] == [1.0, 0.0]

    async def inside_a_loop():
        return run(fns)[0]

    assert asyncio.run(inside_a_loop()) == [1.0, 0.0]


def test_weights_and_kwargs_as_one_dict_or_one_per_function(tmp_path) -> None:
    path = write(
        tmp_path / "scaled.py",
        """
        def scaled(completions, scale=1.0):
            return [scale] * len(completions)

        def flat(completions, **kwargs):
            return [kwargs.get("scale", 0.0) + 1.0] * len(completions)
        """,
    )
    specs = [f"{path}:scaled", f"{path}:flat"]
    fns = load_reward_functions(specs, weights=[2.0, 0.5], kwargs=[{"scale": 1.5}, {"scale": 4.0}])
    assert [f.kwargs for f in fns] == [{"scale": 1.5}, {"scale": 4.0}]
    check(fns)
    assert run(fns)[0] == [2.0 * 1.5 + 0.5 * 5.0] * 2
    fns = load_reward_functions(specs, weights=[1.0, -1.0], kwargs={"scale": 3.0})
    assert run(fns)[0] == [3.0 - 4.0] * 2


def test_none_means_no_opinion_and_all_none_drops_the_sample(tmp_path) -> None:
    path = write(
        tmp_path / "opinions.py",
        """
        def f(completions):
            return [1.0, None, None]

        def g(completions):
            return [None, 2.0, None]
        """,
    )
    fns = load_reward_functions([f"{path}:f", f"{path}:g"], weights=[1.0, 3.0])
    rewards, stats = run(fns, ["a", "b", "c"], columns={})
    assert rewards == [1.0, 6.0, None]
    assert (stats.errors, stats.no_reward) == (0, 1)
    assert stats.metrics()["searcher/no_reward"] == 1.0


def test_bools_numpy_scalars_and_arrays_are_accepted(tmp_path) -> None:
    path = write(
        tmp_path / "numeric.py",
        """
        import numpy as np

        def f(completions):
            return [True, np.float32(0.5), np.bool_(False), np.int64(2)]

        def g(completions):
            return np.array([1.0, 2.0, 3.0, 4.0])
        """,
    )
    fns = load_reward_functions([f"{path}:f", f"{path}:g"])
    rewards, stats = run(fns, ["a", "b", "c", "d"], columns={})
    assert rewards == [2.0, 2.5, 3.0, 6.0] and stats.errors == 0


def test_built_in_function_via_make_reward_fn() -> None:
    fn = make_reward_fn("exact_match", lambda prompts, completions, completion_ids, answer, **_: [1.0, 0.0], 2.0)
    check([fn])
    assert run([fn])[0] == [2.0, 0.0]


# ---------------------------------------------------------------------------------------------
# verl style


VERL_SOURCE = """
    CALLS = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        CALLS.append((data_source, solution_str, ground_truth, extra_info))
        return float(solution_str.strip() == ground_truth) + bonus

    def as_dict(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        return {"score": float(solution_str == ground_truth), "acc": True}

    async def in_async(data_source, solution_str, ground_truth, extra_info=None):
        return float(solution_str == ground_truth)
"""


def test_verl_style_reads_reward_model_and_extra_info_columns(tmp_path) -> None:
    path = write(tmp_path / "verl_rewards.py", VERL_SOURCE)
    specs = [f"{path}:compute_score", f"{path}:as_dict", f"{path}:in_async"]
    fns = load_reward_functions(specs, kwargs=[{"bonus": 0.25}, {}, {}], style="verl")
    assert [f.name for f in fns] == ["compute_score", "as_dict", "in_async"]
    columns = {
        "data_source": ["math", "gsm8k"],
        "reward_model": [{"style": "rule", "ground_truth": "2"}, {"style": "rule", "ground_truth": "4"}],
        "extra_info": [{"index": 0}, {"index": 1}],
    }
    chat = [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "5"}]]
    check_reward_functions(fns, PROMPTS, chat, IDS, columns)
    rewards, stats = run(fns, chat, columns)
    assert rewards == [3.25, 0.25] and stats.errors == 0
    module = next(m for m in sys.modules.values() if getattr(m, "__file__", None) == str(path))
    assert module.CALLS[-2:] == [("math", "2", "2", {"index": 0}), ("gsm8k", "5", "4", {"index": 1})]


def test_verl_style_prefers_a_ground_truth_column_and_needs_one(tmp_path) -> None:
    path = write(tmp_path / "verl_rewards.py", VERL_SOURCE)
    fns = load_reward_functions([f"{path}:compute_score"], style="verl")
    assert run(fns, columns={"ground_truth": ["5", "5"]})[0] == [0.0, 1.0]
    with pytest.raises(RewardFunctionError, match="neither a 'ground_truth' column nor a 'reward_model'"):
        check(fns)


def test_verl_required_parameter_outside_the_verl_arguments(tmp_path) -> None:
    with pytest.raises(RewardFunctionError, match="requires parameter 'answer'.*task.reward_kwargs"):
        load_source(tmp_path, "def f(solution_str, answer):\n    return 1.0\n", style="verl")


# ---------------------------------------------------------------------------------------------
# Configuration errors


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("rewards.py", "'rewards.py' is malformed; write 'pkg.module:name'"),
        ("mod:not-a-name", "malformed"),
        ("no_such_module_tba_xyz:f", "cannot import module 'no_such_module_tba_xyz'.*ModuleNotFoundError.*PYTHONPATH"),
        ("missing/dir/rewards.py:f", "rewards.py' does not exist; fix the path.*resolved against"),
    ],
)
def test_spec_errors(tmp_path, spec, expected) -> None:
    with pytest.raises(RewardFunctionError, match=expected):
        load_reward_functions([spec], base_dir=tmp_path)


def test_error_while_importing_a_file_or_a_module(tmp_path, package) -> None:
    with pytest.raises(RewardFunctionError, match="raised RuntimeError: no GPU here.*fix the file"):
        load_source(tmp_path, "raise RuntimeError('no GPU here')\n")
    name, directory = package
    write(directory / "broken.py", "import not_installed_tba_xyz\n")
    with pytest.raises(RewardFunctionError, match="importing module .*broken' raised ModuleNotFoundError"):
        load_reward_functions([f"{name}.broken:f"])


def test_missing_function_lists_what_the_module_defines(tmp_path) -> None:
    source = "import math\nfrom os.path import join\n\ndef exact(c): ...\ndef partial(c): ...\ndef _helper(c): ...\n"
    with pytest.raises(RewardFunctionError, match="no attribute 'exactt'; it defines: exact, partial\\. Fix"):
        load_source(tmp_path, source, fn="exactt")


def test_not_callable_and_class(tmp_path) -> None:
    with pytest.raises(RewardFunctionError, match="'THRESHOLD' is a int, not callable"):
        load_source(tmp_path, "THRESHOLD = 3\n", fn="THRESHOLD")
    with pytest.raises(RewardFunctionError, match="'Scorer' is a class; point the spec at a function"):
        load_source(tmp_path, "class Scorer:\n    pass\n", fn="Scorer")


def test_signature_errors_at_load_time(tmp_path) -> None:
    with pytest.raises(RewardFunctionError, match="parameter 'completions' is positional-only"):
        load_source(tmp_path, "def f(completions, /, **kw):\n    return []\n")
    with pytest.raises(RewardFunctionError, match="sets 'scael', which is not a parameter.*completions, scale"):
        load_source(tmp_path, "def f(completions, scale=1):\n    return []\n", kwargs={"scael": 2})


def test_weights_and_kwargs_length_mismatch(tmp_path) -> None:
    path = write(tmp_path / "r.py", "def f(completions):\n    return [0.0] * len(completions)\n")
    specs = [f"{path}:f"] * 3
    with pytest.raises(RewardFunctionError, match="task.reward_weights has 2 entries for 3 task.reward_funcs"):
        load_reward_functions(specs, weights=[1.0, 2.0])
    with pytest.raises(RewardFunctionError, match="task.reward_kwargs has 1 entries for 3 task.reward_funcs"):
        load_reward_functions(specs, kwargs=[{}])
    assert [f.name for f in load_reward_functions(specs)] == ["f", "f_2", "f_3"]


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        (
            "def f(completions, answers):\n    return [0.0] * len(completions)\n",
            "'f' .*requires parameter 'answers' \\(did you mean 'answer'\\?\\), which is never supplied",
        ),
        (
            "def f(completions, **kw):\n    truth = kw['solution']\n    return [truth] * len(completions)\n",
            "'f' .*raised KeyError: 'solution' \\(at .*r_.*\\.py:2 in f\\) when called on 2 dataset rows",
        ),
        ("def f(completions):\n    return [1.0, 0.0, 1.0]\n", "'f' .*returned 3 values for 2 completions"),
        ("def f(completions):\n    return 1.0\n", "'f' .*returned 1.0 \\(float\\) instead of a list"),
        ("def f(completions):\n    return [1.0, 'abc']\n", "'f' .*returned 'abc' \\(str\\) for completion 1; return"),
        ("def f(completions):\n    return [float('nan'), 1.0]\n", "'f' .*returned nan for completion 0"),
    ],
)
def test_dry_run_errors(tmp_path, body, expected) -> None:
    fns = load_source(tmp_path, body)
    with pytest.raises(RewardFunctionError, match=expected):
        check(fns)


def test_dry_run_names_every_failing_function(tmp_path) -> None:
    path = write(
        tmp_path / "two.py",
        "def good(completions):\n    return [1.0] * len(completions)\n"
        "def bad(completions):\n    return [None]\n"
        "def worse(completions):\n    raise ValueError('oops')\n",
    )
    fns = load_reward_functions([f"{path}:good", f"{path}:bad", f"{path}:worse"])
    with pytest.raises(RewardFunctionError) as info:
        check(fns)
    lines = str(info.value).splitlines()
    assert len(lines) == 2
    assert lines[0].startswith("reward function 'bad' (") and "returned 1 values for 2 completions" in lines[0]
    assert lines[1].startswith("reward function 'worse' (") and "ValueError: oops" in lines[1]


# ---------------------------------------------------------------------------------------------
# During a run


FLAKY = """
    def flaky(completions):
        if "bad" in completions:
            raise ValueError("cannot parse " + repr(completions[completions.index("bad")]))
        return [1.0] * len(completions)

    def short(completions):
        return [1.0]

    def odd(completions):
        return [float(c) for c in completions]

    def half(completions):
        return [0.5] * len(completions)
"""


def load_flaky(tmp_path, *names, weights=None):
    path = write(tmp_path / "flaky.py", FLAKY)
    return load_reward_functions([f"{path}:{n}" for n in names], weights=weights)


def test_a_sample_that_raises_is_isolated_and_its_first_traceback_reported_once(tmp_path) -> None:
    fns = load_flaky(tmp_path, "flaky", "half", weights=[2.0, 1.0])
    stats = RewardStats()
    rewards, _ = run(fns, ["good", "bad", "good"], columns={}, stats=stats)
    assert rewards == [2.5, None, 2.5]
    assert (stats.errors, stats.non_finite) == (1, 0)
    errors = stats.take_new_errors()
    assert len(errors) == 1
    header, *rest = errors[0].splitlines()
    assert header.startswith("reward function 'flaky' (") and "flaky.py:flaky) raised on completion 1 of 3" in header
    assert rest[0] == "Traceback (most recent call last):"
    assert "flaky.py" in errors[0] and rest[-1] == "ValueError: cannot parse 'bad'"
    assert "rewards.py" not in errors[0]  # the traceback starts in the user's code
    assert stats.take_new_errors() == []
    rewards, _ = run(fns, ["bad", "good"], columns={}, stats=stats)
    assert rewards == [None, 2.5]
    assert stats.errors == 2 and stats.take_new_errors() == []


def test_async_function_failing_on_one_sample(tmp_path) -> None:
    fns = load_source(
        tmp_path,
        """
        async def f(completions):
            return [1 / float(c) for c in completions]
        """,
    )
    rewards, stats = run(fns, ["1", "0", "4"], columns={})
    assert rewards == [1.0, None, 0.25] and stats.errors == 1
    (error,) = stats.take_new_errors()
    assert "raised on completion 1 of 3" in error and error.endswith("ZeroDivisionError: float division by zero")


def test_wrong_length_fails_the_whole_batch_even_where_others_scored(tmp_path) -> None:
    fns = load_flaky(tmp_path, "short", "half")
    rewards, stats = run(fns, ["a", "b", "c"], columns={})
    assert rewards == [None, None, None]
    assert (stats.errors, stats.no_reward) == (3, 0)
    (error,) = stats.take_new_errors()
    assert "'short'" in error and "returned 1 values for 3 completions" in error
    assert stats.metrics()["reward/half_mean"] == 0.5 and "reward/short_mean" not in stats.metrics()


def test_non_finite_values_are_counted_and_skipped(tmp_path) -> None:
    fns = load_flaky(tmp_path, "odd", "half", weights=[0.5, 1.0])
    rewards, stats = run(fns, ["3", "nan", "inf", "-1"], columns={})
    assert rewards == [2.0, None, None, 0.0]
    assert (stats.errors, stats.non_finite) == (2, 2)
    (error,) = stats.take_new_errors()
    assert error.startswith("reward function 'odd'") and "returned nan for completion 1 of 4" in error
    metrics = stats.metrics()
    assert metrics["searcher/reward_errors"] == 2.0 and metrics["searcher/reward_non_finite"] == 2.0
    assert metrics["reward/odd_mean"] == 1.0 and metrics["reward/half_mean"] == 0.5


def test_means_follow_the_latest_batch_and_empty_batches_are_fine(tmp_path) -> None:
    fns = load_flaky(tmp_path, "odd")
    stats = RewardStats()
    run(fns, ["1", "3"], columns={}, stats=stats)
    assert stats.metrics()["reward/odd_mean"] == 2.0
    assert run(fns, [], columns={}, stats=stats)[0] == []
    assert "reward/odd_mean" not in stats.metrics()


def test_caller_length_mismatch_is_a_value_error(tmp_path) -> None:
    fns = load_flaky(tmp_path, "half")
    with pytest.raises(ValueError, match="one entry per completion"):
        compute_rewards(fns, ["p"], ["a", "b"], [[1], [2]], {}, RewardStats())
