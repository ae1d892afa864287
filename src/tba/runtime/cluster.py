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
- **Actors' GPU shares** (``runtime.searcher_gpus``, ``eval.eval_gpus``; unset: :func:`tba.plan.actor_gpu_shares`):
  on a CUDA run every searcher (and the evaluation actor of ``eval.async``) takes an equal share of
  the GPUs Ray has left after the trainer ranks: a whole GPU each while there are enough, else 1/n
  of one, n actors to a GPU; with the trainer's GPU as the only one, the trainer counts as one
  more. A share of 0 on a CUDA run is refused: Ray then gives the actor no GPU, and depending on
  its version and ``RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO`` the actor sees none (and cannot start) or
  sees every GPU without Ray counting it (and lands on GPU 0 beside whatever runs there).
- **Inside an actor** Ray sets ``CUDA_VISIBLE_DEVICES`` to the actor's GPUs, so ``run.device=cuda:3``
  means ``cuda:0`` there (:meth:`tba.plan.Plan.in_actor`).
- The thread counts and GPU shares are decided in the run plan (:mod:`tba.plan`); this module starts
  Ray with them.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys

import ray
import torch

from tba.config import RuntimeConfig
from tba.errors import interrupt_on_sigterm
from tba.machine import usable_cores
from tba.plan import Plan
from tba.runtime import watchdog as watchdog_module


def init_ray(
    address: str | None = None,
    trainer_device: torch.device | None = None,
    gpus: int | None = None,
    cpus: int | None = None,
) -> bool:
    """Join the cluster at ``address`` (``runtime.address``), or start a local instance; True if we started it. A local
    instance gets every GPU but the trainer's when the machine has several (:func:`searcher_gpu_ids`):
    Ray hands GPUs out without knowing that this process trains on one. ``gpus`` and ``cpus``: the
    visible GPUs and the usable cores as the run plan counted them (None: ask CUDA, and the OS)."""
    if ray.is_initialized():
        return False
    quiet = {"include_dashboard": False, "log_to_driver": True, "configure_logging": False}
    if address:
        ray.init(address=address, **quiet)
        return True  # our connection; ray.shutdown() disconnects without stopping the cluster
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if trainer_device is None or trainer_device.type != "cuda":
        count = 0
    else:  # the plan's count of visible GPUs, else CUDA's
        count = torch.cuda.device_count() if gpus is None else gpus
    others = searcher_gpu_ids(trainer_device or torch.device("cpu"), visible, count)
    if others is not None:  # Ray's node manager reads the variable when it starts; this process keeps its own
        os.environ["CUDA_VISIBLE_DEVICES"] = others
    try:  # "local": a new instance even when another runs on this machine (Ray would join the latest)
        ray.init(address="local", num_cpus=cpus or usable_cores(), _node_ip_address="127.0.0.1", **quiet)
    finally:
        if others is not None:
            if visible is None:
                os.environ.pop("CUDA_VISIBLE_DEVICES", None)
            else:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible
    return True


def start_watchdog(runtime: RuntimeConfig) -> subprocess.Popen | None:
    """The watchdog of a local Ray instance this run is about to start (none when joining a cluster:
    ``runtime.address``)."""
    if runtime.address or ray.is_initialized() or not sys.platform.startswith("linux"):
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


@contextlib.contextmanager
def ray_session(runtime: RuntimeConfig, plan: Plan):
    """Ray for a run (the ray runtime, and the sync runtime with ``trainer.num_ranks`` > 1): join
    ``runtime.address`` or start a local instance, watched by the watchdog, without the GPU this
    process uses (:func:`driver_device`); SIGTERM unwinds the run; shut down at the end. Yields
    whether this run started the instance."""
    watchdog = start_watchdog(runtime)
    started, old_sigterm = False, None
    try:
        started = init_ray(runtime.address, driver_device(plan), plan.hardware.gpus, plan.hardware.cpus)
        old_sigterm = interrupt_on_sigterm()  # after ray.init, which installs its own handler
        yield started
    finally:
        if started:
            ray.shutdown()
        stop_watchdog(watchdog)
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)


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


def driver_device(plan: Plan) -> torch.device | None:
    """The device of the ``tba train`` process that Ray must not hand out (None: it uses none Ray
    knows of; :attr:`tba.plan.Plan.driver_gpu`)."""
    return plan.torch_device if plan.driver_gpu else None


def one_engine_at_a_time(plan: Plan, trainer_gpu_shared: bool) -> bool:
    """Whether the ray runtime starts its vLLM actors one after another, each before the trainer
    uses the GPU: when an engine shares its GPU (with the trainer, or with other actors). vLLM sizes
    its KV cache from the free memory it sees while it profiles (charging to itself whatever another
    process allocates meanwhile, and failing if another frees memory meanwhile)."""
    if plan.torch_device.type != "cuda" or not plan.engines:  # (engines: vLLM's)
        return False
    shares = [plan.searcher_gpus or 0.0] + ([plan.eval_gpus or 0.0] if plan.eval_actor else [])
    return trainer_gpu_shared or any(0 < share < 1 for share in shares)
