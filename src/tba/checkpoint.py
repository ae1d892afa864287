"""Checkpoints: ``<run>/checkpoints/step_<N>/`` holds the policy as a Hugging Face checkpoint
(``from_pretrained`` loads it directly) plus ``trainer_state.pt`` with what resuming needs
(optimizer, LR schedule, step, replay buffer, random states)."""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch


def save_checkpoint(
    run_dir: Path, model, tokenizer, trainer_state: dict, buffer_state: dict, extra: dict | None = None
) -> Path:
    step = trainer_state["version"]
    final = Path(run_dir) / "checkpoints" / f"step_{step}"
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(
        {
            "trainer": trainer_state,
            "buffer": buffer_state,
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
            "extra": extra or {},
        },
        tmp / "trainer_state.pt",
    )
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)  # a checkpoint directory is complete or absent, never half-written
    return final


def latest_checkpoint(run_dir: Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    steps = [
        (int(p.name.split("_")[1]), p)
        for p in root.glob("step_*")
        if p.name.split("_")[1].isdigit() and (p / "trainer_state.pt").is_file()
    ]
    return max(steps)[1] if steps else None


def load_trainer_state(checkpoint: Path) -> dict:
    state = torch.load(Path(checkpoint) / "trainer_state.pt", weights_only=False)
    random.setstate(state["rng"]["python"])
    np.random.set_state(state["rng"]["numpy"])
    torch.set_rng_state(state["rng"]["torch"])
    return state
