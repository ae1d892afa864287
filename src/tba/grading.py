"""Graders of math answers, used as rewards and as evaluation scores.

Two rules:

* ``last_number``: the GSM8K rule used by the TBA authors (Bartoldson et al., 2025, *Trajectory
  Balance with Asynchrony*, arXiv:2503.18929). Drop every comma, find every signed number (integers,
  decimals such as ``3.`` or ``.5``, optionally with a lowercase ``e`` exponent), keep the last one,
  and call the completion correct when it equals the reference's last number exactly as a float.
* ``math_verify``: symbolic equivalence by Hugging Face's ``math-verify`` package (LaTeX and plain
  expressions parsed to SymPy, then compared numerically and symbolically).

``answer_key`` gives the normalised answer each rule sees, so that samples can be majority-voted.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable
from typing import Any

__all__ = [
    "GRADERS",
    "answer_key",
    "extract_last_number",
    "last_number_text",
    "get_grader",
    "grade_last_number",
    "grade_math_verify",
    "gsm8k_reference",
]

# A sign must touch its digits, so the minus of "5 - 3 = 2" is not read as part of "-3". The decimal
# alternative comes first so that "18." and "3.5" are taken whole rather than as "18" or "3".
_NUMBER = re.compile(r"[-+]?(?:[0-9]+\.[0-9]*|\.[0-9]+|[0-9]+)(?:e[-+]?[0-9]+)?")

# math-verify's own default limits (seconds); used only where its signal.alarm timer can work.
_MATH_VERIFY_TIMEOUT_S = 5

# Markers of LaTeX math mode; a reference without any is wrapped in $...$ before parsing.
_LATEX_DELIMITERS = ("$", "\\(", "\\[", "\\boxed")


def last_number_text(text: str) -> str | None:
    """The last signed number in ``text`` after removing commas, as written; None when there is none."""
    matches = _NUMBER.findall(text.replace(",", ""))
    return matches[-1] if matches else None


def extract_last_number(text: str) -> float | None:
    """The last signed number in ``text`` after removing commas, or None when there is none."""
    found = last_number_text(text)
    return None if found is None else float(found)


def gsm8k_reference(answer: str) -> str:
    """The final answer of a GSM8K ``answer`` field: the text after its last ``####``, stripped."""
    if "####" not in answer:
        raise ValueError(
            f"GSM8K answer has no '#### <final answer>' line: {answer[-80:]!r}; "
            "check that the dataset follows GSM8K's schema (the `answer` field ends in '#### N')"
        )
    return answer.rsplit("####", 1)[1].strip()


def grade_last_number(completion: str, reference: str) -> float:
    """1.0 when the last number of ``completion`` equals the last number of ``reference``, else 0.0."""
    expected = extract_last_number(reference)
    if expected is None:
        return 0.0
    return 1.0 if extract_last_number(completion) == expected else 0.0


class _DropDisabledTimeoutWarning(logging.Filter):
    """Drops math-verify's 'Timeout is disabled ...' warning, which we trigger on purpose off the main thread."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Timeout is disabled")


_TIMEOUT_WARNING_FILTER = _DropDisabledTimeoutWarning()


def _load_math_verify() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """Import math-verify on first use (it is an optional dependency) and quiet its timeout warning."""
    try:
        from math_verify import parse, verify
    except ImportError as err:
        raise ImportError("task.grader=math_verify needs the math-verify package: pip install 'tba[math]'") from err
    # The warning is logged (not printed) by these two modules; the filter sits on their loggers, so
    # every other message of math-verify and of the rest of the program is untouched. addFilter
    # ignores a filter already present, so this is safe to repeat.
    for name in ("math_verify.parser", "math_verify.grader"):
        logging.getLogger(name).addFilter(_TIMEOUT_WARNING_FILTER)
    return parse, verify


def _timeout_s() -> int | None:
    """math-verify's timeout, or None where its signal.alarm timer cannot run.

    signal.alarm works only in the main thread, so inside threads (and threaded Ray actors) math-verify
    raises unless the timeout is off. Without it a pathological expression can take long to parse; the
    caller's own deadline is then the guard.
    """
    return _MATH_VERIFY_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_reference(parse: Callable[..., Any], reference: str, timeout_s: int | None) -> list[Any]:
    """Parse a reference answer, reading a bare one (``18``, ``x^2+1``, ``3\\sqrt{2}``) as LaTeX math."""
    text = reference.strip()
    if text and not any(marker in text for marker in _LATEX_DELIMITERS):
        # Without delimiters math-verify reads only the plain-number prefix, e.g. 3 of 3\sqrt{2}.
        parsed = parse(f"${text}$", parsing_timeout=timeout_s)
        if parsed:
            return parsed
    return parse(text, parsing_timeout=timeout_s)


def grade_math_verify(completion: str, reference: str) -> float:
    """1.0 when math-verify finds the completion's answer equivalent to ``reference``, else 0.0.

    Safe in threads and Ray workers: off the main thread the timeouts are disabled (see ``_timeout_s``).
    """
    parse, verify = _load_math_verify()
    timeout_s = _timeout_s()
    gold = _parse_reference(parse, reference, timeout_s)
    if not gold:
        return 0.0
    predicted = parse(completion, parsing_timeout=timeout_s)
    if not predicted:
        return 0.0
    return 1.0 if verify(gold, predicted, timeout_seconds=timeout_s) else 0.0


def _last_number_key(completion: str) -> str | None:
    value = extract_last_number(completion)
    # repr gives one spelling per float; adding 0.0 turns -0.0 into 0.0, which compares equal to it.
    return None if value is None else repr(value + 0.0)


def _math_verify_key(completion: str) -> str | None:
    parse, _ = _load_math_verify()
    parsed = parse(completion, parsing_timeout=_timeout_s())
    return str(parsed[0]) if parsed else None


_ANSWER_KEYS: dict[str, Callable[[str], str | None]] = {
    "last_number": _last_number_key,
    "math_verify": _math_verify_key,
}


def answer_key(completion: str, grader: str) -> str | None:
    """The normalised answer of ``completion`` under ``grader``, for majority voting; None if it has none.

    For ``last_number`` 18, 18.0 and "18." share the key ``"18.0"``. For ``math_verify`` the key is the
    first parsed SymPy expression as a string, so equal values written differently (1/2 and 0.5) may
    get different keys.
    """
    get_grader(grader)  # an unknown name fails here, with the list of known ones
    return _ANSWER_KEYS[grader](completion)


GRADERS: dict[str, Callable[[str, str], float]] = {
    "last_number": grade_last_number,
    "math_verify": grade_math_verify,
}


def get_grader(name: str) -> Callable[[str, str], float]:
    """The grader registered under ``name``."""
    try:
        return GRADERS[name]
    except KeyError:
        raise ValueError(f"unknown grader {name!r}; choose one of: {', '.join(sorted(GRADERS))}") from None
