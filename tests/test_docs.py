"""The manual says what runs: every YAML config shown in the docs and the README validates, every
``tba`` command shown parses, and the configuration reference holds every key ``tba train
--print-config`` prints. (``make docs`` builds the site with ``--strict``: links and pages.)"""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from tba.cli import split_train_args
from tba.config import Config, ConfigError, dump_config, load_config
from tba.config_reference import keys, reference_markdown, task_classes
from tba.eval_command import parse_args as parse_eval_args
from tba.plots import build_parser as plot_parser

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
    assert len(blocks("yaml")) >= 3 and len(commands()) >= 15


@pytest.mark.parametrize(
    "page,text", blocks("yaml"), ids=lambda x: x if isinstance(x, str) and x.endswith(".md") else ""
)
def test_every_yaml_config_shown_validates(page, text, tmp_path):
    data = yaml.safe_load(text)
    assert isinstance(data, dict) and set(data) <= set(Config.model_fields), f"{page}: not a tba config:\n{text}"
    path = tmp_path / "shown.yaml"
    path.write_text(text)
    load_config(path)


@pytest.mark.parametrize("page,argv", commands(), ids=lambda x: x if isinstance(x, str) else " ".join(x)[:60])
def test_every_tba_command_shown_parses(page, argv):
    command, args = argv[0], argv[1:]
    if command == "train":
        config, overrides, _ = split_train_args([a for a in args if a != "--debug"])
        if config is not None and not (ROOT / config).is_file():
            config = None  # a file of the reader's own (my_run.yaml): its keys are checked above
        load_config(ROOT / config if config else None, overrides)
    elif command == "eval":
        parse_eval_args([a for a in args if a != "--debug"])
    elif command == "plot":
        plot_parser().parse_args(args)
    else:
        pytest.fail(f"{page}: unknown command tba {command}")


def test_the_reference_holds_every_key_print_config_prints():
    documented = keys()
    assert flat_keys(yaml.safe_load(dump_config(load_config(None, [])))) <= documented
    for name, cls in task_classes().items():
        assert {f"task.{key}" for key in cls.model_fields} <= documented, name
    text = reference_markdown()
    assert all(f"`{key}`" in text for key in documented)
    with pytest.raises(ConfigError):  # (what the YAML test relies on: a bad key fails)
        load_config(None, ["--trainer.no_such_key=1"])
