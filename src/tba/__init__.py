"""tba: Trajectory Balance with Asynchrony, RL post-training of language models."""

__version__ = "0.1.0"
