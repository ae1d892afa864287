"""Record the batches a run's trainer steps on, and replay them through an in-process trainer.

Splits "the data" from "the runtime": if a ray run's batches, replayed in order from the same
starting weights by a trainer in this process, give the ray trainer's losses step for step, the
ray process computes what a sync trainer would, and any difference between the runtimes is in
the data they train on.

    .venv/bin/python benchmarks/word_problems/replay.py record /tmp/ray_s0.pkl -- \\
        benchmarks/word_problems/run.yaml --model.policy=$HOME/.cache/tba/smollm2-135m-instruct \\
        --runtime.type=ray --run.name=ray_s0 --run.output_dir=/tmp/runs
    .venv/bin/python benchmarks/word_problems/replay.py replay /tmp/ray_s0.pkl /tmp/runs/ray_s0

``record`` runs ``tba train`` with the given arguments and pickles (version, batch) for every
trainer step; ``replay`` builds the recorded run's trainer (its ``config.yaml``, in the sync
runtime, without a searcher), steps it on each batch, prints its metrics beside the recorded
ones, and the distance of its final weights from the recorded run's.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

KEYS = ("train/loss", "train/kl", "train/reward_mean", "train/grad_norm")


def record(out: Path, train_args: list[str]) -> int:
    from tba import cli
    from tba.trainer import Trainer

    recorded = []
    step = Trainer.step

    def recording_step(self, batch=None):
        if batch is None:
            batch = self.buffer.sample(self.cfg.batch_prompts, self.group_size)
        recorded.append((self.version, batch))
        return step(self, batch)

    Trainer.step = recording_step
    try:
        return cli.main(["train", *train_args])
    finally:
        with open(out, "wb") as f:
            pickle.dump(recorded, f)
        print(f"{len(recorded)} batches in {out}")


def replay(batches_path: Path, run: Path) -> int:
    from rich.console import Console
    from safetensors.torch import load_file

    from tba.config import absolute_paths, load_config
    from tba.metrics import read_metrics
    from tba.plan import make_plan
    from tba.runtime.build import build_components
    from tba.runtime.run_dir import open_run

    with open(batches_path, "rb") as f:
        batches = pickle.load(f)
    logged = {row["step"]: row for row in read_metrics(run / "metrics.jsonl") if "train/loss" in row}
    cfg = load_config(str(run / "config.yaml"), ["--runtime.type=sync", f"--run.name={run.name}-replay"])
    cfg, _, prepared, plan = open_run(cfg, Console(stderr=True), make_plan(absolute_paths(cfg)))
    c = build_components(cfg, plan, lambda m: None, with_searcher=False, prepared=prepared)
    start = {k: v.detach().clone() for k, v in c.policy.state_dict().items()}
    c.trainer.publish()
    worst = 0.0
    for version, batch in batches:
        assert c.trainer.version == version, f"batch for version {version}, trainer at {c.trainer.version}"
        mine = c.trainer.step(batch)
        theirs = logged.get(version + 1, {})
        cells = [f"{k.split('/')[1]} {mine[k]:.4f}/{theirs.get(k, float('nan')):.4f}" for k in KEYS if k in mine]
        print(f"step {version + 1}: " + ", ".join(cells), flush=True)
        if "train/loss" in theirs:
            worst = max(worst, abs(mine["train/loss"] - theirs["train/loss"]) / max(abs(theirs["train/loss"]), 1e-12))
    final = sorted((run / "checkpoints").glob("step_*"), key=lambda p: int(p.name.split("_")[1]))
    if final:
        recorded = load_file(str(final[-1] / "model.safetensors"))
        now = c.policy.state_dict()
        keys = [k for k in now if k in recorded]

        def dist(a, b):
            return sum(((a[k].float() - b[k].float()) ** 2).sum().item() for k in keys) ** 0.5

        print(
            f"|w_recorded - w0| {dist(recorded, start):.4f}, |w_replayed - w0| {dist(now, start):.4f}, "
            f"|w_replayed - w_recorded| {dist(now, recorded):.4f} ({len(keys)} tensors)"
        )
    print(f"largest relative loss difference over {len(batches)} steps: {worst:.2e}")
    c.close()
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    r = sub.add_parser("record", help="tba train with these arguments, recording each step's batch")
    r.add_argument("out", type=Path)
    r.add_argument("train_args", nargs=argparse.REMAINDER, help="after --: the arguments of tba train")
    q = sub.add_parser("replay", help="step an in-process trainer on the recorded batches")
    q.add_argument("batches", type=Path)
    q.add_argument("run", type=Path, help="the recorded run's directory")
    a = p.parse_args()
    if a.command == "record":
        args = a.train_args[1:] if a.train_args[:1] == ["--"] else a.train_args
        return record(a.out, args)
    return replay(a.batches, a.run)


if __name__ == "__main__":
    sys.exit(main())
