"""Every kind of objective trains on data whose sampler lags the trainer: finite losses, no skipped
steps, and the sampler's per-token log-probs recorded exactly when the objective needs them. One
of each way the runtime feeds an objective (TB with the band; ratios to the sampler with a
reference, GRPO; PPO's KL-shaped baseline; no sampler log-probs, RLOO; pairs, Online DPO): Dr.
GRPO and proximal RLOO take GRPO's and PPO's path here, and every objective trains in
tests/test_pipeline.py.

The stale data comes from the sync runtime with ``runtime.extra_lag`` (the searcher a fixed number
of versions behind, in this process): the trainer, the buffer and the objective see what the ray
runtime gives them, and the runtime itself does not depend on the objective. One ray run carries
an objective's groups across the process boundary: RLOO's, without sampler log-probs (the ray
runs of the other test files train TB, whose groups carry them)."""

from __future__ import annotations

import math

import pytest
import ray
from tests.conftest import SMALL_DEMO_ARGS, start_local_ray, stored_rollouts

from tba.config import load_config
from tba.metrics import read_metrics
from tba.plan.auto import needs_sampler_logps, stale_by_design, tb_trust_region
from tba.runtime.async_loop import run_ray
from tba.runtime.sync_loop import run_sync

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

STEPS = 8

OBJECTIVES = {
    "tb": ["--objective.type=tb"],
    "grpo": ["--objective.type=grpo", "--objective.kl_coef=0.01"],
    "ppo": ["--objective.type=ppo"],
    "rloo": ["--objective.type=rloo"],
    "online_dpo": ["--objective.type=online_dpo"],
}


@pytest.fixture(scope="module")
def ray_session(_ray_for_the_session, demo_cache):
    """The tests' local Ray instance (run_ray joins it instead of starting its own)."""
    start_local_ray()
    return demo_cache


def objective_run(tmp_path, demo_cache, runtime: list[str], overrides: list[str]):
    cfg = load_config(
        None,
        [
            *SMALL_DEMO_ARGS,
            *overrides,
            *runtime,
            "--logging.progress=false",
            f"--trainer.steps={STEPS}",
            "--trainer.sync_interval=2",
            f"--eval.every={STEPS}",
            "--eval.limit=4",
            f"--model.cache_dir={demo_cache}",
            f"--run.output_dir={tmp_path}",
            "--run.name=o",
        ],
    )
    run_dir, summary = (run_ray if cfg.runtime.type == "ray" else run_sync)(cfg)
    assert summary["trainer_steps"] == STEPS

    train = [r for r in read_metrics(run_dir / "metrics.jsonl") if "train/loss" in r]
    assert [r["step"] for r in train] == list(range(1, STEPS + 1))
    assert all(r["train/loss"] is not None and math.isfinite(r["train/loss"]) for r in train)
    assert all(math.isfinite(r["train/grad_norm"]) for r in train)
    assert train[-1]["train/skipped_steps"] == 0
    assert max(r["train/lag_max"] for r in train) > 0, "stale data: some trained rollouts lag"

    rollouts = stored_rollouts(run_dir, STEPS)
    # the sampler's per-token log-probs are recorded exactly when the objective needs them
    assert stale_by_design(cfg)
    needs = needs_sampler_logps(cfg.objective, tb_trust_region(cfg.objective, stale_by_design(cfg)))
    assert rollouts and all((r.sampler_token_logps is not None) == needs for r in rollouts)
    if needs:
        assert all(len(r.sampler_token_logps) == len(r.completion) for r in rollouts), "one per token"
        assert all(lp <= 0.0 for r in rollouts for lp in r.sampler_token_logps)
    return cfg, train


@pytest.mark.parametrize("name", list(OBJECTIVES))
def test_every_objective_trains_on_data_its_sampler_generated_versions_behind(tmp_path, demo_cache, name):
    _, train = objective_run(tmp_path, demo_cache, ["--runtime.type=sync", "--runtime.extra_lag=2"], OBJECTIVES[name])
    # TB trains with the sequence band on data stale by design (it logs the share it leaves out)
    assert all(("train/tb_dropped" in r) == (name == "tb") for r in train)


def test_an_objective_without_sampler_log_probs_trains_in_the_ray_runtime(tmp_path, ray_session):
    cfg, _ = objective_run(tmp_path, ray_session, ["--runtime.type=ray"], OBJECTIVES["rloo"])
    assert not needs_sampler_logps(cfg.objective, None)


def test_a_run_starts_its_own_ray_instance_beside_another_on_the_machine(ray_session):
    """With runtime.address unset a run starts a private local instance even while another one
    lives on this machine and is named where Ray looks for one (RAY_ADDRESS, or the file that
    ``ray start`` writes): Ray's default would join it, and then refuse the run's CPU count."""
    import os
    import subprocess
    import sys

    code = (
        "import ray\n"
        "from tba.runtime.cluster import init_ray\n"
        "assert init_ray()\n"
        "print(ray.get_runtime_context().gcs_address)\n"
        "ray.shutdown()\n"
    )
    ours = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": ours}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = proc.stdout.strip().splitlines()[-1]
    assert theirs and theirs != ours
