"""Errors a runtime reports to the command line (no heavy imports here)."""


class SearcherFailed(RuntimeError):
    """A searcher process raised or vanished; the message carries its traceback."""
