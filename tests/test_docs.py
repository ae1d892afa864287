"""The manual says what runs: every YAML config shown in the docs and the README validates; every
``tba train`` command shown plans on the machine its page is about, with the runtime and settings
it names; the ``--print-config``, ``--print-plan`` and ``tba plot`` commands shown print and draw
what they say; every ``tba eval`` command parses; and the configuration reference holds every key
``tba train --print-config`` prints. (``make docs`` builds the site with ``--strict``: links and
pages.)"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml
from tests.helpers.runs import sync_records, write_run

from tba.cli import main as tba_main
from tba.cli import split_train_args
from tba.config import Config, ConfigError, dump_config, load_config
from tba.config_reference import keys, reference_markdown, task_classes
from tba.eval_command import parse_args as parse_eval_args
from tba.plan import Hardware, make_plan
from tba.plan.machines import described

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def blocks(kind: str) -> list[tuple[str, str]]:
    """(page name, text) of every fenced block of ``kind`` in the docs and the README."""
    return [(p.name, m.group(2)) for p in PAGES for m in FENCE.finditer(p.read_text()) if m.group(1) == kind]


def flat_keys(data: dict, prefix: str = "") -> set[str]:
    out = set()
    for key, value in data.items():
        name = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and value:
            out |= flat_keys(value, name)
        else:
            out.add(name)
    return out


def commands() -> list[tuple[str, list[str]]]:
    """(page, argv after ``tba``) of every ``tba`` command in a bash block (continued lines joined,
    comments dropped, environment variables expanded)."""
    found = []
    for page, text in blocks("bash"):
        for line in text.replace("\\\n", " ").splitlines():
            words = shlex.split(os.path.expandvars(line), comments=True)
            if words and words[0] in ("tba", ".venv/bin/tba"):
                found.append((page, words[1:]))
    return found


def test_the_docs_show_configs_and_commands():
    shown = {argv[0] for _, argv in commands()}
    assert len(blocks("yaml")) >= 3 and shown == {"train", "eval", "plot"}


@pytest.mark.parametrize(
    "page,text", blocks("yaml"), ids=lambda x: x if isinstance(x, str) and x.endswith(".md") else ""
)
def test_every_yaml_config_shown_validates(page, text, tmp_path):
    data = yaml.safe_load(text)
    assert isinstance(data, dict) and set(data) <= set(Config.model_fields), f"{page}: not a tba config:\n{text}"
    path = tmp_path / "shown.yaml"
    path.write_text(text)
    load_config(path)


TWO_CORES = Hardware(cpus=2)
ONE_GPU = Hardware(cpus=16, gpus=1, bf16=True)
EIGHT_GPUS = Hardware(cpus=64, gpus=8, bf16=True)


def train_config(argv: list[str]) -> tuple[str | None, Config]:
    """The config file a shown ``tba train`` names (None: the defaults, or a file of the reader's own,
    whose keys the YAML test checks) and the config it builds."""
    shown = [
        a for a in argv if a not in ("--debug", "--print-plan") and not a.startswith(("--hardware=", "--parts-from="))
    ]
    config, overrides, _ = split_train_args(shown)
    if config is not None and not (ROOT / config).is_file():
        config = None
    return config, load_config(ROOT / config if config else None, overrides)


def hardware_for(page: str, config: str | None, machines: list[str] = ()) -> Hardware:
    """The machine a page's command is meant for: the one it describes (``--hardware``), the GPU
    pages' configs on GPUs, the rest on the 2-core CPU machine the quickstart is measured on."""
    if machines:
        return described(machines[-1].split("=", 1)[1])
    if config is not None and "8gpu" in config:
        return EIGHT_GPUS
    return ONE_GPU if page in ("gpus.md", "tasks.md") else TWO_CORES


def train_commands() -> list[tuple[str, list[str]]]:
    return [(page, argv[1:]) for page, argv in commands() if argv[0] == "train"]


