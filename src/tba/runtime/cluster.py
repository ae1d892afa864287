"""Ray for a run, and what each process gets of the machine.

- **Ray**: without ``runtime.address`` a local instance is started (dashboard off, bound to
  localhost), watched by :mod:`tba.runtime.watchdog` (which stops this run's Ray processes if
  ``tba train`` is killed outright) and shut down at the end; with an address the run joins that
  cluster. SIGTERM stops a run as Ctrl-C does.
- **CPUs**: torch thread counts follow the CPUs given to each process (searchers, evaluation, trainer
  ranks, the trainer), so a 2-core machine runs one trainer thread and one searcher thread instead
  of four fighting over two cores.
- **The trainer's GPU**: ``tba train`` trains (and, in the sync runtime, generates and keeps the
  policy copy beside trainer ranks) on ``run.device`` without Ray knowing: a local Ray instance is
  started on every GPU but that one when there are several (:func:`searcher_gpu_ids`). With one
  GPU, trainer and actors share it.
- **Actors' GPU shares** (``runtime.searcher_gpus``, ``eval.eval_gpus``; unset: :func:`gpu_shares`):
  on a CUDA run every searcher (and the evaluation actor of ``eval.async``) takes an equal share of
  the GPUs Ray has left after the trainer ranks: a whole GPU each while there are enough, else 1/n
  of one, n actors to a GPU; with the trainer's GPU as the only one, the trainer counts as one
  more. A share of 0 on a CUDA run is refused: Ray then gives the actor no GPU, and depending on
  its version and ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`` the actor sees none (and cannot start) or
  sees every GPU without Ray counting it (and lands on GPU 0 beside whatever runs there).
- **Inside an actor** Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPUs, so ``run.device=cuda:3``
  means ``cuda:0`` there (:func:`actor_config`).
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import sys

import ray
import torch

from tba.config import Config, ConfigError, build_config, with_values
from tba.errors import interrupt_on_sigterm
from tba.models.loading import resolve_device
from tba.runtime import watchdog as watchdog_module


def init_ray(cfg: Config, trainer_device: torch.device | None = None) -> bool:
    """Join the configured cluster, or start a local instance; True if we started it. A local
    instance gets every GPU but the trainer's when the machine has several (:func:`searcher_gpu_ids`):
    Ray hands GPUs out without knowing that this process trains on one."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if cfg.runtime.address:
        ray.init(address=cfg.runtime.address, **quiet)
        return True  # our connection; ray.shutdown() disconnects without stopping the cluster
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    count = torch.cuda.device_count() if trainer_device is not None and trainer_device.type == "cuda" else 0
    others = searcher_gpu_ids(trainer_device or torch.device("cpu"), visible, count)
    if others is not None:  # Ray's node manager reads the variable when it starts; this process keeps its own
        os.environ["CUDA_VISIBLE_DEVICES"] = others
    try:  # "local": a new instance even when another runs on this machine (Ray would join the latest)
        ray.init(address="local", num_cpus=os.cpu_count(), _node_ip_address="127.0.0.1", **quiet)
    finally:
        if others is not None:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return True


def start_watchdog(cfg: Config) -> subprocess.Popen | None:
    """The watchdog of a local Ray instance this run is about to start (none when joining a cluster)."""
    if cfg.runtime.address or ray.is_initialized() or not sys.platform.startswith("linux"):
        return None
    proc = subprocess.Popen(
        [sys.executable, watchdog_module.__file__, "--pid", str(os.getpid())],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        start_new_session=True,  # a signal to our process group leaves it running to clean up after us
    )
    proc.stdout.readline()  # "ready": it knows which processes existed before Ray's
    return proc


def stop_watchdog(proc: subprocess.Popen | None) -> None:
    """Closing its stdin ends the run for the watchdog: it stops what Ray's shutdown left, then exits."""
    if proc is not None:
        proc.stdin.close()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


def trainer_threads(cfg: Config) -> int:
    if cfg.runtime.trainer_cpus:
        return cfg.runtime.trainer_cpus
    if cfg.runtime.address:  # searchers may be elsewhere: use this machine
        return os.cpu_count() or 1
    taken = searcher_cpus(cfg)
    if cfg.trainer.num_ranks > 1:  # the ranks train; this process evaluates and saves
        taken += cfg.trainer.num_ranks * rank_cpus(cfg)
    return max(1, int((os.cpu_count() or 1) - taken))


@contextlib.contextmanager
def ray_session(cfg: Config):
    """Ray for a run (the ray runtime, and the sync runtime with ``trainer.num_ranks`` > 1): join
    ``runtime.address`` or start a local instance, watched by the watchdog, without the GPU this
    process uses (:func:`driver_device`); SIGTERM unwinds the run; shut down at the end. Yields
    whether this run started the instance."""
    watchdog = start_watchdog(cfg)
    started, old_sigterm = False, None
    try:
        started = init_ray(cfg, driver_device(cfg, resolve_device(cfg.run.device)))
        old_sigterm = interrupt_on_sigterm()  # after ray.init, which installs its own handler
        yield started
    finally:
        if started:
            ray.shutdown()
        stop_watchdog(watchdog)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)


def searcher_cpus(cfg: Config) -> float:
    """The CPUs that the ray runtime reserves for its searchers and its evaluation actor."""
    r = cfg.runtime
    return r.num_searchers * r.searcher_cpus + (cfg.eval.eval_cpus if cfg.eval.async_ else 0)


