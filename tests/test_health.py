"""A run that falls below its start is said while it goes on (``tba.runtime.health.FallWatch``)."""

from __future__ import annotations

import math

from tba.runtime.health import FallWatch


def _steps(watch: FallWatch, first: int, last: int, **signals: float) -> None:
    for step in range(first, last + 1):
        assert watch.observe(step, {f"train/{k}": v for k, v in signals.items()}) is None


def test_an_evaluation_below_the_start_is_said_once_with_what_preceded_it():
    watch = FallWatch("eval/accuracy", 0.5, problems=256)
    assert math.isclose(watch.margin, math.sqrt(0.25 / 256))  # one standard error: 3.1 points
    _steps(watch, 1, 10, lag_fresh=1.0, grad_norm=200.0, log_z=5.0, flat_groups=0.2)
    first = {"eval/accuracy": 0.55}
    assert watch.observe(10, first) is None
    assert first["eval/gain"] == 0.55 - 0.5 and first["eval/below_start"] == 0.0
    _steps(watch, 11, 20, lag_fresh=3.0, grad_norm=900.0, log_z=9.0, flat_groups=0.9)
    noise = {"eval/accuracy": 0.48}  # 2 points down: within the margin
    assert watch.observe(20, noise) is None and noise["eval/below_start"] == 0.0
    fall = {"eval/accuracy": 0.40}
    message = watch.observe(21, fall)
    assert fall["eval/below_start"] == 1.0 and math.isclose(fall["eval/gain"], -0.1)
    assert message.startswith("step 21: accuracy 40.0% is below the start (50.0%)")
    # the interval's signals beside the first interval's (step 21's window is empty: none shown)
    assert "grad norm" not in message
    watch2 = FallWatch("eval/accuracy", 0.5, problems=256)
    _steps(watch2, 1, 10, lag_fresh=1.0, grad_norm=200.0)
    watch2.observe(10, {"eval/accuracy": 0.5})
    _steps(watch2, 11, 20, lag_fresh=3.0, grad_norm=900.0)
    message = watch2.observe(20, {"eval/accuracy": 0.3})
    assert "lag of new data 3 (first interval 1)" in message and "grad norm 900 (first interval 200)" in message
    # said once per fall: again only after coming back above the line
    assert watch2.observe(30, {"eval/accuracy": 0.2}) is None
    assert watch2.observe(40, {"eval/accuracy": 0.6}) is None
    assert watch2.observe(50, {"eval/accuracy": 0.1}) is not None


def test_the_start_is_the_first_evaluation_and_other_metrics_fall_at_any_drop():
    watch = FallWatch("eval/reward")  # evaluation in the background: the start arrives first
    assert watch.observe(0, {"eval/reward": 1.0}) is None and watch.initial == 1.0 and watch.margin == 0.0
    record = {"eval/reward": 0.999}
    assert "reward 0.999 is below the start (1.000)" in watch.observe(5, record)
    resumed = FallWatch.from_history("eval/reward", [{"step": 0, "eval/reward": 0.8}, {"step": 1, "train/kl": 0.1}])
    assert resumed.initial == 0.8
    assert FallWatch.from_history("eval/reward", []).initial is None


def test_the_advice_after_a_fall_names_the_sequence_band_for_plain_trajectory_balance():
    from tba.config import load_config
    from tba.plan import Hardware, make_plan
    from tba.runtime.health import BAND, LOWER_LR, remedy

    def advice(overrides: list[str]) -> str:
        plan = make_plan(load_config(None, overrides), Hardware(cpus=16, gpus=4, bf16=True))
        return remedy(plan.objective, plan.trust_region)

    assert advice(["--objective.tb_trust_region=null"]) == BAND
    assert advice(["--runtime.type=sync"]) == BAND  # auto: plain TB in sync
    assert advice(["--objective.type=grpo"]) == LOWER_LR
    assert advice([]) == LOWER_LR  # the band is TB's default (auto: ray on four GPUs)
    assert advice(["--objective.tb_trust_region=0.2"]) == LOWER_LR
    watch = FallWatch("eval/accuracy", 0.5, problems=256, advice=BAND)
    assert watch.observe(10, {"eval/accuracy": 0.1}).endswith(BAND)


def test_the_last_line_names_what_errors_log_holds(tmp_path):
    from tba.runtime.report import errors_log_contents, log_errors, say_event
    from tba.types import LoggedError

    said: list[str] = []
    say_event(tmp_path, said.append, "evaluation fell below its start: 0.20 against 0.35")
    assert errors_log_contents(tmp_path / "errors.log") == (
        "errors.log holds 1 notice(s) of the run (a searcher that died or came back, a fall below the start, "
        "a slowdown)"
    )
    traceback = 'Traceback (most recent call last):\n  File "r.py", line 3\n\nValueError: picky'
    log_errors(
        tmp_path, [LoggedError("reward", f"searcher 0, policy version 4: reward function picky failed\n{traceback}")]
    )
    log_errors(
        tmp_path, [LoggedError("reward", f"searcher 1, policy version -1: reward function other failed\n{traceback}")]
    )
    assert "reward function picky failed" in (tmp_path / "errors.log").read_text()
    said_now = errors_log_contents(tmp_path / "errors.log")
    assert said_now.startswith("errors.log holds 2 reward-function traceback(s) (the first of each failing function")
    assert said_now.endswith(
        "and 1 notice(s) of the run (a searcher that died or came back, a fall below the start, a slowdown)"
    )
    # an agent's failure (tba.endpoint.agents) and an environment's (tba.generation.turns), named as such
    from tba.endpoint.agents import AgentConversations
    from tba.generation.turns import Conversations

    agents = AgentConversations(None, lambda prompt, client: None, {0}, max_turns=2)
    envs = Conversations(None, lambda: None, {0}, max_turns=2, end_text="<end>")
    try:
        agents._note("RuntimeError: the agent's bug", traceback)
        envs._note(RuntimeError("the server is gone"))
        failures = agents.take_new_errors() + envs.take_new_errors()
    finally:
        agents.close()
        envs.close()
    log_errors(tmp_path, [LoggedError("rollout", f"searcher 0, policy version 5: {e}") for e in failures])
    said_now = errors_log_contents(tmp_path / "errors.log")
    assert said_now.startswith("errors.log holds 2 reward-function traceback(s)")
    assert "and 2 environment or agent traceback(s) (the first of each kind; those rollouts were dropped" in said_now
