"""The figures' formatting: mean and spread over seeds, a value or "-", markdown table rows, and the
machine line every benchmark prints first."""

from __future__ import annotations

import statistics
from collections.abc import Iterable

from tba.machine import describe_machine, machine_line


def mean_std(values: Iterable[float]) -> tuple[float, float]:
    """The mean and the sample standard deviation (0.0 for a single value)."""
    values = list(values)
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def spread(values: Iterable[float], spec: str = ".3f", suffix: str = "", always_std: bool = False) -> str:
    """``mean ± std`` of ``values`` formatted with ``spec`` (``suffix`` after the mean), the mean
    alone for a single value (one seed claims no spread; ``always_std``: ``± 0`` then), or "-"
    where there are none."""
    values = list(values)
    if not values:
        return "-"
    m, s = mean_std(values)
    mean = format(m, spec) + suffix
    return mean if len(values) < 2 and not always_std else f"{mean} ± {format(s, spec)}"


def fmt(value: float | None, spec: str = ".2f") -> str:
    """``value`` formatted with ``spec``, or "-" where there is none."""
    return "-" if value is None else format(value, spec)


def row(cells: Iterable) -> str:
    """A markdown table row."""
    return "| " + " | ".join(str(c) for c in cells) + " |"


def rule(align: str) -> str:
    """A markdown table's header rule, a column per letter of ``align``: ``l`` left, ``r`` right."""
    return "|" + "".join("---:|" if a == "r" else "---|" for a in align)


def print_machine(suffix: str = "") -> dict:
    """Print ``machine: <machine line><suffix>`` (flushed) and return the machine
    (:func:`tba.machine.describe_machine`) for the results."""
    environment = describe_machine()
    print(f"machine: {machine_line(environment)}{suffix}", flush=True)
    return environment


__all__ = ["describe_machine", "fmt", "machine_line", "mean_std", "print_machine", "row", "rule", "spread"]
