"""What the benchmark scripts share: launching ``tba train`` and reading its runs, the figures'
formatting, and the machine line. Every script imports it as ``from harness import ...``: a script
run as ``python benchmarks/bench_x.py`` has ``benchmarks/`` first on its path, so no script changes
``sys.path`` and none imports another script.

- :mod:`harness.runs`: :func:`train` (``tba train`` in a process of its own: a config file,
  ``--key=value`` overrides, an output folder and run name, a time limit, a log file),
  :func:`start_train` / :func:`stop` for a run watched while it goes, :func:`tba` for any other
  ``tba`` command, the readers of a finished run (:func:`summary`, :func:`metrics`,
  :func:`trained`, :func:`outcome`, :func:`sampled`), and a study's results folder
  (:func:`parse_with_overrides`, :func:`results_folder`, :func:`load_results`);
- :mod:`harness.report`: :func:`mean_std`, :func:`spread`, :func:`fmt`, markdown :func:`row` and
  :func:`rule`, and :func:`print_machine` (with :func:`machine_line` and :func:`describe_machine`);
- :mod:`harness.study`: a study of arms declared as data (:class:`harness.study.Arm`: a runtime,
  overrides, seeds, repeats), its trials in order (each arm in turn, side by side, ABBA), run one
  after another through a function the script passes in, their rows kept in a JSON file and read back
  (a study resumes where it stopped), and one markdown row per arm (``bench_headline.py``,
  ``bench_async_regimes.py``, ``bench_layouts.py``, ``bench_real_model.py``, ``bench_tools.py``,
  ``bench_gpu.py``);
- :mod:`harness.settings`: the training settings two studies share;
- :mod:`harness.models`: models the benchmarks build (SmolLM2 from its GGUF file, random Qwen2s);
- :mod:`harness.measure`: in-process measurement (one trainer step's time and peak memory, a sync
  run's parts and a round of a searcher batch and a trainer step timed apart, a row measured in a
  fresh interpreter);
- :mod:`harness.standins`: searchers and a trainer update whose model work is a wait, for the real
  ray runtime at many searchers (``bench_scale.py``, ``bench_scale_faults.py``).

This package is the one place that changes ``sys.path``: it puts the checkout's ``src`` (the
benchmarks measure this checkout, installed or not) and the repository root (the test suite's model
builders, ``tests/helpers/tiny_redteam.py`` and the like, which some benchmarks reuse) first.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
"""The repository root."""

for _path in (str(ROOT), str(ROOT / "src")):  # src ends up first
    if _path not in sys.path:
        sys.path.insert(0, _path)

from harness.report import describe_machine, fmt, machine_line, mean_std, print_machine, row, rule, spread  # noqa: E402
from harness.runs import (  # noqa: E402
    TrainRun,
    load_results,
    metrics,
    outcome,
    parse_with_overrides,
    results_folder,
    sampled,
    start_train,
    stop,
    summary,
    tba,
    train,
    train_command,
    trained,
)

__all__ = [
    "ROOT",
    "TrainRun",
    "describe_machine",
    "fmt",
    "load_results",
    "machine_line",
    "mean_std",
    "metrics",
    "outcome",
    "parse_with_overrides",
    "print_machine",
    "results_folder",
    "row",
    "rule",
    "sampled",
    "spread",
    "start_train",
    "stop",
    "summary",
    "tba",
    "train",
    "train_command",
    "trained",
]