@pytest.mark.parametrize("page,argv", train_commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_every_train_command_shown_plans_with_what_it_names(page, argv):
    config, cfg = train_config(argv)
    hardware = hardware_for(page, config, [a for a in argv if a.startswith("--hardware=")])
    plan = make_plan(cfg, hardware)  # every auto decided, nothing loaded
    assert plan.device.startswith("cuda" if hardware.gpus else "cpu")
    named = dict(a[2:].split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    if "runtime.type" in named:
        assert plan.runtime == named["runtime.type"]
    if "runtime.searcher_gpus" in named:
        assert plan.searcher_gpus == float(named["runtime.searcher_gpus"])
    if named.get("trainer.num_ranks", "auto") != "auto":
        assert plan.rank_cpus is not None  # ranks get cores of their own
    if "buffer.fresh_only" in named:
        assert plan.runtime == "sync" and plan.lag_bound is None
    if cfg.runtime.type == "auto" and hardware is TWO_CORES and not named.keys() & {"runtime.address", "eval.async"}:
        assert plan.runtime == "sync", "on two cores searchers would share the trainer's: auto trains in sync"


def test_print_config_and_print_plan_shown_print_the_config_and_the_plan(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    shown = [argv for _, argv in train_commands() if {"--print-config", "--print-plan"} & set(argv)]
    runnable = [argv for argv in shown if argv[0].startswith("-") or (ROOT / argv[0]).is_file()]  # not my_run.yaml
    # (a finished run's parts: tests/test_pace.py runs --parts-from on a run folder it writes)
    runnable = [argv for argv in runnable if not any(a.startswith("--parts-from=") for a in argv)]
    assert {"--print-config", "--print-plan"} <= {a for argv in runnable for a in argv}
    for argv in runnable:
        config, cfg = train_config(argv)
        assert tba_main(["train", *argv]) == 0, argv
        out = capsys.readouterr().out
        if "--print-config" in argv:
            assert load_config(None, []).model_validate(yaml.safe_load(out)) == cfg
        else:
            machines = [a for a in argv if a.startswith("--hardware=")]
            lines = make_plan(cfg, hardware_for("", config, machines) if machines else None).lines()
            assert out.splitlines() == lines
            if cfg.runtime.type == "auto":  # the plan says why it chose the runtime
                assert any(line.lstrip().startswith("runtime") for line in lines)


def test_every_plot_command_shown_draws_its_figures(tmp_path, monkeypatch, capsys):
    shown = [argv[1:] for _, argv in commands() if argv[0] == "plot"]
    assert shown
    monkeypatch.chdir(tmp_path)
    for args in shown:
        runs = [a for a in args[: args.index("-o")] if not a.startswith("-")] if "-o" in args else args
        for run in runs:
            if not Path(run, "metrics.jsonl").exists():
                write_run(Path(run), sync_records(0.0))
        assert tba_main(["plot", *args]) == 0, args
        written = [Path(line) for line in capsys.readouterr().out.splitlines()]
        out = Path(args[args.index("-o") + 1]) if "-o" in args else Path(runs[0], "plots") if len(runs) == 1 else None
        assert any(p.name == "overview.png" and p.stat().st_size > 0 for p in written), args
        if out is not None:
            assert all(p.parent == out for p in written), args


@pytest.mark.parametrize(
    "page,argv",
    [(p, a) for p, a in commands() if a[0] == "eval"],
    ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60],
)
def test_every_eval_command_shown_parses(page, argv):
    parse_eval_args([a for a in argv[1:] if a != "--debug"])


def test_the_reference_holds_every_key_print_config_prints():
    documented = keys()
    assert flat_keys(yaml.safe_load(dump_config(load_config(None, [])))) <= documented
    for name, cls in task_classes().items():
        assert {f"task.{key}" for key in cls.model_fields} <= documented, name
    text = reference_markdown()
    assert all(f"`{key}`" in text for key in documented)
    with pytest.raises(ConfigError):  # (what the YAML test relies on: a bad key fails)
        load_config(None, ["--trainer.no_such_key=1"])
