"""User code named in a config: loading it from a spec, and calling it when it is ``async``.

Reward functions (``task.reward_funcs``), tools (``task.tools``) and environments
(``task.environment``) are all named the same way and called through the same bridge.

Naming
    ``"pkg.module:name"`` imports ``pkg.module`` (from ``base`` too, when the package lives there
    but is not on ``sys.path``: console scripts do not put the current directory there);
    ``"path/to/file.py:name"`` loads that file, a relative path being resolved against ``base``
    (default: the current directory). ``name`` may be dotted (``module:scorer.score``). Every
    problem raises the caller's error class with one message style: what the config names, the
    spec, what is wrong, and what to do.

Calling
    :func:`resolve` turns what user code returned into a value: a coroutine (an ``async def``
    function's result, or any awaitable) runs to its end on one long-lived event loop per process,
    in a daemon thread. Not ``asyncio.run`` per call: async clients that user code keeps between
    calls (httpx, aiohttp, openai) bind to the loop they first ran on and break on a fresh one; and
    its own thread makes it usable from a thread whose event loop is already running.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
import threading
import traceback
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any


def load_object(spec: str, what: str, error: type[Exception], base: str | Path | None = None) -> Any:
    """The object ``spec`` names (``module:name`` or ``path.py:name``, see the module docstring).

    ``what`` is how messages name the setting (``"reward function"``, ``"task.tools"``); ``error``
    is the exception class raised, with a message that says what is wrong and what to do."""
    base = Path(base).expanduser() if base is not None else Path.cwd()
    where, attr = split_spec(spec, what, error)
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(spec, where, base, what, error)
    else:
        module = _import_module(spec, where, attr, base, what, error)
    target: Any = module
    for part in attr.split("."):
        if not hasattr(target, part):
            defined = ", ".join(defined_names(module)) or "nothing public"
            raise error(
                f"{what} {spec!r}: {where} has no attribute {attr!r}; it defines: {defined}. Fix the name after ':'"
            )
        target = getattr(target, part)
    return target


def split_spec(spec: str, what: str, error: type[Exception]) -> tuple[str, str]:
    """``(module or path, dotted name)`` of ``spec``."""
    where, sep, attr = str(spec).rpartition(":")
    # rpartition keeps Windows drive letters in the path; the name part must be a dotted name
    if not sep or not where or not all(part.isidentifier() for part in attr.split(".")):
        raise error(f"{what} {spec!r} is malformed; write 'pkg.module:name' or 'path/to/file.py:name'")
    return where, attr


def defined_names(module: ModuleType) -> list[str]:
    """Public functions, classes and callables that ``module`` itself defines (not what it imports)."""
    names = []
    for key, value in vars(module).items():
        if not key.startswith("_") and callable(value) and getattr(value, "__module__", None) == module.__name__:
            names.append(key)
    return sorted(names)


class FirstFailures:
    """The first failure of each kind, each handed out once (what goes to ``errors.log``: a run
    that fails the same way ten thousand times writes it once)."""

    def __init__(self) -> None:
        self.reported: set[str] = set()
        self.new: list[str] = []

    def note(self, kind: str, text: str) -> None:
        if kind not in self.reported:
            self.reported.add(kind)
            self.new.append(text)

    def take(self) -> list[str]:
        """The failures noted since the last call."""
        out, self.new = self.new, []
        return out


def describe_exception(exc: BaseException) -> str:
    """``Type: message (at file:line in function)``: the exception and the last line of its traceback."""
    text = f"{type(exc).__name__}: {exc}"
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if not f.filename.startswith("<frozen")]
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name})"
    return text


def _import_module(spec: str, name: str, attr: str, base: Path, what: str, error: type[Exception]) -> ModuleType:
    try:
        return _import_from(name, base)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (name == exc.name or name.startswith(exc.name + ".")):
            raise error(
                f"{what} {spec!r}: cannot import module {name!r} ({type(exc).__name__}: {exc}); install it or put the "
                f"directory holding it on PYTHONPATH, or name the file: 'path/to/{name.replace('.', '/')}.py:{attr}'"
            ) from exc
        raise _import_raised(spec, name, exc, what, error) from exc
    except Exception as exc:
        raise _import_raised(spec, name, exc, what, error) from exc


def _import_raised(spec: str, name: str, exc: BaseException, what: str, error: type[Exception]) -> Exception:
    return error(
        f"{what} {spec!r}: importing module {name!r} raised {describe_exception(exc)}; "
        "fix the module, or install what it imports"
    )


def _import_from(name: str, base: Path) -> ModuleType:
    """Import ``name``; when it is not on sys.path but lives in ``base``, add ``base`` and retry.

    ``base`` stays on sys.path so that the module's own imports and pickling by module name (Ray
    actors receive user functions that way) keep working."""
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        top = name.partition(".")[0]
        here = (base / top).is_dir() or (base / f"{top}.py").is_file()
        if exc.name != top or not here or str(base) in sys.path:
            raise
    sys.path.insert(0, str(base))
    importlib.invalidate_caches()
    return importlib.import_module(name)


def _load_file(spec: str, where: str, base: Path, what: str, error: type[Exception]) -> ModuleType:
    path = Path(where).expanduser()
    path = (path if path.is_absolute() else base / path).resolve()
    if not path.is_file():
        raise error(
            f"{what} {spec!r}: file {str(path)!r} does not exist; fix the path "
            f"(a relative path is resolved against {str(base)!r})"
        )
    # The resolved path in the name keeps two files called rewards.py apart, and loads one file once
    # even when several specs name it (they then share module state, as imported modules do).
    stem = re.sub(r"\W", "_", path.stem)
    name = f"tba_user_{stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:12]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise error(f"{what} {spec!r}: {str(path)!r} is not a Python file; name a .py file")
    module = importlib.util.module_from_spec(module_spec)
    # Registered before it runs, as the import system does: dataclasses and pickle look modules up by name.
    sys.modules[name] = module
    try:
        module_spec.loader.exec_module(module)
    except (Exception, SystemExit) as exc:
        del sys.modules[name]
        raise error(f"{what} {spec!r}: loading {str(path)!r} raised {describe_exception(exc)}; fix the file") from exc
    return module


# --------------------------------------------------------------------------------------------
# The bridge from synchronous code to async user code

_loop_lock = threading.Lock()
_loop: asyncio.AbstractEventLoop | None = None
_loop_pid: int | None = None


def _async_loop() -> asyncio.AbstractEventLoop:
    """The process's event loop for user code, running in a daemon thread (started on first use)."""
    global _loop, _loop_pid
    with _loop_lock:
        if _loop is None or _loop.is_closed() or _loop_pid != os.getpid():  # a forked child has no loop thread
            _loop, _loop_pid = asyncio.new_event_loop(), os.getpid()
            threading.Thread(target=_loop.run_forever, name="tba-user-async", daemon=True).start()
        return _loop


def resolve(result: Any) -> Any:
    """``result`` itself, or, when it is awaitable, what it gives when awaited on the shared loop."""
    if not inspect.isawaitable(result):
        return result

    async def wait() -> Any:
        return await result

    return asyncio.run_coroutine_threadsafe(wait(), _async_loop()).result()


def call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)``, plain or ``async``, run to its end (see :func:`resolve`)."""
    return resolve(fn(*args, **kwargs))
