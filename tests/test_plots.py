"""``tba plot`` and :mod:`tba.plots`: the figures' series and numbers, the PNGs, bad input."""

from __future__ import annotations

from pathlib import Path

import matplotlib.image
import pytest
from tests.helpers.runs import STEPS, sync_records, write_run

from tba.cli import main
from tba.plots import THROUGHPUT, ema, figures, load_run, load_runs, plot_run


@pytest.fixture
def two_runs(tmp_path) -> list[Path]:
    """``alpha`` logs log Z, ``beta`` (say, a GRPO run) does not."""
    return [
        write_run(tmp_path / "alpha", sync_records(0.0)),
        write_run(tmp_path / "beta", sync_records(0.1, log_z=False)),
    ]


def labelled(ax) -> list[str]:
    return [line.get_label() for line in ax.get_lines() if not line.get_label().startswith("_")]


def test_ema_is_debiased():
    assert ema([2.0, 2.0, 2.0], 0.9) == pytest.approx([2.0, 2.0, 2.0])  # no pull toward 0 at the start
    # m1 = 0.5 * 2 = 1, / (1 - 0.5) = 2; m2 = 0.5 * 1 + 0.5 * 4 = 2.5, / (1 - 0.25) = 10/3
    assert ema([2.0, 4.0], 0.5) == pytest.approx([2.0, 10 / 3])
    assert ema([1.0, 5.0, 3.0], 0.0) == [1.0, 5.0, 3.0]


def test_each_run_gets_a_faint_raw_line_and_a_bold_ema(two_runs):
    runs = load_runs(two_runs)
    figs = figures(runs, ema_decay=0.9)
    (ax,) = figs["sampled_reward"].axes
    lines = ax.get_lines()
    assert len(lines) == 4 and labelled(ax) == ["alpha", "beta"]
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["alpha", "beta"]
    raw, smooth = lines[2], lines[3]  # beta's
    rewards = [r["searcher/reward_mean"] for r in sync_records(0.1)[1:]]
    assert list(raw.get_xdata()) == list(range(1, STEPS + 1))
    assert list(raw.get_ydata()) == pytest.approx(rewards) and raw.get_alpha() == 0.25
    assert list(smooth.get_ydata()) == pytest.approx(ema(rewards, 0.9)) and smooth.get_alpha() is None
    assert smooth.get_linewidth() > raw.get_linewidth()
    # against wall-clock: the same values at each record's time_s
    (ax_t,) = figs["sampled_reward_vs_time"].axes
    assert list(ax_t.get_lines()[0].get_xdata()) == pytest.approx([1.0 + 0.5 * s for s in range(1, STEPS + 1)])
    assert ax_t.get_xlabel() == "wall-clock (s)"


def test_evaluations_are_markers_without_ema_and_headline_first(tmp_path):
    records = sync_records(0.0)
    for r in records:
        if "eval/accuracy" in r:
            r["eval/win_rate"] = r.pop("eval/accuracy")
            r["eval/completion_len"] = 12.0
    run = write_run(tmp_path / "tldr", records, summary={"eval/win_rate_initial": 0.3, "eval/win_rate_final": 0.6})
    figs = figures(load_runs([run]))
    win, length = figs["eval"].axes  # the headline from summary.json first, though not alphabetically
    assert win.get_title() == "eval win_rate" and length.get_title() == "eval completion_len"
    (line,) = win.get_lines()
    assert line.get_marker() == "o"
    assert list(line.get_xdata()) == [0, 10, 20, 30]
    assert list(line.get_ydata()) == pytest.approx([0.3, 0.4, 0.5, 0.6])
    assert all(ax.get_title() != "eval problems" for ax in figs["eval"].axes)  # a count, not a metric


def test_a_key_one_run_lacks_shows_the_other_run_only(two_runs):
    figs = figures(load_runs(two_runs))
    (ax,) = figs["log_z"].axes
    assert len(ax.get_lines()) == 2 and labelled(ax) == ["alpha"]
    (buffer,) = figs["buffer"].axes  # no step-to-step noise: one line per run, no EMA
    assert labelled(buffer) == ["alpha", "beta"] and len(buffer.get_lines()) == 2


