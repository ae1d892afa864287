"""TensorBoard and Weights & Biases beside ``metrics.jsonl``: every record and every evaluation's
samples reach both, at the trainer step; a resume continues the same W&B run; a missing package
stops the start in one line. W&B runs offline (``WANDB_MODE=offline``: no network, no account), and
what it wrote is read back with its own reader of the run's transaction log
(``wandb leet inspect --json``); TensorBoard's event files with its ``EventAccumulator``."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers

from tba.cli import main
from tba.config import LoggingConfig
from tba.errors import MissingDependency
from tba.machine import cpu_model
from tba.metrics import MetricsLogger, read_metrics

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

pytest.importorskip("wandb")
pytest.importorskip("tensorboard")

SAMPLES = [
    {"prompt": "1+2=", "completion": "3", "score": 1.0, "answer": 3},
    {"prompt": "a | b\nc", "completion": "7", "score": 0.0, "answer": "x"},
]


@pytest.fixture
def offline_wandb(monkeypatch, tmp_path) -> Path:
    """W&B offline, silent, with its settings, caches and default folder in ``tmp_path``; returns
    that default folder (which a run must not use: its files go to the run directory)."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")
    for var in ("WANDB_DIR", "WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    return tmp_path / "wandb-home" / "wandb_dir"


def wandb_records(run_dir: Path) -> list[list[dict]]:
    """The records of each W&B run written to ``<run>/wandb``, oldest first."""
    logs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    out = []
    for log in logs:
        proc = subprocess.run(
            [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert proc.returncode == 0, proc.stderr
        out.append([json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")])
    return out


def of_type(records: list[dict], kind: str) -> list[dict]:
    return [r[kind] for r in records if r["type"] == kind]


def history(records: list[dict]) -> dict[int, dict]:
    """``{trainer step: values logged at it}`` (W&B rows merged), without W&B's own ``_*`` keys."""
    out: dict[int, dict] = {}
    for h in of_type(records, "history"):
        item = {k: v for k, v in h["item"].items() if not k.startswith("_")}
        out.setdefault(int(item.pop("trainer/step")), {}).update(item)
    return out


def wandb_table(run_dir: Path, values: dict, key: str = "eval/samples") -> dict:
    """The W&B Table that ``values`` (one step of :func:`history`) holds under ``key``, as W&B stores
    it: ``{"columns": [...], "data": [[...], ...]}``."""
    assert values[f"{key}._type"] == "table-file"
    (path,) = (run_dir / "wandb").glob(f"offline-run-*/files/{values[f'{key}.path']}")
    return json.loads(path.read_text())


def test_wandb_gets_every_record_the_config_and_the_samples(offline_wandb, tmp_path):
    run_dir = tmp_path / "my-run"
    run_dir.mkdir()
    logging = LoggingConfig(wandb=True, wandb_project="proj", wandb_tags=["a", "b"])
    metrics = MetricsLogger(run_dir, logging, {"trainer": {"steps": 4}, "eval": {"async": False}}, start_time=0.0)
    metrics.log(0, {"eval/accuracy": 0.25})
    metrics.log(1, {"train/loss": 1.5})
    metrics.log(2, {"train/loss": 0.5})
    metrics.log(3, {"train/loss": 0.25})
    metrics.log_samples(2, SAMPLES)  # an evaluation of step 2's weights that comes back late
    metrics.log(2, {"eval/accuracy": 0.75})
    metrics.close()

    run_id = (run_dir / "wandb_id").read_text().strip()
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    assert offline.name.endswith(f"-{run_id}")
    assert not offline_wandb.exists()  # dir=<run>, not WANDB_DIR
    (records,) = wandb_records(run_dir)
    (run,) = of_type(records, "run")
    assert run["run_id"] == run_id and run["project"] == "proj" and run["tags"] == ["a", "b"]
    assert run["display_name"] == "my-run"  # the run directory's name
    config = run["config"]["update"]
    assert config["trainer"] == {"steps": 4} and config["eval"] == {"async": False}
    metric_axes = {m.get("glob_name") or m.get("name"): m.get("step_metric") for m in of_type(records, "metric")}
    assert metric_axes["*"] == "trainer/step"  # the x axis of every metric
    logged = history(records)
    assert sorted(logged) == [0, 1, 2, 3]
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in jsonl] == [0, 1, 2, 3, 2]
    assert logged[1]["time_s"] == jsonl[1]["time_s"] > 0
    assert logged[0]["eval/accuracy"] == 0.25 and logged[1]["train/loss"] == 1.5
    assert logged[2]["train/loss"] == 0.5 and logged[3]["train/loss"] == 0.25
    assert logged[2]["eval/accuracy"] == 0.75  # not dropped for arriving after step 3
    table = wandb_table(run_dir, logged[2])
    assert table["columns"] == ["step", "prompt", "completion", "score", "answer"]
    assert table["data"] == [[2, "1+2=", "3", 1.0, 3], [2, "a | b\nc", "7", 0.0, "x"]]
    assert of_type(records, "exit")[-1]["exit_code"] == 0


def test_a_resume_continues_the_same_wandb_run_and_an_interrupted_one_ends_failed(offline_wandb, tmp_path):
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    logging = LoggingConfig(wandb=True)
    first = MetricsLogger(run_dir, logging)
    first.log(1, {"train/loss": 2.0})
    with pytest.raises(KeyboardInterrupt):
        try:
            raise KeyboardInterrupt  # Ctrl-C in training: the runtime closes the logger in a finally
        finally:
            first.close()
    run_id = (run_dir / "wandb_id").read_text().strip()
    again = MetricsLogger(run_dir, logging)
    again.log(2, {"train/loss": 1.0})
    again.close()

    assert (run_dir / "wandb_id").read_text().strip() == run_id
    interrupted, resumed = wandb_records(run_dir)
    assert [r["run_id"] for r in of_type(interrupted + resumed, "run")] == [run_id, run_id]
    assert of_type(interrupted, "exit")[-1].get("exit_code") == 1
    assert of_type(resumed, "exit")[-1].get("exit_code", 0) == 0
    assert history(interrupted)[1]["train/loss"] == 2.0 and history(resumed)[2]["train/loss"] == 1.0


def tensorboard_events(run_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run_dir / "tensorboard"), size_guidance={"scalars": 0, "tensors": 0})
    events.Reload()
    return events


def test_tensorboard_gets_every_record_and_the_samples_as_a_table(tmp_path):
    metrics = MetricsLogger(tmp_path, LoggingConfig(tensorboard=True), start_time=0.0)
    metrics.log(1, {"train/loss": 1.5})
    metrics.log_samples(2, SAMPLES)
    metrics.log(2, {"train/loss": 0.5, "eval/accuracy": 0.75})
    metrics.close()

    events = tensorboard_events(tmp_path)
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(1, 1.5), (2, 0.5)]
    assert [(e.step, e.value) for e in events.Scalars("eval/accuracy")] == [(2, 0.75)]
    assert [e.step for e in events.Scalars("time_s")] == [1, 2]
    (text,) = events.Tensors("eval/samples/text_summary")
    assert text.step == 2
    assert text.tensor_proto.string_val[0].decode().splitlines() == [
        "| step | prompt | completion | score | answer |",
        "|---|---|---|---|---|",
        "| 2 | 1+2= | 3 | 1.0 | 3 |",
        "| 2 | a \\| b<br>c | 7 | 0.0 | x |",  # one line per row, the table intact
    ]


@pytest.mark.parametrize(
    ("backend", "modules", "says"),
    [
        ("wandb", ["wandb"], "pip install wandb"),
        ("tensorboard", ["tensorboard", "torch.utils.tensorboard"], "pip install tensorboard"),
    ],
)
def test_a_missing_package_is_a_missing_dependency_before_anything_is_written(
    backend, modules, says, monkeypatch, tmp_path
):
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)  # `import` raises ImportError
    with pytest.raises(MissingDependency, match=says):
        MetricsLogger(tmp_path, LoggingConfig(**{backend: True}))
    assert list(tmp_path.iterdir()) == []


def tiny_run_args(tiny_checkpoint, tmp_path, *extra: str) -> list[str]:
    return [
        "train",
        "--runtime.type=sync",
        f"--model.policy={tiny_checkpoint}",
        f"--model.cache_dir={tmp_path / 'cache'}",
        "--task.digits=1",
        "--task.eval_size=4",
        "--generation.prompts_per_batch=2",
        "--generation.group_size=2",
        "--generation.max_new_tokens=3",
        "--trainer.batch_prompts=2",
        "--trainer.steps=4",
        "--eval.every=2",
        "--eval.log_samples=2",
        "--logging.progress=false",
        f"--run.output_dir={tmp_path / 'runs'}",
        "--run.name=x",
        *extra,
    ]


def test_a_sync_run_logs_to_both(offline_wandb, tiny_checkpoint, tmp_path):
    status = main(tiny_run_args(tiny_checkpoint, tmp_path, "--logging.wandb=true", "--logging.tensorboard=true"))
    assert status == 0
    run_dir = tmp_path / "runs" / "x"
    jsonl = read_metrics(run_dir / "metrics.jsonl")
    samples = read_metrics(run_dir / "samples.jsonl")
    (records,) = wandb_records(run_dir)
    logged = history(records)
    assert sorted(logged) == [r["step"] for r in jsonl] == [0, 1, 2, 3, 4]
    for r in jsonl:  # each record is one W&B row
        for key, value in r.items():
            if key != "step" and value is not None:
                assert logged[r["step"]][key] == pytest.approx(value, abs=1e-3), key
    (run,) = of_type(records, "run")
    assert run["display_name"] == "x" and run["config"]["update"]["trainer"]["steps"] == 4
    eval_steps = [0, 2, 4]
    assert sorted({s["step"] for s in samples}) == eval_steps
    for step in eval_steps:
        table = wandb_table(run_dir, logged[step])
        expected = [s for s in samples if s["step"] == step]
        assert [row[table["columns"].index("completion")] for row in table["data"]] == [
            s["completion"] for s in expected
        ]
    events = tensorboard_events(run_dir)
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.step for e in events.Tensors("eval/samples/text_summary")] == eval_steps
    assert of_type(records, "exit")[-1].get("exit_code", 0) == 0
    # where it ran: beside the run, in its summary, in W&B's config and TensorBoard's text tab
    environment = json.loads((run_dir / "environment.json").read_text())
    assert json.loads((run_dir / "summary.json").read_text())["environment"] == environment
    assert environment["python"] == platform.python_version() and environment["torch"] == torch.__version__
    assert environment["transformers"] == transformers.__version__ and environment["cpu"] == cpu_model()
    assert environment["cores"] >= 1 and isinstance(environment["gpus"], list) and "ray" in environment
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=Path(__file__).parent)
    if head.returncode == 0:  # a checkout: the commit the code ran from
        assert environment["commit"].removesuffix("+dirty") == head.stdout.strip()
    assert run["config"]["update"]["environment"]["torch"] == torch.__version__
    (text,) = events.Tensors("environment/text_summary")
    table = text.tensor_proto.string_val[0].decode()
    assert f"| cpu | {cpu_model()} |" in table and f"| torch | {torch.__version__} |" in table


def test_a_missing_package_stops_the_start_and_leaves_no_run_directory(tiny_checkpoint, monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)
    assert main(tiny_run_args(tiny_checkpoint, tmp_path, "--logging.wandb=true")) == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert message.startswith("tba: logging.wandb=true needs the wandb package: pip install wandb")
    assert not (tmp_path / "runs" / "x").exists()
