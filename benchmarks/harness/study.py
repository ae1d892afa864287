"""A study of arms: each arm a runtime and overrides of ``tba train``, run over seeds (and repeats)
one trial after another, every finished trial's row kept in a JSON file, and the rows of each arm
summed up in one markdown table.

- :class:`Arm` declares an arm as data; :func:`trials` expands arms into :class:`Trial` objects in
  the study's order (each arm's trials in turn, the arms side by side at each seed, or ABBA);
- :func:`run_study` runs each trial through a function the script passes in (which usually calls
  :meth:`Trial.train`), skips the trials whose rows are kept already, and saves each row as it lands
  through :class:`Results`;
- :func:`table` prints the arms' rows as one markdown row per arm, its cells declared as
  :class:`Column` objects (mean ± std over seeds, the mean, each value, the first).
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.report import row as markdown_row
from harness.report import rule, spread
from harness.runs import TrainRun, train
from harness.settings import SETTINGS

ORDERS = ("arm", "seed", "abba")
"""How :func:`trials` orders a study's trials: ``arm``, each arm's seeds (and repeats) in turn;
``seed``, every arm at one seed (and repeat) before the next, in the arms' order; ``abba``, as
``seed`` with the arms' order reversed at every other round, so that drift of the machine falls on
every arm alike."""


@dataclass(frozen=True)
class Arm:
    """One arm of a study: the runs of one runtime and one set of overrides, over ``seeds``."""

    name: str
    """Names the arm's run directories (:attr:`Trial.name`)."""
    runtime: str | None = None
    """``runtime.type`` (``sync``, ``ray``); None leaves it to the config."""
    overrides: Sequence[str] = ()
    """``tba train`` overrides after the runtime's."""
    config: str | Path | None = None
    """The config file; None: the built-in demo."""
    seeds: Sequence[int | None] = (None,)
    """``run.seed`` of each trial; None runs with the config's own seed (no override)."""
    repeats: int = 1
    """Trials at each seed."""
    fields: Mapping[str, Any] = field(default_factory=dict)
    """The fields that name the arm in its rows (``{"setting": ..., "arm": ...}``); empty:
    ``{"arm": name}``."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "overrides", tuple(self.overrides))
        object.__setattr__(self, "seeds", tuple(self.seeds))
        object.__setattr__(self, "fields", dict(self.fields) or {"arm": self.name})
        if self.repeats < 1:
            raise ValueError(f"arm {self.name}: repeats must be at least 1, not {self.repeats}")


@dataclass(frozen=True)
class Trial:
    """One run of an arm: a seed and a repeat."""

    arm: Arm
    seed: int | None = None
    repeat: int = 0

    @property
    def name(self) -> str:
        """The run directory's name: the arm's, ``-seed<seed>`` and, where the arm repeats, ``-r<repeat>``."""
        seed = "" if self.seed is None else f"-seed{self.seed}"
        return f"{self.arm.name}{seed}" + (f"-r{self.repeat}" if self.arm.repeats > 1 else "")

    @property
    def fields(self) -> dict:
        """The fields that name this trial in its row: the arm's, ``seed`` and (where the arm
        repeats) ``repeat``."""
        fields = dict(self.arm.fields)
        if self.seed is not None:
            fields["seed"] = self.seed
        if self.arm.repeats > 1:
            fields["repeat"] = self.repeat
        return fields

    @property
    def args(self) -> list[str]:
        """Its ``tba train`` overrides: the runtime, the arm's overrides, the seed."""
        runtime = [f"--runtime.type={self.arm.runtime}"] if self.arm.runtime else []
        seed = [f"--run.seed={self.seed}"] if self.seed is not None else []
        return [*runtime, *self.arm.overrides, *seed]

    def train(self, out: Path, extra: Sequence[str] = (), **kwargs) -> TrainRun:
        """:func:`harness.runs.train` of this trial into ``out``/:attr:`name`: the arm's config,
        :attr:`args`, then ``extra``; ``kwargs`` go to :func:`harness.runs.train`."""
        return train([*self.args, *extra], out, self.name, config=self.arm.config, **kwargs)


