"""What a run records of its machine (:mod:`tba.machine`): read from the system and the installed
packages' metadata, without importing them; GPUs from ``nvidia-smi`` where there is one."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import torch
import transformers

from tba import machine


def test_the_description_names_the_cpu_the_versions_and_the_commit():
    env = machine.describe_machine()
    assert env["python"] == platform.python_version() and env["torch"] == torch.__version__
    assert env["transformers"] == transformers.__version__
    assert env["cores"] == len(os.sched_getaffinity(0)) and env["cpu"]
    assert set(env["cpu_features"]) <= set(machine.CPU_FEATURES)
    line = machine.machine_line(env)
    assert line.startswith(env["cpu"]) and f"torch {torch.__version__}" in line


def test_describing_the_machine_imports_none_of_the_packages_it_names():
    code = (
        "import sys; from tba.machine import describe_machine; env = describe_machine(); "
        "print(sorted(m for m in ('torch', 'transformers', 'ray', 'vllm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_gpus_are_read_from_nvidia_smi(tmp_path, monkeypatch):
    smi = tmp_path / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        'echo "NVIDIA H100 80GB HBM3, 81559 MiB, 580.95.05"\n'
        'echo "NVIDIA H100 80GB HBM3, 81559 MiB, 580.95.05"\n'
    )
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    gpus = machine.gpus()
    assert gpus == 2 * [{"name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "driver": "580.95.05"}]
    line = machine.machine_line({**machine.describe_machine(), "gpus": gpus})
    assert "NVIDIA H100 80GB HBM3 (driver 580.95.05)" in line


def test_a_missing_or_failing_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi (nor anything else) on the path
    assert machine.gpus() == []
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed: no driver' >&2\nexit 9\n")
    smi.chmod(0o755)
    assert machine.gpus() == []


def test_the_commit_is_none_outside_a_checkout(tmp_path):
    assert machine.git_commit(tmp_path) is None
