"""The dataset and GSM8K tasks train end to end, in both runtimes, on a model shaped like a real
checkpoint (byte-level BPE, ChatML template with an end-of-turn token that is not EOS, no pad
token), and write their metrics, samples and reward-function errors."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from tests.helpers.datasets import GSM8K_ROWS
from tests.helpers.tiny_bpe import build_bpe_chat_model

from tba.config import load_config
from tba.eval_metrics import sampled_metrics
from tba.machine import usable_cores
from tba.metrics import read_metrics
from tba.runtime.async_loop import run_ray
from tba.runtime.fill import NothingToTrain
from tba.runtime.sync_loop import run_sync

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

REWARDS = """
def length_bonus(completions, **kwargs):
    return [min(len(c[0]["content"]), 20) / 20 for c in completions]

def picky(prompts, completions, topic, **kwargs):
    # None: no opinion on half the topics; raises on one topic (a bug a long run must survive)
    out = []
    for c, t in zip(completions, topic):
        if t == "crash":
            raise RuntimeError("picky cannot handle " + t)
        out.append(None if t == "skip" else float("7" in c[0]["content"]))
    return out
"""

COMMON = [
    "--trainer.steps=4",
    "--trainer.batch_prompts=4",
    "--generation.prompts_per_batch=4",
    "--generation.group_size=4",
    "--generation.max_new_tokens=12",
    "--eval.every=2",
    "--eval.limit=6",
    "--eval.log_samples=3",
    "--logging.progress=false",
    "--runtime.trainer_cpus=1",
]


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_bpe_chat_model(tmp_path_factory.mktemp("bpe-chat"))


@pytest.fixture(scope="module")
def chat_dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat-data")
    topics = ["sums", "skip", "sums", "crash"]
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {a} plus 3?"}], "answer": a + 3, "topic": topics[a % 4]}
        for a in range(40)
    ]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(REWARDS)
    return root


def dataset_args(chat_model, chat_dataset, tmp_path, runtime: str) -> list[str]:
    return [
        *COMMON,
        f"--runtime.type={runtime}",
        f"--model.policy={chat_model}",
        "--task.name=dataset",
        f"--task.path={chat_dataset / 'data.jsonl'}",
        f"--task.reward_funcs=[{chat_dataset / 'rewards.py'}:length_bonus, {chat_dataset / 'rewards.py'}:picky]",
        "--task.reward_weights=[0.5, 1.0]",
        "--task.eval_size=6",
        "--task.answer_column=answer",
        f"--run.output_dir={tmp_path}",
        "--run.name=ds",
    ]


def check_run(run_dir, metric: str, steps: int = 4) -> list[dict]:
    records = read_metrics(run_dir / "metrics.jsonl")
    train = [r for r in records if r.get("train/loss") is not None]
    assert [r["step"] for r in train] == list(range(1, steps + 1))
    evals = [r for r in records if r.get(metric) is not None]
    assert [r["step"] for r in evals] == [0, 2, 4]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert [s["step"] for s in samples] == [0] * 3 + [2] * 3 + [4] * 3
    assert all({"prompt", "completion", "score", "answer"} <= set(s) for s in samples)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary[f"{metric}_final"] == evals[-1][metric]
    # too short to hold steps out: no prediction, the parts of every step but the first (tba.runtime.pace)
    assert summary["predicted"] is None and summary["measured"]["steps"] == steps - 1
    parts = summary["measured"]["parts"]
    assert parts["train_s"] > 0 and summary["alternatives"]["sync"]["step_s"] > 0
    # on a machine without GPUs, each part in CPU seconds too, with the threads it had
    plan = json.loads((run_dir / "plan.json").read_text())
    assert parts["train_cpu_s"] > 0 and parts["generate_cpu_s"] > 0
    threads = plan["trainer_threads"] or usable_cores()
    assert parts["train_threads"] == threads
    assert parts["generate_threads"] == (threads if summary["runtime"] == "sync" else plan["searcher_threads"])
    return train


@pytest.mark.parametrize("runtime", ["sync", "ray"])
def test_dataset_task_trains_and_survives_a_failing_reward(chat_model, chat_dataset, tmp_path, runtime, request):
    cfg = load_config(None, dataset_args(chat_model, chat_dataset, tmp_path, runtime))
    run = run_sync if runtime == "sync" else run_ray
    if runtime == "ray":
        request.getfixturevalue("local_ray")  # joined by the run (tests/conftest.py)
    run_dir, summary = run(cfg)
    train = check_run(run_dir, "eval/reward")
    assert summary["task"] == "dataset" and summary["trainer_steps"] == 4
    # the first reward function always has an opinion, so its mean is logged; the crashing topic is
    # counted, its traceback written once, and the run went on
    assert any(r.get("reward/length_bonus_mean") is not None for r in train)
    assert max(r["searcher/reward_errors"] for r in train) > 0
    log = (run_dir / "errors.log").read_text()
    assert log.count("picky cannot handle crash") == 1 and "rewards.py" in log
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert all(s["prompt"].startswith("What is") for s in samples)
    # the resolved config names the files by absolute path, so it repeats from any directory
    assert str(chat_dataset / "data.jsonl") in (run_dir / "config.yaml").read_text()


@pytest.mark.parametrize("runtime", ["sync"])  # (a task in the ray runtime's searchers: the dataset task's test)
def test_gsm8k_task_trains_with_pass_at_k(chat_model, tmp_path, runtime):
    data = tmp_path / "gsm8k"
    data.mkdir()
    more = [
        {"question": f"Tom has {a} apples and buys {a} more. How many now?", "answer": f"#### {2 * a}"}
        for a in range(12)
    ]
    pd.DataFrame(GSM8K_ROWS + more).to_json(data / "train.jsonl", orient="records", lines=True)
    pd.DataFrame(GSM8K_ROWS + more[:4]).to_json(data / "test.jsonl", orient="records", lines=True)
    args = [
        *COMMON,
        f"--runtime.type={runtime}",
        f"--model.policy={chat_model}",
        "--task.name=gsm8k",
        f"--task.path={data}",
        "--eval.samples=4",
        "--eval.pass_k=[1, 2]",
        f"--run.output_dir={tmp_path}",
        "--run.name=g",
    ]
    run = run_sync if runtime == "sync" else run_ray
    run_dir, summary = run(load_config(None, args))
    check_run(run_dir, "eval/accuracy")
    last = [r for r in read_metrics(run_dir / "metrics.jsonl") if r.get("eval/accuracy") is not None][-1]
    for key in ("eval/pass@1", "eval/pass@2", "eval/maj@1", "eval/maj@2"):
        assert 0.0 <= last[key] <= 1.0
    assert last["eval/pass@2"] >= last["eval/pass@1"] and last["eval/problems"] == 6
    assert summary["eval/pass@2_final"] == last["eval/pass@2"]
    samples = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text().splitlines()]
    assert samples[0]["prompt"].startswith("[MATH TASK] Problem:") and samples[0]["answer"] == "72"
    # each problem's sampled answers and verdicts, from which the logged metrics are recomputed
    answers = [json.loads(line) for line in (run_dir / "eval_answers.jsonl").read_text().splitlines()]
    assert [a["step"] for a in answers] == [0] * 6 + [2] * 6 + [4] * 6
    assert all(len(a["answers"]) == len(a["wins"]) == 4 for a in answers)
    again = sampled_metrics([(a["answers"], a["wins"]) for a in answers if a["step"] == 4], [1, 2])
    for key in ("pass@1", "maj@2", "distinct_right", "right_entropy"):
        assert last[f"eval/{key}"] == pytest.approx(again[key], abs=1e-12), key


def test_bad_reward_function_fails_before_any_model_or_run_directory(chat_model, chat_dataset, tmp_path):
    from tba.rewards import RewardFunctionError

    args = dataset_args(chat_model, chat_dataset, tmp_path, "sync")
    args = [a for a in args if not a.startswith(("--task.reward_funcs", "--task.reward_weights"))]
    args.append(f"--task.reward_funcs=[{chat_dataset / 'rewards.py'}:lenght_bonus]")
    with pytest.raises(RewardFunctionError, match="length_bonus"):  # the message suggests the right name
        run_sync(load_config(None, args))
    assert not (tmp_path / "ds").exists()


@pytest.mark.parametrize("runtime", ["sync", "ray"])
def test_a_run_whose_every_completion_is_dropped_stops_in_the_fill_and_says_why(
    chat_model, chat_dataset, tmp_path, runtime, request
):
    # a reward function with no opinion on any reply (a format the model never writes): every
    # completion is dropped unscored, no group reaches the buffer, and the fill must not wait forever
    (tmp_path / "silent.py").write_text("def silent(completions, **kwargs):\n    return [None] * len(completions)\n")
    args = dataset_args(chat_model, chat_dataset, tmp_path, runtime)
    args = [a for a in args if not a.startswith(("--task.reward_funcs", "--task.reward_weights"))]
    args += [f"--task.reward_funcs=[{tmp_path / 'silent.py'}:silent]", "--buffer.fill_patience=2"]
    if runtime == "ray":
        request.getfixturevalue("local_ray")
    run = run_sync if runtime == "sync" else run_ray
    with pytest.raises(NothingToTrain) as err:
        run(load_config(None, args))
    line = str(err.value)
    assert line.startswith("initial fill: ") and "nothing to train on yet" in line
    drawn = int(line.split("initial fill: ")[1].split(" prompts")[0])
    assert drawn >= 2 * 4  # the patience: 2 batches' worth of prompts (4 a batch), none of them usable
    made = int(line.split("the searchers generated ")[1].split(" completions")[0])
    assert made >= drawn * 4 and "scored by no reward function" in line
    assert "0 groups reached the trainer" in line and "the buffer holds 0 prompts" in line
