"""The trainer's numeric precision (``trainer.precision``), and the peak memory that it costs.

``fp32``
    fp32 weights, optimizer state and compute: the reference, and the default on CPUs (and on GPUs
    without bfloat16).
``bf16-mixed``
    fp32 *master* weights and AdamW state; the forward and backward passes run in bfloat16 under
    ``torch.autocast``; log-probs come out in fp32. The default on GPUs with bfloat16.
``bf16``
    bfloat16 weights and optimizer state, no master copy. bf16 keeps 8 significant bits, so an
    update smaller than about 1/256 of a weight rounds away: at learning rates of 1e-5 and below
    most updates of a typical weight are lost and the run silently stops learning. Only for
    people who know why they want it; it warns at start.

Why autocast rather than bf16 compute copies of the weights: autocast casts each weight to bf16
as it enters a matmul (once per forward, cached for the backward), so there is one copy of the
weights, the fp32 one, which the optimizer, checkpoints, LoRA and publishing see unchanged; the
ops that need range (softmax, norms, reductions) stay in fp32 by autocast's own op lists; and
nothing has to copy master weights into compute weights after each step. The memory is the same
as with compute copies (fp32 weights + fp32 gradients + two fp32 moments = 16 bytes a trainable
parameter, against 2 + 2 + 4 + 8); activations are bf16 either way. FSDP2's
``MixedPrecisionPolicy(param_dtype=bf16)`` is the sharded form of the same thing.

With LoRA only the adapter trains, so only it needs fp32: the frozen base stays in
``model.dtype`` (PEFT keeps adapters in fp32 when the base is bf16), halving a bf16 base's memory.

Searchers, the reference and evaluation load ``model.dtype`` as before; the trainer's published
weights are cast to it once, at publication.
"""

from __future__ import annotations

import contextlib
import os
import resource
import sys
from dataclasses import dataclass

import torch

from tba.weights import map_shared

PRECISIONS = ("fp32", "bf16-mixed", "bf16")

PURE_BF16_WARNING = (
    "trainer.precision=bf16 trains bfloat16 weights with bfloat16 AdamW state and no fp32 master copy: "
    "an update smaller than ~1/256 of a weight rounds away, so at small learning rates most updates are "
    "lost and the run can stop learning without any error (lost updates). Use trainer.precision=bf16-mixed "
    "unless you know you want this."
)


def resolve_precision(name: str, device: torch.device) -> str:
    """``trainer.precision`` on ``device``, by the run plan's rule (:func:`tba.hardware.resolve_precision_name`):
    ``auto`` is bf16-mixed on a CUDA device with bfloat16, else fp32; bf16 on a GPU without it is refused."""
    from tba.hardware import Hardware, resolve_precision_name

    return resolve_precision_name(name, str(device), Hardware.of_device(device))


@dataclass(frozen=True)
class Precision:
    """How the trainer holds and computes with its weights."""

    mode: str = "fp32"
    device_type: str = "cpu"

    def __post_init__(self) -> None:
        if self.mode not in PRECISIONS:
            raise ValueError(f"precision {self.mode!r} is not one of {', '.join(PRECISIONS)}")

    @classmethod
    def from_config(cls, name: str, device: torch.device) -> Precision:
        return cls(resolve_precision(name, device), device.type)

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype of trainable weights and of the optimizer state."""
        return torch.bfloat16 if self.mode == "bf16" else torch.float32

    def weights_dtype_name(self) -> str:
        """:attr:`weights_dtype` as a ``model.dtype`` name, for loading."""
        return "bfloat16" if self.mode == "bf16" else "float32"

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context of the trainer's forward passes: bf16 autocast for bf16-mixed."""
        if self.mode == "bf16-mixed":
            return torch.autocast(self.device_type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def warn(self, log=print) -> None:
        """Say at start what pure bf16 risks (nothing for the other modes)."""
        if self.mode == "bf16":
            log(f"warning: {PURE_BF16_WARNING}")


def compute_as(model: torch.nn.Module, dtype: torch.dtype) -> contextlib.AbstractContextManager:
    """Run ``model`` as if its weights were ``dtype``: autocast when its floating weights are wider
    (the trainer's fp32 master weights evaluated like the searchers' bf16 copy), else nothing."""
    held = next((p.dtype for p in model.parameters() if p.is_floating_point()), dtype)
    if dtype in (torch.bfloat16, torch.float16) and held == torch.float32:
        device = next(model.parameters()).device
        return torch.autocast(device.type, dtype=dtype)
    return contextlib.nullcontext()


def cast_floats(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """``state`` with its floating tensors in ``dtype`` (None: unchanged); others as they are. Tied
    entries (one memory, two names) are cast once and stay one object (``tba.weights.map_shared``)."""
    if dtype is None:
        return state
    return map_shared(state, lambda v: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v)


# --------------------------------------------------------------------------------------------
# Peak memory


class PeakMemory:
    """The peak memory of this process since the last :meth:`read`, in GiB: CUDA's maximum
    allocated bytes on a CUDA device; on a CPU the peak resident set size (Linux's ``VmHWM``,
    reset through ``/proc/self/clear_refs``; elsewhere the peak since the process started)."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.device = torch.device(device)
        self.reset()

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        with contextlib.suppress(OSError):  # not Linux, or not allowed: the peak since start
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def read(self) -> float:
        """The peak since the last read (or reset), in GiB; starts a new window."""
        if self.device.type == "cuda":
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = cpu_peak_rss_bytes()
        self.reset()
        return peak / 2**30


def cpu_peak_rss_bytes() -> int:
    """The process's peak resident set size in bytes."""
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


def cpu_rss_bytes() -> int:
    """The process's resident set size now, in bytes (Linux; 0 elsewhere)."""
    with contextlib.suppress(OSError):
        with open(f"/proc/{os.getpid()}/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    return 0
