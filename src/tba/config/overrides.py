"""Command line overrides (``--section.key=value``) as a nested dict, and merging it over a file's."""

from __future__ import annotations

from typing import Any

import yaml

from tba.config.errors import ConfigError


def parse_overrides(args: list[str]) -> dict[str, Any]:
    """Turn ``["--a.b=1", "--c.d", "x"]`` into a nested dict; values are parsed as YAML scalars."""
    tree: dict[str, Any] = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--"):
            raise ConfigError(f"expected an override like --section.key=value, got {arg!r}")
        key, sep, raw = arg[2:].partition("=")
        if not sep:
            if i + 1 >= len(args) or args[i + 1].startswith("--"):
                raise ConfigError(f"override --{key} has no value; write --{key}=VALUE")
            raw = args[i + 1]
            i += 1
        i += 1
        parts = key.split(".")
        if not all(parts):
            raise ConfigError(f"malformed override key {key!r}")
        node = tree
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {key!r} conflicts with an earlier one")
        node[parts[-1]] = override_value(raw)
    return tree


def override_value(raw: str) -> Any:
    """An override's value as YAML reads it (``3e-4``, ``[a, b]``, ``null``); text that is not valid
    YAML as it stands (``*``, ``"+-``) is taken as the plain string it was typed as."""
    if raw == "":
        return ""
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def merge(base: dict[str, Any], update: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = value
    return out