def test_quantities_without_data_make_no_figure(tmp_path):
    records = [{k: v for k, v in r.items() if not k.startswith(("train/lag", "train/kl"))} for r in sync_records(0.0)]
    figs = figures(load_runs([write_run(tmp_path / "nolag", records)]), x="step")
    assert list(figs) == ["eval", "sampled_reward", "loss", "log_z", "buffer", "throughput", "overview"]
    # lag.png has a panel for each lag key that was logged: lag_fresh was not
    figs = figures(load_runs([write_run(tmp_path / "lagged", sync_records(0.0))]))
    assert [ax.get_ylabel() for ax in figs["lag"].axes] == ["train/lag_mean", "train/lag_max"]
    assert len(figs["overview"].axes) == 10  # eval and sampled reward twice (steps, time), 6 more


def test_throughput_is_derived_from_counts_for_every_run(tmp_path):
    run = load_run(write_run(tmp_path / "sync", sync_records(0.0)))
    rates = [r[THROUGHPUT] for r in run.records if THROUGHPUT in r]
    assert rates == pytest.approx([128.0 / 0.5] * (STEPS - 1))  # 128 completions per 0.5 s
    (ax,) = figures([run])["throughput"].axes
    assert ax.get_ylabel() == "Δ searcher/completions / Δ time_s"
    # the ray runtime logs its own rates too (averages since start): drawn beside, not instead
    ray = [{**r, "searcher/completions_per_s": 7.0} for r in sync_records(0.0) if r["step"] > 0]
    derived, logged = figures(load_runs([write_run(tmp_path / "ray", ray)]))["throughput"].axes
    assert list(derived.get_lines()[0].get_ydata()) == pytest.approx([256.0] * (STEPS - 1))
    assert logged.get_ylabel() == "searcher/completions_per_s"
    assert list(logged.get_lines()[0].get_ydata()) == [7.0] * STEPS


def test_cli_compares_two_runs_into_valid_pngs(two_runs, tmp_path, capsys):
    out = tmp_path / "compare"
    assert main(["plot", *map(str, two_runs), "--names", "tb", "grpo", "-o", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    names = [Path(p).name for p in printed]
    assert names == [
        "eval.png",
        "eval_vs_time.png",
        "sampled_reward.png",
        "sampled_reward_vs_time.png",
        "loss.png",
        "log_z.png",
        "kl.png",
        "lag.png",
        "buffer.png",
        "throughput.png",
        "overview.png",
    ]
    for path in map(Path, printed):
        image = matplotlib.image.imread(path)
        assert image.ndim == 3 and image.shape[0] >= 300 and image.shape[1] >= 400, path
        assert image[..., :3].std() > 0.05, f"{path} is blank"
    overview = matplotlib.image.imread(out / "overview.png")
    assert overview.shape[1] > 3 * overview.shape[0] / 2  # a grid four panels wide


def test_default_output_directory(tmp_path, monkeypatch, capsys):
    lean = [{"step": s, "time_s": float(s), "searcher/reward_mean": 0.1 * s} for s in range(1, 6)]
    a, b = write_run(tmp_path / "a", lean), write_run(tmp_path / "b", lean)
    assert main(["plot", str(a), "--x", "step"]) == 0
    assert capsys.readouterr().out.split() == [str(a / "plots" / n) for n in ("sampled_reward.png", "overview.png")]
    monkeypatch.chdir(tmp_path)
    assert main(["plot", str(a), str(b), "--x", "time"]) == 0
    written = [Path(p) for p in capsys.readouterr().out.split()]
    assert written == [Path("tba-plots") / n for n in ("sampled_reward_vs_time.png", "overview.png")]
    assert all((tmp_path / p).is_file() for p in written)


def test_plot_run_draws_the_overview_into_training_png(two_runs, tmp_path):
    path = plot_run(two_runs[0], "eval/accuracy")
    assert path == two_runs[0] / "plots" / "training.png"
    image = matplotlib.image.imread(path)
    assert image.shape[1] > image.shape[0] and image[..., :3].std() > 0.05
    assert plot_run(write_run(tmp_path / "nothing-logged", [])) is None  # the end of a run does not fail on it


@pytest.mark.parametrize(
    "make, args, message",
    [
        (lambda d: None, [], "no such run directory"),
        (lambda d: d.mkdir(), [], "it has no metrics.jsonl"),
        (lambda d: write_run(d, []), [], "has no records yet"),
        (lambda d: write_run(d, sync_records(0.0)), ["--names", "x", "y"], "gives 2 names for 1 runs"),
        (lambda d: write_run(d, sync_records(0.0)), ["--ema", "1.5"], "--ema 1.5 is not in [0, 1)"),
    ],
    ids=["missing", "not-a-run", "empty", "names", "ema"],
)
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, make, args, message):
    run = tmp_path / "run"
    make(run)
    assert main(["plot", str(run), *args, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and err.startswith("tba: "), err
    assert not (tmp_path / "out").exists()
