"""The run plan (``tba.plan``): every ``auto`` decided once, from the config and a hardware
description, without loading a model; saved beside the run and read back as it was."""

from __future__ import annotations

import pytest
import torch

from tba.config import ConfigError, load_config
from tba.plan import Hardware, Plan, make_plan
from tba.plan.auto import stale_by_design, tb_trust_region

TWO_CORES = Hardware(cpus=2)
ONE_H100 = Hardware(cpus=16, gpus=1, bf16=True)


def plan(overrides: list[str], hardware: Hardware = TWO_CORES) -> Plan:
    return make_plan(load_config(None, overrides), hardware)


def test_two_cores_ray_split_the_cores_and_take_the_band_and_the_lag_bound():
    p = plan(["--runtime.type=ray"])
    assert (p.device, p.dtype, p.precision) == ("cpu", "float32", "fp32")
    assert (p.trainer_threads, p.searcher_threads) == (1, 1)  # one core each, not four threads on two
    assert (p.transport, p.lag_bound, p.flat_weight, p.trust_region) == ("object_store", 4, 0.0, 0.5)
    assert p.sampler_logprobs == "sampling_pass" and p.stream == "batch"
    assert (p.searcher_gpus, p.eval_gpus) == (0.0, 0.0)
    assert "lag_bound" in p.why and "trust_region" in p.why


def test_sync_keeps_plain_tb_every_core_and_no_lag_bound():
    sync = ["--runtime.type=sync"]
    p = plan(sync)
    assert (p.runtime, p.transport, p.lag_bound, p.trust_region) == ("sync", "in_process", None, None)
    assert p.trainer_threads is None and p.flat_weight == 1.0 and p.sampler_logprobs == "none"
    assert plan([*sync, "--runtime.extra_lag=2"]).trust_region == 0.5  # stale by design: the band
    assert plan([*sync, "--run.threads=3"]).trainer_threads == 3
    assert plan([*sync, "--objective.type=grpo"]).sampler_logprobs == "teacher_forced"
    assert plan([*sync, "--objective.type=grpo", "--generation.backend=vllm"]).sampler_logprobs == "engine"


def test_a_gpu_resolves_dtypes_and_shares_it_with_the_searcher():
    p = plan(["--runtime.type=ray"], ONE_H100)
    assert (p.device, p.dtype, p.precision) == ("cuda", "bfloat16", "bf16-mixed")
    assert p.searcher_gpus == 0.5 and "searcher_gpus" in p.why  # the trainer counts as one more
    # (trainer.num_ranks=1: auto would give the trainer a second GPU, as tests/test_layout.py says)
    four = plan(
        ["--runtime.type=ray", "--runtime.num_searchers=3", "--trainer.num_ranks=1"],
        Hardware(cpus=16, gpus=4, bf16=True),
    )
    assert four.searcher_gpus == 1.0  # three GPUs besides the trainer's: one each
    old = Hardware(cpus=8, gpus=1, bf16=False)  # before Ampere
    shared = plan(["--runtime.type=ray"], old)
    assert (shared.dtype, shared.precision, shared.searcher_gpus) == ("float32", "fp32", 0.5)
    with pytest.raises(ConfigError, match="no bfloat16 support"):
        plan(["--trainer.precision=bf16-mixed"], old)


def test_a_device_the_machine_lacks_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="no CUDA device is visible; use run.device=cpu"):
        plan(["--run.device=cuda"])
    with pytest.raises(ConfigError, match=r"only 1 GPU\(s\) are visible"):
        plan(["--run.device=cuda:1"], ONE_H100)
    with pytest.raises(ConfigError, match="is not a device"):
        plan(["--run.device=gpu0"])


def test_ranks_and_threads_follow_the_cores():
    p = plan(["--runtime.type=sync", "--trainer.num_ranks=2", "--trainer.batch_prompts=4"], Hardware(cpus=9))
    assert (p.rank_cpus, p.rank_threads) == (4.0, 4)  # one core kept for generation, the rest split
    r = plan(["--runtime.type=ray", "--runtime.num_searchers=2", "--runtime.searcher_cpus=2"], Hardware(cpus=8))
    assert (r.trainer_threads, r.searcher_threads) == (4, 2)


