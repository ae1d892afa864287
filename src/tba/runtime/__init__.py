"""Runtimes: the only place that knows about processes."""
