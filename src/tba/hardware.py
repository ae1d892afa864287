"""The machine as a run sees it (:class:`Hardware`: cores, GPUs, bfloat16), and the rules that turn
``auto`` device, dtype and precision settings into concrete ones for it. The run plan
(:mod:`tba.plan`) applies them once per run; model loading applies the same rules to the task's own
models (a red-teaming victim, a reward model)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tba.config import ConfigError
from tba.machine import busy_cores, usable_cores

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Hardware:
    """What a run may use on this machine: CPU cores (those this process may run on: a container's or
    ``taskset``'s limit), visible CUDA GPUs, whether they do bfloat16, and how many of the cores'
    worth other processes kept busy when the run started (``busy``)."""

    cpus: int
    gpus: int = 0
    """GPUs of this machine (of each node, with ``nodes``)."""
    bf16: bool = False
    busy: float = 0.0
    gpu_name: str = ""
    """The first GPU's name as CUDA reports it (the cost model's parts are per kind of GPU)."""
    nodes: int = 1
    """Machines alike in a described cluster (``tba train --print-plan --hardware=2x8xh100``)."""

    @classmethod
    def detect(cls, load: bool = False) -> Hardware:
        """This machine; with ``load``, also what other processes keep busy, watched for a moment
        (:func:`tba.machine.busy_cores`, 0.3 s)."""
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        bf16 = bool(gpus) and torch.cuda.is_bf16_supported()
        name = torch.cuda.get_device_name(0) if gpus else ""
        busy = round(busy_cores(), 2) if load else 0.0
        return cls(cpus=usable_cores(), gpus=gpus, bf16=bf16, busy=busy, gpu_name=name)

    @property
    def busy_cpus(self) -> int:
        """The cores that other processes keep busy, counted whole (one kept 60% busy counts)."""
        return min(self.cpus, int(self.busy + 0.5))

    @classmethod
    def of_device(cls, device: torch.device) -> Hardware:
        """Enough of this machine to resolve a setting for ``device`` (a GPU: does it have bfloat16)."""
        cuda = device.type == "cuda"
        return cls(
            cpus=usable_cores(),
            gpus=(device.index or 0) + 1 if cuda else 0,
            bf16=cuda and torch.cuda.is_bf16_supported(),
        )

    def describe(self) -> str:
        gpus = "no GPU" if not self.gpus else f"{self.gpus} GPU{'s' if self.gpus > 1 else ''}"
        if self.gpus and self.gpu_name:
            gpus += f" ({self.gpu_name})"
        busy = f", {self.busy:.1f} of them busy with other processes" if self.busy_cpus else ""
        machine = f"{self.cpus} CPU core{'s' if self.cpus != 1 else ''}{busy}, {gpus}"
        return machine if self.nodes == 1 else f"{self.nodes} nodes of {machine}"


def resolve_device_name(name: str, hardware: Hardware) -> str:
    """``run.device`` on ``hardware``: ``auto`` is CUDA when there is a GPU, else the CPU."""
    if name == "auto":
        return "cuda" if hardware.gpus else "cpu"
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"run.device={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda" and not hardware.gpus:
        raise ConfigError(f"run.device={name} but no CUDA device is visible; use run.device=cpu (or auto)")
    if device.type == "cuda" and (device.index or 0) >= hardware.gpus:
        raise ConfigError(
            f"run.device={name}, but only {hardware.gpus} GPU(s) are visible (cuda:0 to cuda:{hardware.gpus - 1})"
        )
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"run.device={name}: tba runs on cpu or cuda; use auto, cpu, cuda or cuda:N")
    return str(device)


def resolve_dtype_name(name: str, device: str, hardware: Hardware) -> str:
    """``model.dtype``: ``auto`` is bfloat16 on a GPU that has it, else float32."""
    if name != "auto":
        return name
    return "bfloat16" if device.startswith("cuda") and hardware.bf16 else "float32"


def resolve_precision_name(name: str, device: str, hardware: Hardware) -> str:
    """``trainer.precision``: ``auto`` is bf16-mixed on a GPU with bfloat16, else fp32; a bf16
    precision on a GPU without bfloat16 (before Ampere) is refused."""
    bf16_gpu = device.startswith("cuda") and hardware.bf16
    if name == "auto":
        return "bf16-mixed" if bf16_gpu else "fp32"
    if name.startswith("bf16") and device.startswith("cuda") and not bf16_gpu:
        raise ConfigError(
            f"trainer.precision={name}, but this GPU has no bfloat16 support; use trainer.precision=fp32 (or auto)"
        )
    return name
