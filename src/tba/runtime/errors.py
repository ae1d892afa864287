"""Errors a runtime reports to the command line (no heavy imports here)."""


class RunFailed(RuntimeError):
    """A process of the run (a searcher, a trainer rank) raised or died; the run stopped, and what it
    wrote is kept. The message says which and why."""


class SearcherFailed(RunFailed):
    """A searcher process raised or vanished; the message carries its traceback."""


class TrainerRankFailed(RunFailed):
    """A trainer rank (``trainer.num_ranks`` > 1) raised or died."""
