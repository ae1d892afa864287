"""Errors a runtime reports to the command line (no heavy imports here)."""


class RunFailed(RuntimeError):
    """A process of the run (a searcher, a trainer rank) raised or died; the run stopped, and what it
    wrote is kept. The message says which and why."""


class SearcherFailed(RunFailed):
    """A searcher process raised or vanished; the message carries its traceback."""


class TrainerRankFailed(RunFailed):
    """A trainer rank (``trainer.num_ranks`` > 1) raised or died."""


class CouldNotStart(Exception):
    """A searcher's start met bad input (a :class:`tba.errors.UserError`: a model it cannot load, an
    engine that cannot start). The actor keeps it and raises this from its first call, so that it
    reaches the driver as an exception, with its type, not as the text of Ray's traceback."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error