def trials(arms: Iterable[Arm], order: str = "arm") -> list[Trial]:
    """Every trial of ``arms`` in the study's ``order`` (:data:`ORDERS`)."""
    arms = list(arms)
    if order not in ORDERS:
        raise ValueError(f"unknown order {order!r}: one of {', '.join(ORDERS)}")
    if order == "arm":
        return [Trial(a, s, r) for a in arms for s in a.seeds for r in range(a.repeats)]
    rounds = dict.fromkeys((s, r) for a in arms for s in a.seeds for r in range(a.repeats))
    out = []
    for i, (seed, repeat) in enumerate(rounds):
        these = [a for a in arms if seed in a.seeds and repeat < a.repeats]
        if order == "abba" and i % 2:
            these.reverse()
        out += [Trial(a, seed, repeat) for a in these]
    return out


class Results:
    """A study's rows in a JSON file, saved after every trial.

    ``key``: the fields that tell rows apart (a row again replaces the one with its key);
    ``section``: where the rows are in the file (``("runs",)``: ``{"runs": [...]}``; nested keys
    for a file of several studies; empty: the file is the list itself); ``head``: what is written
    beside the rows (the machine, the settings); ``fresh``: forget the rows already there (the file's
    other sections stay). Unless ``fresh``, a save keeps the rows that another invocation wrote
    meanwhile (one file, several queues)."""

    def __init__(
        self,
        path: Path,
        key: Sequence[str],
        *,
        section: Sequence[str] = ("runs",),
        head: Mapping[str, Any] | None = None,
        fresh: bool = False,
    ) -> None:
        self.path, self.key, self.section = Path(path), tuple(key), tuple(section)
        self.head = dict(head or {})
        if self.head and not self.section:
            raise ValueError("a file that is the list of rows has no room for a head")
        self.fresh = fresh
        self.rows: list[dict] = [] if fresh else self.read()

    def _data(self) -> Any:
        return json.loads(self.path.read_text()) if self.path.is_file() else None

    def read(self) -> list[dict]:
        """The rows in the file now; none where there is no file or no section."""
        data = self._data()
        for k in self.section:
            data = data.get(k) if isinstance(data, dict) else None
        return list(data) if isinstance(data, list) else []

    def key_of(self, row: Mapping) -> tuple:
        return tuple(row.get(k) for k in self.key)

    def done(self, trial: Trial) -> bool:
        """Whether a row of ``trial`` is kept without an error."""
        key = self.key_of(trial.fields)
        return any(self.key_of(r) == key and "error" not in r for r in self.rows)

    def put(self, row: dict) -> None:
        """Keep ``row`` in place of any row with its key."""
        key = self.key_of(row)
        self.rows = [r for r in self.rows if self.key_of(r) != key] + [row]

    def save(self) -> None:
        """Write the rows (with another invocation's, unless ``fresh``) and the head."""
        if not self.fresh:
            mine = {self.key_of(r) for r in self.rows}
            self.rows = self.rows + [r for r in self.read() if self.key_of(r) not in mine]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not self.section:
            self.path.write_text(json.dumps(self.rows, indent=1) + "\n")
            return
        data = self._data()
        data = data if isinstance(data, dict) else {}
        parent = data
        for k in self.section[:-1]:
            if not isinstance(parent.get(k), dict):
                parent[k] = {}
            parent = parent[k]
        parent.update(self.head)
        parent[self.section[-1]] = self.rows
        self.path.write_text(json.dumps(data, indent=1) + "\n")


def _json_line(row: dict) -> str:
    return json.dumps(row)


def run_study(
    arms: Iterable[Arm],
    run: Callable[[Trial], dict],
    results: Results | None = None,
    *,
    order: str = "arm",
    resume: bool = True,
    echo: Callable[[dict], str | None] | None = _json_line,
) -> list[dict]:
    """Run every trial of ``arms`` in ``order`` through ``run`` (a trial to its row), one after
    another; return the rows (``results``' rows, the earlier ones included).

    Each row gets the trial's :attr:`Trial.fields` where it lacks them, is printed as ``echo`` makes
    it (None: not printed), and is kept in ``results`` and saved at once. ``resume``: a trial whose
    row is kept without an error is not run again; otherwise every trial runs and its row replaces
    the kept one."""
    rows: list[dict] = []
    for trial in trials(arms, order):
        if resume and results is not None and results.done(trial):
            continue
        row = dict(run(trial))
        for k, v in trial.fields.items():
            row.setdefault(k, v)
        if echo is not None and (line := echo(row)):
            print(line, flush=True)
        if results is None:
            rows.append(row)
        else:
            results.put(row)
            results.save()
    return rows if results is None else results.rows


