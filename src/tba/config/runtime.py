"""The ``eval``, ``runtime`` and ``logging`` sections: evaluation, the processes and their placement, metrics."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, model_validator

from tba.config.section import Section


class EvalConfig(Section):
    model_config = ConfigDict(**Section.model_config, validate_by_name=True, validate_by_alias=True)

    every: int = Field(100, ge=1)
    """Evaluate every N steps (also before the first and after the last)."""
    max_new_tokens: int | None = None
    """Generation limit at evaluation; default: generation.max_new_tokens."""
    batch_size: int = Field(256, ge=1)
    """Sequences per generation batch at evaluation."""
    limit: int | None = Field(None, ge=1)
    """Evaluate on the first N problems of the evaluation split only; default: all of them."""
    samples: int = Field(1, ge=1)
    """n > 1 also samples n completions per problem (at generation.temperature and top_p) for pass@k
    and maj@k; needs a task with a success score (arithmetic, gsm8k, or task.success_threshold)."""
    pass_k: list[int] = [1]
    """The k of pass@k and maj@k (each at most ``samples``), estimated without bias from n samples."""
    log_samples: int = Field(4, ge=0)
    """Prompts whose greedy completions, with scores, go to ``samples.jsonl`` at each evaluation."""
    async_: bool = Field(False, alias="async")
    """``eval.async=true`` (ray runtime): evaluate in a Ray actor of its own, on a copy of the weights
    of the step being evaluated, while the trainer goes on; results are logged at that step."""
    eval_cpus: float = Field(1.0, gt=0)
    """CPUs reserved for the evaluation actor (``eval.async``)."""
    eval_gpus: float | None = Field(None, ge=0)
    """GPUs for the evaluation actor (``eval.async``; fractions share one). Default: as a searcher's
    (``runtime.searcher_gpus``), the actor counting as one more."""

    @model_validator(mode="after")
    def _check_k(self) -> EvalConfig:
        if self.samples > 1:
            bad = [k for k in self.pass_k if not 1 <= k <= self.samples]
            if bad:
                raise ValueError(f"pass_k {bad} must lie between 1 and samples={self.samples}")
        return self


class RuntimeConfig(Section):
    type: Literal["auto", "sync", "ray"] = "auto"
    """``ray``: searcher processes generate continuously while the trainer trains (asynchronous);
    ``sync``: one process alternates generate-then-train (time-sliced: the on-policy baseline).
    ``auto`` (the run plan decides, and says why): ``ray`` where the searchers get devices of their
    own (a GPU beyond the trainer's, a Ray cluster to join, ``runtime.searcher_resources``) or a
    setting needs it (``eval.async``); ``sync`` where they would share the trainer's one device (this
    machine's CPU cores, or its only GPU), where generating beside the trainer slows it more than the
    overlap gains, or a setting needs it (``runtime.extra_lag``, ``buffer.fresh_only``)."""
    num_searchers: Annotated[int, Field(ge=1)] | Literal["auto"] = "auto"
    """Searcher actors (``ray`` runtime). ``auto``: one on a CPU machine or a single GPU; on several
    GPUs the split of them between trainer ranks and searchers (one, two or four a GPU) that the
    cost model predicts fastest for the model's size and the batch (``tba.plan.layout``; the plan
    prints it, its predicted step time and the runner-up)."""
    searcher_cpus: float = Field(1.0, gt=0)
    """CPUs reserved per searcher; its torch thread count follows (at least one thread)."""
    searcher_gpus: float | None = Field(None, ge=0)
    """GPUs per searcher (fractions share one). Default: none on a CPU run; on a CUDA run an equal
    share of the GPUs Ray has (a whole one each while there are enough; with one GPU, shared with
    the trainer: 1/(searchers + 1) of it). 0 on a CUDA run is refused (Ray would hide every GPU)."""
    searcher_resources: dict[str, float] = {}
    """Custom Ray resources per searcher, to place searchers on chosen nodes (``{"searcher": 1}``)."""
    trainer_cpus: int | None = Field(None, ge=1)
    """torch threads of the trainer process; default: the local CPUs the searchers leave free."""
    rank_cpus: float | None = Field(None, gt=0)
    """CPUs reserved per trainer rank (``trainer.num_ranks`` > 1); its torch thread count follows (at
    least one thread). Default: the local CPUs that searchers and evaluation leave (one for the
    ``tba train`` process in the sync runtime), split over the ranks."""
    address: str | None = None
    """Ray cluster to join (``auto`` or ``host:port``); default: start a local Ray instance."""
    max_searcher_restarts: int = Field(3, ge=0)
    """How often one searcher whose process died (killed, out of memory, a native crash) is restarted
    within ``restart_window_s`` before the run ends; 0 ends the run at the first death. A Python
    exception in a searcher always ends the run."""
    restart_window_s: float = Field(600.0, gt=0)
    """The window for ``max_searcher_restarts``, in seconds; also how long a dead searcher may take
    to come back."""
    max_lag: int | Literal["auto"] | None = "auto"
    """``ray`` runtime: the trainer takes no step that would put it more than this many versions
    ahead of the oldest weights a live searcher generated its latest batch with, so every batch is
    first trained at most ``max_lag`` steps stale (``buffer/arrival_lag_max``; a restarting searcher
    is left out until it delivers again). At least ``trainer.sync_interval``. ``auto``: 4 ×
    ``trainer.sync_interval``. None: no bound."""

    weight_transport: Literal["auto", "object_store", "broadcast", "ipc"] = "auto"
    """How published weights reach the searchers (``ray`` runtime): ``object_store`` (Ray's object
    store; a searcher on the trainer's machine maps them in place), ``broadcast`` (a gloo group of
    the trainer and the searchers, one byte buffer in buckets; falls back to the object store while a
    searcher restarts; for searchers on other machines), ``ipc`` (two buffers of the trainer's that
    searchers on its machine map: GPU memory by CUDA IPC handles when they share the trainer's GPU,
    shared host memory on a CPU; one trainer rank, no cluster), ``auto``: the object store."""

    max_ahead: int | None = Field(None, ge=1)
    """``ray`` runtime: searchers pause while the groups that have arrived and the trainer has not yet
    drawn (counted as ``trainer.batch_prompts`` a step) exceed this many steps' worth, so that they
    produce no more than the trainer consumes (``searcher/paused_s``). For searchers that share the
    trainer's cores or GPU, which would otherwise take them from its steps to make data it never
    trains on. None: no limit."""

    extra_lag: int = Field(0, ge=0)
    """D > 0 (``runtime.type=sync``): the searcher samples with the weights published D steps
    before the newest (the newest publication at least D steps old), so that data is exactly that
    stale whatever the machine's speed; with ``buffer.fresh_only`` every rollout is D steps old at
    ``trainer.sync_interval=1``. Keeps the last D / sync_interval + 1 publications in memory."""


class LoggingConfig(Section):
    tensorboard: bool = False
    """Also write TensorBoard event files to ``<run>/tensorboard`` (needs ``tensorboard``)."""
    progress: bool = True
    """Show progress while training: a live progress bar and status line on a terminal; elsewhere a
    plain line every ``line_every_s`` seconds and at each evaluation. ``false`` turns off only this
    display; messages (run directory, model loading) still print."""
    every: int = Field(1, ge=1)
    """Write training metrics every N steps."""
    quiet: bool = False
    """Print nothing but errors and the final summary (for scripts): implies ``progress=false`` and
    also silences the messages (run directory, task and model loading, searchers started)."""
    line_every_s: float = Field(30.0, gt=0)
    """Off a terminal (CI, nohup, a log file): print one plain progress line every N seconds (and one
    at each evaluation)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs ``wandb``; ``WANDB_MODE=offline`` works without network)."""
    wandb_project: str = "tba"
    """W&B project."""
    wandb_entity: str | None = None
    """W&B entity (user or team); default: your W&B default."""
    wandb_name: str | None = None
    """W&B run name; default: the run directory's name."""
    wandb_tags: list[str] = []
    """W&B tags."""
