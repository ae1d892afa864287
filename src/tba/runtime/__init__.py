"""Runtimes: the only place that knows about processes.

Imports run one way (``tests/test_layers.py`` fails on a cycle): the loops (``sync_loop``,
``async_loop``) → the ray runtime's ``actors`` → ``run_dir`` and ``report`` → ``build`` → the
trainer ``ranks`` → ``policy``, ``sharding``, ``tba.weights.ray``, ``cluster``, ``bounds``,
``restarts`` → the rest of the package, which knows nothing of processes.
"""
