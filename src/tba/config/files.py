"""Building a configuration: defaults, then a YAML file, then overrides, validated once; and back to YAML."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from tba.config.errors import ConfigError, format_error
from tba.config.overrides import merge, parse_overrides
from tba.config.schema import Config


def build_config(data: dict[str, Any]) -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(format_error(err)) from None


def with_values(cfg: Config, values: dict[str, Any]) -> Config:
    """``cfg`` with the dotted keys of ``values`` set (``{"run.device": "cuda"}``), validated anew."""
    data = cfg.model_dump(mode="json", by_alias=True)
    for key, value in values.items():
        *path, leaf = key.split(".")
        node = data
        for part in path:
            node = node[part]
        node[leaf] = value
    return build_config(data)


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """Defaults, then the YAML file at ``path``, then ``--section.key=value`` overrides."""
    data: dict[str, Any] = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {path} does not exist")
        try:
            loaded = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            where = getattr(err, "problem_mark", None)
            line = f" at line {where.line + 1}" if where is not None else ""
            raise ConfigError(
                f"{path} is not valid YAML{line}: {getattr(err, 'problem', None) or err}; fix the file"
            ) from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"{path} must hold a mapping of sections, got {type(loaded).__name__}")
        data = loaded
    if overrides:
        data = merge(data, parse_overrides(overrides))
    return build_config(data)


def dump_config(config: Config) -> str:
    return yaml.safe_dump(config.model_dump(mode="json", by_alias=True), sort_keys=False)


def _file_spec(spec: str) -> str:
    """``path/to/file.py:name`` with the file's absolute path (a module name stays as it is)."""
    file, sep, name = spec.rpartition(":")
    if sep and file.endswith(".py") and Path(file).expanduser().is_file():
        return f"{Path(file).expanduser().resolve()}:{name}"
    return spec


def absolute_paths(cfg: Config) -> Config:
    """Local dataset files, the files of reward functions, tools, environments and agents, and model
    folders as absolute paths (``~``
    expanded), so that searcher processes (whose working directory may differ) and a repeated run
    find them, and a config file can name a model in the user's home."""
    t = cfg.task
    updates: dict = {}
    for key in ("path", "eval_path"):
        value = getattr(t, key, None)
        if value and Path(value).expanduser().exists():
            updates[key] = str(Path(value).expanduser().resolve())
    for key in ("reward_funcs", "tools"):
        if getattr(t, key, None):
            updates[key] = [_file_spec(spec) for spec in getattr(t, key)]
    for key in ("environment", "agent", "env"):
        if getattr(t, key, None):
            updates[key] = _file_spec(getattr(t, key))
    models = {
        key: str(Path(value).expanduser().resolve())
        for key in ("policy", "reference", "tokenizer", "cache_dir")
        if (value := getattr(cfg.model, key)) and Path(value).expanduser().exists()
    }
    if not updates and not models:
        return cfg
    return cfg.model_copy(update={"task": t.model_copy(update=updates), "model": cfg.model.model_copy(update=models)})
