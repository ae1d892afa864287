"""Whether a model's passes pack, decided once per model: :func:`choose_packing` at start (the
trainer's and the reference's passes), :func:`can_pack` for a model probed once and asked again."""

from __future__ import annotations

import warnings
import weakref

import torch

from tba.models.packing import Passes, packing_problem, row_tokens


def choose_packing(
    model: torch.nn.Module, width_setting: int | str, setting: str, subject: str, instead: str
) -> Passes:
    """At start, how ``model``'s log-prob passes run: packed in rows of :func:`row_tokens` where
    ``model`` can be packed (the probe included), else padded, with one warning naming the
    ``setting`` that asked for packing, the ``subject``, why, and what happens ``instead``."""
    problem = packing_problem(model)
    if problem is None:
        return Passes(True, row_tokens(model, width_setting))
    warnings.warn(
        f"{setting}: {subject} cannot take packed sequences ({problem}); {instead}. "
        f"Set {setting}=false to choose padding and silence this",
        stacklevel=3,
    )
    return Passes()


_PROBED: weakref.WeakKeyDictionary[torch.nn.Module, bool] = weakref.WeakKeyDictionary()


def can_pack(model: torch.nn.Module) -> bool:
    """:func:`packing_problem` finds none, probe included; probed once per model object (its
    weights may change, its architecture does not)."""
    if model not in _PROBED:
        _PROBED[model] = packing_problem(model) is None
    return _PROBED[model]