STATS = ("spread", "std", "mean", "first", "each")
"""What a :class:`Column`'s cell makes of an arm's values: ``spread``, mean ± the sample standard
deviation (the mean alone for one value; :func:`harness.report.spread`); ``std``, the same with
``± 0`` for one value; ``mean``; ``first``, the first row's; ``each``, every value, joined by the
column's ``sep``. Rows without a value (missing or None) are left out; a cell with none is "-"
(``each``: empty)."""


@dataclass(frozen=True)
class Column:
    """A column of :func:`table`: its header and how its cell is made from an arm's rows."""

    header: str
    key: str | Callable[[dict], Any] | None = None
    """A row's value: a field, or a function of the row (None where it has none)."""
    stat: str = "spread"
    """One of :data:`STATS`."""
    spec: str = ".3f"
    """The values' format."""
    suffix: str = ""
    """After each formatted mean (``spread``, ``std``, ``mean``)."""
    sep: str = ", "
    """Between the values of ``each``."""
    align: str = "l"
    """``l`` or ``r`` (:func:`harness.report.rule`)."""
    cell: Callable[[list[dict]], str] | None = None
    """The cell from the arm's rows, instead of ``key`` and ``stat``."""

    def __post_init__(self) -> None:
        if self.stat not in STATS:
            raise ValueError(f"column {self.header!r}: unknown stat {self.stat!r}: one of {', '.join(STATS)}")
        if self.key is None and self.cell is None:
            raise ValueError(f"column {self.header!r} needs a key or a cell")

    def values(self, rows: Iterable[dict]) -> list:
        get = self.key if callable(self.key) else (lambda r: r.get(self.key))
        return [v for r in rows if (v := get(r)) is not None]

    def render(self, rows: list[dict]) -> str:
        if self.cell is not None:
            return self.cell(rows)
        values = self.values(rows)
        if self.stat == "each":
            return self.sep.join(format(v, self.spec) for v in values)
        if not values:
            return "-"
        if self.stat == "first":
            return format(values[0], self.spec)
        if self.stat == "mean":
            return format(statistics.mean(values), self.spec) + self.suffix
        return spread(values, self.spec, self.suffix, always_std=self.stat == "std")


SEEDS = Column("seeds", "seed", "each", "", sep=",")
"""The seeds of an arm's rows, as ``0,1,2``."""


def groups(rows: Iterable[dict], by: Sequence[str]) -> list[list[dict]]:
    """``rows`` grouped by the fields ``by``, the groups in the order of their first row."""
    found: dict[tuple, list[dict]] = {}
    for r in rows:
        found.setdefault(tuple(r.get(k) for k in by), []).append(r)
    return list(found.values())


def table(rows: Iterable[dict], by: Sequence[str], columns: Sequence[Column]) -> str:
    """A markdown table of one row per arm (the rows that share the fields ``by``, in the order of
    their first row). Rows with an ``error`` are left out of the cells; an arm with nothing else
    shows its first ``len(by)`` cells and its last error's first line."""
    lines = [markdown_row(c.header for c in columns), rule("".join(c.align for c in columns))]
    for rs in groups(rows, by):
        done = [r for r in rs if "error" not in r]
        if done:
            cells = [c.render(done) for c in columns]
        else:
            error = str(rs[-1]["error"]).strip().splitlines()
            cells = [c.render(rs) for c in columns[: len(by)]] + [error[0] if error else "failed"]
            cells += [""] * (len(columns) - len(cells))
        lines.append(markdown_row(cells))
    return "\n".join(lines)


def setting_arms(
    setting: str, table_of_arms: Mapping[str, tuple[str, list[str]]], names: Sequence[str], seeds
) -> list[Arm]:
    """The arms ``names`` of ``table_of_arms`` (name -> runtime and overrides) in ``setting`` of
    :data:`harness.settings.SETTINGS` (its config file, if it names one, and its overrides first)."""
    args = list(SETTINGS[setting])
    config = args.pop(0) if args and args[0].endswith(".yaml") else None
    return [
        Arm(
            f"{setting}-{name}",
            table_of_arms[name][0],
            [*args, *table_of_arms[name][1]],
            config,
            seeds,
            fields={"setting": setting, "arm": name},
        )
        for name in names
    ]
