"""Errors that the user can fix: a config value, a path, a model, a dataset, a reward function.

Every such error derives from :class:`UserError` and carries a message that names the problem and
the fix. ``tba train`` prints it on one line and exits with status 2 (the traceback only with
``--debug``); any other exception is a bug in tba or in the environment and keeps its traceback.
"""

from __future__ import annotations

import signal
import sys
import threading
import traceback


class UserError(Exception):
    """Bad input, caught before training starts; the message says what is wrong and what to do."""


def report(err: Exception, debug: bool = False) -> int:
    """Bad input, as every ``tba`` command shows it: its message (what is wrong and what to do) on
    one stderr line, the traceback only with ``--debug``; returns the exit status, 2."""
    if debug:
        traceback.print_exception(err)
    print(f"tba: {err}", file=sys.stderr)
    return 2


class ModelLoadError(UserError, ValueError):
    """A model or tokenizer cannot be found or is not usable (not a causal LM, no EOS token)."""


class RunDirError(UserError, OSError):
    """The run directory cannot be created or reopened (exists, not writable, nothing to resume)."""


class EngineStartError(UserError, RuntimeError):
    """A generation engine (vLLM) did not start: a model it cannot load, or settings it refuses."""


class MissingDependency(UserError, ImportError):
    """An optional package that a setting needs is not installed; the message names the pip command."""


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is so that it unwinds like Ctrl-C; ``tba train`` exits 143."""


_SIGTERM = threading.Event()


def sigterm_received() -> bool:
    """Whether :func:`interrupt_on_sigterm`'s handler has run in this process. A :class:`Terminated`
    raised while Ray waits in native code can come back as a plain ``KeyboardInterrupt``: the exit
    status asks this, not the exception's type."""
    return _SIGTERM.is_set()


def interrupt_on_sigterm():
    """Make SIGTERM unwind the run like Ctrl-C (``finally`` blocks run: logs closed, Ray shut down)
    by raising :class:`Terminated`; returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def terminate(signum, frame):
        _SIGTERM.set()
        raise Terminated(f"signal {signum}")

    return signal.signal(signal.SIGTERM, terminate)