def rank_cpus(cfg: Config) -> float:
    """``runtime.rank_cpus``, by default the local CPUs that searchers and evaluation leave (one kept
    for the ``tba train`` process in the sync runtime, which generates), split over the ranks."""
    r = cfg.runtime
    if r.rank_cpus is not None:
        return r.rank_cpus
    taken = searcher_cpus(cfg) if r.type == "ray" else 1
    return round(max(1.0, (os.cpu_count() or 1) - taken) / cfg.trainer.num_ranks, 4)


def searcher_gpu_ids(trainer_device: torch.device, visible: str | None, count: int) -> str | None:
    """The GPUs a local Ray instance may hand to searchers, as a ``CUDA_VISIBLE_DEVICES`` value:
    every visible GPU but the trainer's when there are several (None: leave them all, as with one
    GPU, which trainer and searchers then share, or none). ``visible`` is this process's
    ``CUDA_VISIBLE_DEVICES`` (None: all ``count`` GPUs)."""
    if trainer_device.type != "cuda" or count < 2:
        return None
    ids = (
        [v.strip() for v in visible.split(",") if v.strip()] if visible is not None else [str(i) for i in range(count)]
    )
    index = trainer_device.index or 0
    if len(ids) < 2 or index >= len(ids):
        return None
    return ",".join(ids[:index] + ids[index + 1 :])


def driver_device(cfg: Config, device: torch.device) -> torch.device | None:
    """The device of the ``tba train`` process that Ray must not hand out (None: it uses none Ray
    knows of). The ray runtime with trainer ranks keeps its policy copy on the CPU; every other set-up
    trains or generates on ``device`` (the sync runtime with ranks: the engine and the policy copy)."""
    if cfg.runtime.type == "ray" and cfg.trainer.num_ranks > 1:
        return None
    return device if device.type == "cuda" else None


def share_of(actors: int, gpus: float, with_trainer: bool) -> float:
    """One actor's share when ``actors`` share ``gpus`` GPUs (and the trainer too, on the only GPU,
    when ``with_trainer``): a whole GPU each if there are enough, else 1/n of one with n per GPU."""
    if with_trainer:
        return 1.0 / (actors + 1)
    per_gpu = math.ceil(actors / int(gpus))
    return 1.0 if per_gpu == 1 else 1.0 / per_gpu


def gpu_shares(cfg: Config, device: torch.device, ray_gpus: float, trainer_gpu_shared: bool) -> Config:
    """``cfg`` with ``runtime.searcher_gpus`` and ``eval.eval_gpus`` set: as given, else derived from
    the GPUs Ray has (``ray_gpus``; ``trainer_gpu_shared``: they are the trainer's one GPU). A CPU run
    gives actors no GPU. Raises :class:`ConfigError` for a CUDA run whose actors would get none."""
    r, e = cfg.runtime, cfg.eval
    searcher, evaluation = r.searcher_gpus, e.eval_gpus
    if device.type != "cuda":
        return with_values(cfg, {"runtime.searcher_gpus": searcher or 0.0, "eval.eval_gpus": evaluation or 0.0})
    wanted = [("runtime.searcher_gpus", searcher)] + ([("eval.eval_gpus", evaluation)] if e.async_ else [])
    for key, value in wanted:
        if value == 0:
            raise ConfigError(
                f"{key}=0 on a CUDA run (run.device={cfg.run.device}): Ray gives an actor that asks for no GPU "
                "none of its own (it sees no GPU, or all of them uncounted, by Ray's version). Give it a share "
                f"(e.g. {key}=0.5) or leave it unset"
            )
    actors = (r.num_searchers if searcher is None else 0) + (1 if e.async_ and evaluation is None else 0)
    if actors:
        free = ray_gpus - (cfg.trainer.num_ranks if cfg.trainer.num_ranks > 1 else 0)
        if free < 1:
            raise ConfigError(
                f"run.device={cfg.run.device}: Ray has {ray_gpus:g} GPU(s) and the trainer ranks take "
                f"{cfg.trainer.num_ranks}, leaving none for the searchers{' and evaluation' if e.async_ else ''}; "
                "set runtime.searcher_gpus (and eval.eval_gpus) to share theirs, or lower trainer.num_ranks"
            )
        share = share_of(actors, free, trainer_gpu_shared and cfg.trainer.num_ranks == 1)
        searcher = share if searcher is None else searcher
        evaluation = share if evaluation is None and e.async_ else evaluation
    return with_values(cfg, {"runtime.searcher_gpus": searcher, "eval.eval_gpus": evaluation or 0.0})


def actor_config(cfg_data: dict, gpu_ids: list) -> Config:
    """The config an actor builds its parts from: ``run.device=cuda:N`` becomes ``cuda`` when Ray has
    given the actor GPUs (``gpu_ids``, from ``ray.get_gpu_ids()``), which it numbers from 0."""
    cfg = build_config(cfg_data)
    if gpu_ids and cfg.run.device.startswith("cuda:"):
        cfg = with_values(cfg, {"run.device": "cuda"})
    return cfg


def one_engine_at_a_time(cfg: Config, device: torch.device, trainer_gpu_shared: bool) -> bool:
    """Whether the ray runtime starts its vLLM actors one after another, each before the trainer
    uses the GPU: when an engine shares its GPU (with the trainer, or with other actors). vLLM sizes
    its KV cache from the free memory it sees while it profiles (charging to itself whatever another
    process allocates meanwhile, and failing if another frees memory meanwhile)."""
    if device.type != "cuda" or cfg.generation.backend != "vllm":
        return False
    shares = [cfg.runtime.searcher_gpus or 0.0] + ([cfg.eval.eval_gpus or 0.0] if cfg.eval.async_ else [])
    return trainer_gpu_shared or any(0 < share < 1 for share in shares)
