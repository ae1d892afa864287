"""The configuration reference: every key of a run's config with its type, default and meaning,
read from the pydantic schema and the docstring under each field (``tba.config``), so that it is
never out of date. The docs site renders it (``docs/hooks.py``); ``tests/test_docs.py`` checks that
it holds every key ``tba train --print-config`` prints."""

from __future__ import annotations

import json
import types
import typing
from typing import Any, Literal

from pydantic import BaseModel

from tba.config import TASK_NAMES, Config


def _members(annotation: Any) -> tuple:
    """The classes of a union, through ``Annotated`` (pydantic may keep or strip it)."""
    if typing.get_origin(annotation) is typing.Annotated:
        annotation = typing.get_args(annotation)[0]
    return typing.get_args(annotation)


_TASK_CLASSES = {
    name: cls
    for cls in _members(Config.model_fields["task"].annotation)
    for name in typing.get_args(cls.model_fields["name"].annotation)
}


def task_classes() -> dict[str, type[BaseModel]]:
    """The config class of each ``task.name``."""
    return dict(sorted(_TASK_CLASSES.items(), key=lambda item: TASK_NAMES.index(item[0])))


def type_name(annotation: Any) -> str:
    """A field's type as a reader wants it: ``float | None``, ``hf | vllm``, ``list[int]``."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is Literal:
        return " \\| ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(type_name(a) for a in args)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin in (list, dict, tuple):
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "None"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return "section"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True)
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _describe(text: str | None) -> str:
    return " ".join((text or "").split()).replace("|", "\\|")


def rows(model: type[BaseModel], prefix: str) -> list[tuple[str, str, str, str]]:
    """(key, type, default, meaning) of each field of ``model`` under ``prefix``, nested sections
    expanded in place."""
    out = []
    for name, field in model.model_fields.items():
        key = f"{prefix}.{field.alias or name}"
        out.append((key, type_name(field.annotation), _default(field), _describe(field.description)))
        nested = [a for a in (field.annotation, *typing.get_args(field.annotation)) if _is_section(a)]
        if nested:
            out.extend(rows(nested[0], key))
    return out


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def keys() -> set[str]:
    """Every key the reference documents."""
    found = {key for section in Config.model_fields if section != "task" for key, *_ in _section_rows(section)}
    for cls in task_classes().values():
        found |= {key for key, *_ in rows(cls, "task")}
    return found


def _section_rows(section: str) -> list[tuple[str, str, str, str]]:
    return rows(Config.model_fields[section].annotation, section)


def _table(entries: list[tuple[str, str, str, str]]) -> str:
    lines = ["| key | type | default | what it does |", "|---|---|---|---|"]
    lines += [f"| `{key}` | {kind} | {default} | {text} |" for key, kind, default, text in entries]
    return "\n".join(lines)


def reference_markdown() -> str:
    """The whole reference, one table per section (``task``: one per task type)."""
    parts = []
    for section in Config.model_fields:
        if section == "task":
            for name, cls in task_classes().items():
                doc = _describe(cls.__doc__)
                parts.append(
                    "\n\n".join(filter(None, [f"## `task` with `name: {name}`", doc, _table(rows(cls, "task"))]))
                )
            continue
        cls = Config.model_fields[section].annotation
        doc = _describe(cls.__doc__)
        parts.append("\n\n".join(filter(None, [f"## `{section}`", doc, _table(_section_rows(section))])))
    return "\n\n".join(parts) + "\n"