def test_processes_asking_for_more_cores_than_the_machine_has_are_warned_of_not_refused(tmp_path):
    crowded = plan(["--runtime.type=ray", "--runtime.trainer_cpus=2"])
    assert crowded.warnings == (
        "the trainer's 2 and the searchers' 1 threads ask for 3 of this machine's 2 core(s), and processes that "
        "share cores slow each other; lower runtime.trainer_cpus (or run.threads) and runtime.searcher_cpus, or "
        "leave runtime.type=auto to generate and train in turns",
    )
    assert crowded.lines()[-1] == f"  warning: {crowded.warnings[0]}"
    crowded.save(tmp_path)
    assert Plan.load(tmp_path) == crowded
    assert plan(["--runtime.type=ray"]).warnings == ()  # the default split: a core each
    assert plan(["--runtime.type=ray", "--runtime.trainer_cpus=2"], Hardware(cpus=4)).warnings == ()
    assert (
        "ask for 3 of" in plan(["--runtime.type=ray", "--runtime.num_searchers=2"]).warnings[0]
    )  # trainer: 1 at least
    evaluating = ["--runtime.type=ray", "--eval.async=true"]
    assert plan(evaluating, Hardware(cpus=3)).warnings == ()  # 1 + 1 + 1
    assert "evaluation's 1 threads ask for 5 of" in plan([*evaluating, "--run.threads=3"], Hardware(cpus=4)).warnings[0]
    remote = ["--runtime.type=ray", "--runtime.trainer_cpus=2", "--runtime.address=auto"]
    assert plan(remote).warnings == ()  # joining a cluster: the searchers may be elsewhere
    assert plan(["--runtime.type=sync", "--run.threads=4"]).warnings == ()


def test_a_builtin_model_is_located_without_being_built(tmp_path):
    p = plan([f"--model.cache_dir={tmp_path}", "--task.digits=1", "--task.operators=*"])
    assert p.policy == p.reference and p.policy.startswith(str(tmp_path / "tiny-arithmetic-"))
    assert not any(tmp_path.iterdir())  # nothing built or loaded to plan


def test_auto_runtime_takes_turns_on_a_shared_device_and_runs_side_by_side_on_devices_of_their_own():
    cpu = plan([])  # the default: searchers would share the two cores with the trainer
    assert (cpu.runtime, cpu.transport, cpu.trust_region, cpu.flat_weight) == ("sync", "in_process", None, 1.0)
    assert "2 CPU core(s)" in cpu.why["runtime"] and cpu.lines()[0].startswith("plan: sync runtime")
    one_gpu = plan([], ONE_H100)
    assert (one_gpu.runtime, one_gpu.searcher_gpus) == ("sync", None) and "the trainer's GPU" in one_gpu.why["runtime"]
    assert plan(["--run.device=cpu"], Hardware(cpus=16, gpus=4, bf16=True)).runtime == "sync"
    four = plan([], Hardware(cpus=16, gpus=4, bf16=True))  # searchers get GPUs of their own: asynchrony
    assert (four.runtime, four.transport, four.searcher_gpus, four.lag_bound) == ("ray", "object_store", 1.0, 4)
    assert four.trust_region == 0.5 and "3 GPU(s) beyond the trainer's 1" in four.why["runtime"]
    ranks = ["--trainer.num_ranks=2", "--trainer.batch_prompts=4"]
    assert plan(ranks, Hardware(cpus=16, gpus=2, bf16=True)).runtime == "sync"  # both GPUs train
    assert plan(ranks, Hardware(cpus=16, gpus=3, bf16=True)).runtime == "ray"
    # settings that one runtime alone has decide it; a runtime set by hand is kept, with no reason given
    assert plan(["--runtime.address=auto"]).runtime == "ray"
    assert plan(["--runtime.searcher_resources={searcher: 1}"]).runtime == "ray"
    assert plan(["--eval.async=true"]).runtime == "ray"
    lagged = plan(["--runtime.extra_lag=2"], Hardware(cpus=16, gpus=4, bf16=True))
    assert (lagged.runtime, lagged.trust_region) == ("sync", 0.5)
    assert "runtime" not in plan(["--runtime.type=ray"]).why
    broadcast = plan(["--runtime.weight_transport=broadcast"])  # sends to searcher processes: ray
    assert (broadcast.runtime, broadcast.transport) == ("ray", "broadcast")
    with pytest.raises(ConfigError, match="set runtime.type=sync and drop eval.async"):
        plan(["--runtime.extra_lag=2", "--eval.async=true"])


