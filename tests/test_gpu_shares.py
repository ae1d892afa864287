"""Which GPUs a run's processes take (``tba.plan`` decides the shares, ``tba.runtime.cluster`` starts
Ray with them): pure functions of the config and of what Ray has, so they are tested here without a GPU."""

from __future__ import annotations

import pytest
import torch

from tba.config import ConfigError
from tba.config import load_config as load
from tba.plan import Hardware, actor_gpu_shares, make_plan
from tba.plan.layout import resolve
from tba.runtime.cluster import driver_device, one_engine_at_a_time, searcher_gpu_ids

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def load_config(path, overrides: list[str]):
    """The config as the plan hands it to these functions: ``runtime.num_searchers`` and
    ``trainer.num_ranks`` decided (``auto``: one each where nothing is split)."""
    return resolve(load(path, overrides), Hardware(cpus=16), lambda: "")[0]


ONE_GPU = Hardware(cpus=16, gpus=1, bf16=True)


def shares(overrides: list[str], ray_gpus: float, shared: bool = False, device="cuda") -> tuple[float, float]:
    return actor_gpu_shares(load_config(None, ["--run.device=cuda", *overrides]), device, ray_gpus, shared)


def test_searchers_share_the_one_gpu_with_the_trainer():
    assert shares([], ray_gpus=1, shared=True) == (0.5, 0.0)
    assert shares(["--runtime.num_searchers=3"], ray_gpus=1, shared=True) == (0.25, 0.0)
    # the evaluation actor counts as one more
    assert shares(["--eval.async=true"], ray_gpus=1, shared=True) == (pytest.approx(1 / 3), pytest.approx(1 / 3))


def test_searchers_take_whole_gpus_while_there_are_enough_then_pack():
    assert shares(["--runtime.num_searchers=2"], ray_gpus=7) == (1.0, 0.0)
    assert shares(["--runtime.num_searchers=7", "--eval.async=true"], ray_gpus=7) == (0.5, 0.5)  # 8 actors, 7 GPUs
    assert shares(["--runtime.num_searchers=6"], ray_gpus=3) == (0.5, 0.0)
    # trainer ranks take their GPUs from Ray first
    assert shares(["--runtime.num_searchers=2", "--trainer.num_ranks=4", "--trainer.batch_prompts=16"], 8) == (1.0, 0.0)


def test_given_shares_are_kept_and_a_cpu_run_takes_no_gpu():
    assert shares(["--runtime.searcher_gpus=0.25", "--eval.async=true", "--eval.eval_gpus=1"], 1, True) == (0.25, 1.0)
    assert shares(["--runtime.searcher_gpus=0.25", "--eval.async=true"], 1, True) == (0.25, 0.5)
    assert actor_gpu_shares(load_config(None, []), "cpu", ray_gpus=0, trainer_gpu_shared=False) == (0.0, 0.0)


def test_a_cuda_run_whose_actors_would_get_no_gpu_is_refused():
    with pytest.raises(ConfigError, match=r"runtime.searcher_gpus=0 on a CUDA run.*none of its own"):
        shares(["--runtime.searcher_gpus=0"], ray_gpus=1, shared=True)
    with pytest.raises(ConfigError, match=r"eval.eval_gpus=0 on a CUDA run"):
        shares(["--eval.async=true", "--eval.eval_gpus=0"], ray_gpus=2)
    with pytest.raises(ConfigError, match=r"Ray has 4 GPU\(s\) and the trainer ranks take 4, leaving none"):
        shares(["--trainer.num_ranks=4", "--trainer.batch_prompts=16"], ray_gpus=4)


def test_the_driver_keeps_its_gpu_from_ray_unless_ray_ranks_hold_the_policy():
    cuda1 = torch.device("cuda", 1)
    four = Hardware(cpus=16, gpus=4, bf16=True)

    def held(overrides: list[str], hardware: Hardware = four) -> torch.device | None:
        return driver_device(make_plan(load_config(None, overrides), hardware))

    assert held(["--runtime.type=sync", "--trainer.num_ranks=2", "--run.device=cuda:1"]) == cuda1
    assert held(["--runtime.type=ray", "--run.device=cuda:1"]) == cuda1
    assert held(["--runtime.type=ray", "--trainer.num_ranks=2", "--run.device=cuda:1"]) is None
    assert held(["--runtime.type=sync", "--run.device=cpu"]) is None
    assert searcher_gpu_ids(cuda1, None, 4) == "0,2,3"


def test_an_actor_names_its_gpu_as_ray_numbers_it():
    plan = make_plan(load_config(None, ["--run.device=cuda:3"]), Hardware(cpus=16, gpus=4, bf16=True))
    assert plan.in_actor([3]).device == "cuda"  # Ray made GPU 3 the actor's cuda:0
    assert plan.in_actor([]).device == "cuda:3"  # no GPU from Ray: left as given
    assert make_plan(load_config(None, ["--run.device=cuda"]), ONE_GPU).in_actor([0]).device == "cuda"


def test_vllm_engines_that_share_a_gpu_start_one_at_a_time():
    vllm = ["--generation.backend=vllm", "--runtime.type=ray"]

    def alone(overrides: list[str], shared: bool, hardware: Hardware = ONE_GPU) -> bool:
        cfg = load_config(None, overrides)
        return one_engine_at_a_time(make_plan(cfg, hardware), trainer_gpu_shared=shared)

    assert alone(vllm, shared=True)
    assert alone([*vllm, "--runtime.searcher_gpus=0.5"], False)
    assert alone([*vllm, "--eval.async=true", "--eval.eval_gpus=0.5"], False)
    assert not alone([*vllm, "--runtime.searcher_gpus=1"], False, Hardware(cpus=16, gpus=2, bf16=True))
    assert not alone(["--runtime.type=ray"], True)  # HF generation profiles nothing
    assert not alone(vllm, True, Hardware(cpus=2))  # a fixed KV cache size on a CPU
