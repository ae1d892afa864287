"""Configuration errors: one line per problem, naming the dotted key and what to do."""

from __future__ import annotations

import difflib
from typing import get_args

from pydantic import BaseModel, ValidationError

from tba.config.task import TASK_NAMES
from tba.errors import UserError


class ConfigError(UserError, ValueError):
    """A configuration file or override is invalid; the message says which key and why."""


def format_error(err: ValidationError) -> str:
    """One line per problem, naming the dotted key: ``trainer.lrr: unknown key (did you mean trainer.lr?)``."""
    lines = []
    for e in err.errors():
        loc = [str(p) for p in e["loc"]]
        section = section_class(loc[:-1])
        if len(loc) > 1 and loc[0] == "task" and loc[1] in TASK_NAMES:
            del loc[1]  # the union's tag: the user wrote task.path, not task.dataset.path
        path = ".".join(loc)
        if e["type"] == "extra_forbidden":
            close = difflib.get_close_matches(loc[-1], list(section.model_fields) if section else [], n=1)
            hint = f"did you mean {'.'.join([*loc[:-1], close[0]])}?" if close else "remove it"
            line = f"{path}: unknown key ({hint})"
        elif e["type"] == "value_error":  # a validator's own message names its keys and the fix
            message = e["msg"].removeprefix("Value error, ")
            line = f"{path}: {message}" if path else message
        else:
            line = f"{path}: {e['msg']} (got {e.get('input')!r})"
        lines.append(line)
    if len(lines) == 1:
        return f"invalid configuration: {lines[0]}"
    return "invalid configuration:\n" + "\n".join(f"  {line}" for line in lines)


def section_class(loc: list[str]) -> type[BaseModel] | None:
    """The config class at a key path (``["trainer"]`` → TrainerConfig; ``["task", "dataset"]`` → DatasetTaskConfig)."""
    from tba.config.schema import Config  # the root of the key paths (it imports every section)

    cls: type[BaseModel] = Config
    for i, part in enumerate(loc):
        if i == 1 and loc[0] == "task":
            continue  # the union's tag, resolved with "task" below
        field = cls.model_fields.get(part)
        if field is None:
            return None
        candidates = [a for a in get_args(field.annotation) or (field.annotation,) if isinstance(a, type)]
        if part == "task":
            tag = loc[1] if len(loc) > 1 else "arithmetic"
            candidates = [c for c in candidates if c.model_fields["name"].default == tag]
        models = [c for c in candidates if issubclass(c, BaseModel)]
        if not models:
            return None
        cls = models[0]
    return cls