def test_each_runtimes_entry_point_runs_its_own_runtime_with_auto_resolved():
    from tba.plan import plan_run

    cfg, plan = plan_run(load_config(None, []), "sync", TWO_CORES)  # what run_sync trains with
    assert plan.runtime == "sync" and plan.trust_region is None
    assert (
        cfg.runtime.type == "sync" and tb_trust_region(cfg.objective, stale_by_design(cfg)) is None
    )  # the band follows the runtime
    four = Hardware(cpus=16, gpus=4, bf16=True)
    ray, plan = plan_run(load_config(None, []), "ray", four)
    assert tb_trust_region(ray.objective, stale_by_design(ray)) == 0.5
    assert (plan.runtime, plan.trust_region) == ("ray", 0.5)
    with pytest.raises(ConfigError, match=r"auto chose sync \(searchers would share .*set runtime.type=ray"):
        plan_run(load_config(None, []), "ray", TWO_CORES)
    with pytest.raises(ConfigError, match="runtime.type=ray, and this is the sync runtime's entry point"):
        plan_run(load_config(None, ["--runtime.type=ray"]), "sync", TWO_CORES)


def test_an_impossible_transport_is_refused_in_one_line(capsys):
    from tba.cli import main

    assert main(["train", "--print-plan", "--runtime.weight_transport=broadcast", "--runtime.type=sync"]) == 2
    err = capsys.readouterr().err
    assert "the sync runtime has none (its searcher shares the trainer's process)" in err
    assert len(err.strip().splitlines()) == 1, err
    for args, said in (
        (["--runtime.type=sync"], "runtime.weight_transport=ipc sends weights to searcher processes"),
        (["--runtime.address=auto"], "needs searchers on the trainer's machine, and runtime.address may place"),
        (["--trainer.num_ranks=2", "--trainer.batch_prompts=4"], "ipc cannot serve trainer ranks"),
    ):
        assert main(["train", "--print-plan", "--runtime.weight_transport=ipc", *args]) == 2
        err = capsys.readouterr().err
        assert said in err and len(err.strip().splitlines()) == 1, err


def test_ipc_is_planned_where_searchers_share_the_trainers_memory_and_refused_where_they_do_not():
    on_cpu = plan(["--runtime.weight_transport=ipc"])  # shared host memory: searchers on this machine
    assert (on_cpu.runtime, on_cpu.transport) == ("ray", "ipc")
    assert any("weights by ipc" in line for line in on_cpu.lines())
    one_gpu = plan(["--runtime.weight_transport=ipc"], ONE_H100)  # the searchers share the trainer's GPU
    assert (one_gpu.transport, one_gpu.searcher_gpus) == ("ipc", 0.5)
    with pytest.raises(ConfigError, match="on 4 GPUs the searchers get GPUs of their own"):
        plan(["--runtime.weight_transport=ipc"], Hardware(cpus=16, gpus=4, bf16=True))


def test_the_plan_is_saved_read_back_and_printed(tmp_path):
    p = plan(["--runtime.type=ray"], ONE_H100).with_eos({5, 2})
    p.save(tmp_path)
    assert Plan.load(tmp_path) == p and p.eos_ids == (2, 5)
    lines = p.lines()
    assert lines[0].startswith("plan: ray runtime on cuda (16 CPU cores, 1 GPU)")
    assert any("weights by object store; lag bound 4" in line for line in lines)


def test_tba_train_prints_the_plan_without_loading_and_refuses_a_missing_device(capsys):
    from tba.cli import main

    assert main(["train", "--print-plan", "--runtime.type=sync", "--objective.type=grpo"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("plan: sync runtime on cpu") and "grpo" in out[-1]
    if not torch.cuda.is_available():
        assert main(["train", "--print-plan", "--run.device=cuda"]) == 2
        assert "no CUDA device is visible; use run.device=cpu" in capsys.readouterr().err


HARDWARE = {
    "2 cores": Hardware(cpus=2),
    "16 cores": Hardware(cpus=16),
    "1 GPU": Hardware(cpus=16, gpus=1, bf16=True),
    "8 GPUs": Hardware(cpus=64, gpus=8, bf16=True),
}


@pytest.mark.parametrize("machine", list(HARDWARE))
@pytest.mark.parametrize(
    "args",
    [
        [],
        ["--runtime.type=ray"],
        ["--objective.type=grpo", "--runtime.type=ray", "--generation.backend=vllm"],
        ["--generation.backend=vllm", "--runtime.type=sync"],
    ],
    ids=["defaults", "ray", "grpo-ray-vllm", "sync-vllm"],
)
def test_the_plan_resolves_every_auto_for_any_machine(machine, args):
    """Every decision the plan carries is resolved: nothing downstream of it sees an ``auto``."""
    hardware = HARDWARE[machine]
    device = ["--run.device=cuda"] if hardware.gpus else []
    plan = make_plan(load_config(None, [*args, *device]), hardware)

    def autos(value, where="plan"):
        if isinstance(value, dict):
            return [a for k, v in value.items() if k != "why" for a in autos(v, f"{where}.{k}")]
        if isinstance(value, list | tuple):
            return [a for i, v in enumerate(value) for a in autos(v, f"{where}[{i}]")]
        return [where] if value == "auto" else []

    assert not autos(plan.to_dict())
    if "--generation.backend=vllm" in args:  # each engine's memory and sleep decided once
        assert set(plan.engines) == {"searcher", "evaluation"}
        assert all(isinstance(e["sleep"], bool) and 0 < e["gpu_memory_utilization"] <= 1 for e in plan.engines.values())


def test_no_builder_compares_a_setting_with_auto():
    """The builders and the roles take the plan's decisions: no ``== "auto"`` (or ``!=``, ``in``)
    in the runtimes, the trainer, the searcher, generation or the weights' transports."""
    import ast
    from pathlib import Path

    src = Path(__file__).resolve().parents[1] / "src" / "tba"
    found = []
    for package in ("runtime", "trainer", "searcher", "generation", "weights"):
        for path in sorted((src / package).rglob("*.py")):
            if path.name == "transports.py":  # the registry resolves runtime.weight_transport for the plan
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Compare) and any(
                    isinstance(c, ast.Constant) and c.value == "auto" for c in [node.left, *node.comparators]
                ):
                    found.append(f"{path.relative_to(src)}:{node.lineno}")
    assert not found, found


def test_the_replay_window_covers_a_round_of_every_searchers_batch():
    """Searchers that start together deliver together: the window over which the replay bound
    holds spans twice the steps' worth of one batch from each (at least 16), so the trainer does
    not wait with a round's surplus in hand; a user's window wins, and the sync runtime has none."""
    ray_run = ["--runtime.type=ray", "--trainer.batch_prompts=8", "--generation.prompts_per_batch=8"]
    assert plan(ray_run).replay_window == 16  # one searcher: the old default
    assert plan([*ray_run, "--runtime.num_searchers=32", "--runtime.searcher_cpus=0.05"]).replay_window == 64
    assert plan([*ray_run, "--runtime.num_searchers=5", "--generation.prompts_per_batch=12"]).replay_window == 16
    assert plan([*ray_run, "--runtime.num_searchers=7", "--generation.prompts_per_batch=12"]).replay_window == 21
    assert plan([*ray_run, "--runtime.num_searchers=32", "--trainer.replay_window=8"]).replay_window == 8
    assert plan(["--runtime.type=sync"]).replay_window is None
    assert Plan.from_dict(plan([*ray_run, "--runtime.num_searchers=32"]).to_dict()).replay_window == 64
