"""The cost model (tba.plan.cost) and the split of a machine's GPUs that ``runtime.num_searchers:
auto`` and ``trainer.num_ranks: auto`` take from it (tba.plan.layout): through hardware descriptions
and models' config.json files, without loading a model."""

from __future__ import annotations

import json
import math

import pytest

from tba.cli import main
from tba.config import ConfigError, load_config
from tba.hardware import Hardware
from tba.plan import make_plan, plan_run
from tba.plan.cost import (
    NICE_SHARE,
    Layout,
    Prediction,
    StepParts,
    Workload,
    decode_step_s,
    gpu_parts,
    parts,
    predict,
    train_mfu,
)
from tba.plan.layout import TIE, Candidate, candidates, ranked, ties
from tba.plan.machines import described
from tba.plan.shape import model_shape

# Qwen2.5's published shapes: 494,032,768 and 7,615,616,512 parameters
QWEN_05B = {
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "vocab_size": 151936,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "intermediate_size": 4864,
    "tie_word_embeddings": True,
}
QWEN_7B = {
    "hidden_size": 3584,
    "num_hidden_layers": 28,
    "vocab_size": 152064,
    "num_attention_heads": 28,
    "num_key_value_heads": 4,
    "intermediate_size": 18944,
    "tie_word_embeddings": False,
}


@pytest.fixture
def model(tmp_path):
    def write(shape: dict) -> str:
        folder = tmp_path / f"m{len(list(tmp_path.iterdir()))}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(shape))
        return str(folder)

    return write


def test_a_models_size_comes_from_its_config_json(model):
    # the biases of q, k and v (a few thousand parameters) and the norms are left out: within 0.1%
    params, layers = model_shape(model(QWEN_05B))
    assert layers == 24 and abs(params / 494_032_768 - 1) < 1e-3
    params, layers = model_shape(model(QWEN_7B))
    assert layers == 28 and abs(params / 7_615_616_512 - 1) < 1e-3
    assert model_shape("no/such-model-anywhere") is None


# ---- the composition ------------------------------------------------------------------------------


def test_sync_takes_its_parts_in_turn():
    p = StepParts(generate_s=2.0, train_s=0.5, load_s=0.2, publish_s=0.1, overhead_s=0.05)
    one = predict(p, Layout("sync", 64, 64))
    assert one.step_s == pytest.approx(2.0 + 0.5 + 0.05 + 0.3) and one.bound == "turns" and one.lag_mean == 0
    # one searcher batch a step, whatever the trainer draws, and a publication every second step
    two = predict(p, Layout("sync", 128, 64, sync_interval=2))
    assert two.step_s == pytest.approx(2.0 + 0.5 + 0.05 + 0.15) and two.lag_mean == 0.5


def test_ray_is_bound_by_the_trainer_or_by_what_the_searchers_deliver():
    p = StepParts(generate_s=4.0, train_s=0.125, load_s=0.2)
    # one searcher: a 4.2-s batch (a load each batch: a publication every step) for each step
    one = predict(p, Layout("ray", 64, 64, searchers=1))
    assert one.bound == "searchers" and one.step_s == pytest.approx(4.2)
    assert one.trainer_busy == pytest.approx(0.125 / 4.2) and one.lag_mean == pytest.approx(1.0)
    # 64 searchers deliver faster than the trainer takes it
    many = predict(p, Layout("ray", 64, 64, searchers=64))
    assert many.bound == "trainer" and many.step_s == pytest.approx(0.125) and many.trainer_busy == 1.0
    # a publication every 8 steps: a batch loads only when one came since the last (the fixed point)
    k8 = predict(p, Layout("ray", 64, 64, searchers=64, sync_interval=8))
    loads = k8.parts["loads_per_batch"]
    assert k8.step_s == pytest.approx(0.125) and loads == pytest.approx(1.0)  # 4 s > 8 steps of 0.125
    slow = predict(StepParts(0.5, 0.125, 0.2), Layout("ray", 64, 64, searchers=64, sync_interval=8))
    assert slow.parts["loads_per_batch"] == pytest.approx(slow.parts["generate_s"] / (8 * slow.step_s))
    assert slow.parts["loads_per_batch"] < 1


def test_the_lag_bound_holds_a_trainer_that_many_searchers_would_feed():
    p = StepParts(generate_s=4.0, train_s=0.125, load_s=0.2)
    free = predict(p, Layout("ray", 64, 64, searchers=32, sync_interval=8))
    held = predict(p, Layout("ray", 64, 64, searchers=32, sync_interval=8, lag_bound=32))
    assert free.bound == "searchers" and free.step_s == pytest.approx(4.2 / 32) and held.bound == "lag"
    # at most 32 steps over two of a searcher's batches
    assert held.step_s == pytest.approx(2 * held.parts["generate_s"] / 32)
    # half the unbounded rate (benchmarks/results/scale/README.md measures 32 stand-in searchers so)
    assert free.step_s / held.step_s == pytest.approx(0.5)


def test_on_shared_cores_the_trainer_keeps_its_cores_and_the_searchers_share_what_it_leaves():
    # measured: a searcher's batch 0.2 s on one thread (0.2 CPU seconds, a core busy); the trainer's
    # step 0.2 s on two threads (0.36 CPU seconds: 0.9 of a core each)
    p = StepParts(0.2, 0.2, 0.0, generate_cpu_s=0.2, train_cpu_s=0.36, generate_threads=1, train_threads=2)
    ray = dict(cores=2, trainer_threads=1, searcher_threads=1)
    # one thread: the trainer's same CPU seconds at 0.9 of one core, 0.4 s; one searcher on the
    # core it leaves: trainer-bound
    one = predict(p, Layout("ray", 64, 64, searchers=1, **ray))
    assert one.step_s == pytest.approx(0.4) and one.bound == "trainer"
    assert one.parts["generate_s"] == pytest.approx(0.2)
    # four searchers ask for four cores; beside the trainer's step they get the 1.1 it leaves (and
    # a nice-15 share of its 0.9)
    four = predict(p, Layout("ray", 64, 64, searchers=4, **ray))
    left = 2 - 0.9 + 0.9 * NICE_SHARE
    assert four.parts["generate_s"] == pytest.approx(0.2 * 4 / left) and four.step_s == pytest.approx(0.4)
    # a step that needs 4 batches of each: they make 0.4 / batch of them beside the step, the rest
    # on both cores once it waits, at half speed
    batch = 0.2 * 4 / left
    slow = predict(p, Layout("ray", 256, 16, searchers=4, **ray))
    assert slow.bound == "searchers" and slow.step_s == pytest.approx(0.4 + 0.2 * 2 * (4 - 0.4 / batch))
    # the sync runtime on both threads: generation's CPU seconds at two cores, the step as measured
    assert predict(p, Layout("sync", 64, 64, cores=2, trainer_threads=2)).step_s == pytest.approx(0.1 + 0.2)
    # without CPU seconds, or with cores of their own, the parts add as before
    assert predict(StepParts(1.0, 0.2, 0.0), Layout("ray", 64, 64, cores=1)).step_s == pytest.approx(1.0)
    assert predict(p, Layout("ray", 64, 64, searchers=4)).step_s == pytest.approx(0.2)


def test_a_shared_gpu_slows_both_by_the_measured_factors():
    p = StepParts(generate_s=2.0, train_s=0.32, load_s=0.1)
    slow = parts()["shared_gpu"]
    apart = predict(p, Layout("ray", 64, 64))
    shared = predict(p, Layout("ray", 64, 64, shared=True))
    assert apart.step_s == pytest.approx(2.1)
    assert shared.step_s == pytest.approx(2.0 / slow["generation"] + 0.1)
    assert shared.trainer_busy == pytest.approx(0.32 * slow["trainer"] / shared.step_s)


# ---- the parts on a GPU ---------------------------------------------------------------------------


def test_the_gpu_parts_reproduce_the_points_they_were_measured_at():
    """The decode floor and the trainer's efficiency are each fitted on one measured point: at that
    point they give back the measurement."""
    w = Workload(494_032_768, 24, 10, 128, 64, 64, "vllm")
    decode = parts()["decode"][0]
    assert decode["device"] == "h100" and decode["in_flight"] == 64
    assert 64 / decode_step_s("h100", w, 64) == pytest.approx(decode["tokens_per_s"], rel=1e-9)
    train = parts()["train"][0]
    tokens = train["tokens"] / 64 - 128  # the prompt tokens of that step
    w_train = Workload(train["params"], 24, tokens, 128, 64, 64)
    assert gpu_parts("h100", w_train, "ipc").train_s == pytest.approx(train["step_s"], rel=1e-9)
    # more sequences in flight: more tokens a second, less than in proportion
    rates = [n / decode_step_s("h100", w, n) for n in (8, 32, 128, 512)]
    assert all(a < b for a, b in zip(rates, rates[1:], strict=False)) and rates[-1] < 64 * rates[0]
    # a larger model on the same GPU: a longer step; an A100's lower peak: a longer trainer step
    big = Workload(7.6e9, 28, 10, 128, 64, 64, "vllm")
    assert decode_step_s("h100", big, 64) > decode_step_s("h100", w, 64)
    assert train_mfu("a100") == train_mfu("h100")  # unmeasured: the H100's efficiency, at the A100's peak
    assert gpu_parts("a100", w, "ipc").train_s == pytest.approx(gpu_parts("h100", w, "ipc").train_s * 989 / 312)


def test_a_publication_costs_the_trainers_step_only_where_it_goes_to_searcher_processes():
    w = Workload(494_032_768, 24, 10, 128, 64, 64, "vllm")
    on_path = parts()["weights"]["on_trainer_path_s"]["value"]
    assert on_path > 0 and gpu_parts("h100", w, "in_process").publish_s == 0.0  # the sync runtime's copy
    assert all(gpu_parts("h100", w, t).publish_s == on_path for t in ("object_store", "ipc"))  # (those measured)


def test_every_part_says_where_it_comes_from():
    def entries(node):
        if isinstance(node, dict):
            if "kind" in node:
                yield node
            for value in node.values():
                yield from entries(value)
        elif isinstance(node, list):
            for value in node:
                yield from entries(value)

    found = list(entries({k: v for k, v in parts().items() if k != "about"}))
    assert len(found) >= 15
    assert all(e["kind"] in ("measured", "published", "assumed") and e["source"] for e in found)
    assert all(e.get("machine") for e in found if e["kind"] == "measured")


# ---- the split ------------------------------------------------------------------------------------


def resolved(cfg_args: list[str], hardware: Hardware):
    cfg, plan = plan_run(load_config(None, cfg_args), hardware=hardware)
    return cfg.runtime.num_searchers, cfg.trainer.num_ranks, plan


def gpus_used(searchers: int, ranks: int, plan) -> float:
    return ranks + searchers * plan.searcher_gpus


SETTING = ["--generation.backend=vllm", "--generation.max_new_tokens=512"]


@pytest.mark.parametrize(
    "spec,expected",
    [
        # one GPU: nothing to split (auto takes the sync runtime there)
        ("1xh100", (1, 1)),
        # two: the trainer's and one for searchers, two engines on it (a 0.5B eager engine leaves
        # its GPU mostly idle)
        ("2xh100", (2, 1)),
        # from 4 GPUs on, the lag bound (4 steps over two 10-s batches) sets the pace: one engine a
        # GPU, the trainer on one rank, every other GPU a searcher's
        ("4xh100", (3, 1)),
        ("8xh100", (7, 1)),
        ("16xh100", (15, 1)),
        # two nodes: the ranks stay on the trainer's node, the searchers take the other's GPUs too
        ("2x8xh100", (15, 1)),
    ],
)
def test_auto_splits_every_gpu_between_the_trainer_and_the_searchers(model, spec, expected):
    hardware = described(spec)
    searchers, ranks, plan = resolved([f"--model.policy={model(QWEN_05B)}", *SETTING], hardware)
    assert (searchers, ranks) == expected
    total = hardware.gpus * hardware.nodes
    if total == 1:
        assert plan.runtime == "sync" and "layout" not in plan.why
        return
    assert plan.runtime == "ray" and gpus_used(searchers, ranks, plan) == pytest.approx(total)
    assert "s a step" in plan.why["layout"] and "runner_up" in plan.why and "sync_would_take" in plan.why
    # the split taken is the fastest predicted
    cfg = load_config(None, [f"--model.policy={model(QWEN_05B)}", *SETTING, "--runtime.type=ray"])
    found = candidates(cfg, hardware, "object_store", model_shape(cfg.model.policy), "h100")
    best = min(c.prediction.step_s for c in found)
    assert found[0].prediction.step_s <= best * (1 + TIE) and (found[0].searchers, found[0].ranks) == expected


def test_splits_within_the_tolerance_tie_and_the_fewest_ranks_then_engines_a_gpu_win():
    def cand(ranks, searchers, per_gpu, step_s):
        return Candidate(ranks, searchers, per_gpu, Prediction(step_s, 1.0, 0.5, "trainer"))

    fastest = cand(2, 6, 1, 1.00)
    found = [
        fastest,
        cand(1, 14, 2, 1.00 * (1 + TIE) * 1.001),  # just outside the tie
        cand(1, 7, 2, 1.04),
        cand(1, 7, 1, 1.03),
        cand(3, 5, 1, 1.2),
    ]
    order = ranked(found)
    assert [(c.ranks, c.per_gpu) for c in order] == [(1, 1), (1, 2), (2, 1), (1, 2), (3, 1)]
    assert order[3].searchers == 14 and ties(found) == 3
    assert ranked([]) == [] and ties([fastest]) == 1


def test_the_demo_on_eight_gpus_takes_one_rank_and_says_the_splits_tie():
    """Every split of the demo's sub-millisecond step is within a fraction of a percent of the others
    (the trainer's constant overhead sets the pace): one rank, one engine a GPU, said to be a tie."""
    searchers, ranks, plan = resolved(["--runtime.type=ray"], described("8xh100"))
    assert (searchers, ranks) == (7, 1)
    assert "splits within 5% of the fastest tie, and the fewest ranks, then engines a GPU, win" in plan.why["layout"]


def test_a_model_whose_trainer_needs_several_gpus_gets_ranks(model):
    """7.6B parameters at 16 bytes each (fp32 weights, gradients, AdamW) are 122 GB: more than 70% of
    two H100s, so at least three ranks."""
    searchers, ranks, plan = resolved([f"--model.policy={model(QWEN_7B)}", *SETTING], described("8xh100"))
    assert ranks == 3 and searchers == 5 and gpus_used(searchers, ranks, plan) == 8
    _, _, small = resolved([f"--model.policy={model(QWEN_7B)}", *SETTING], described("2xh100"))
    assert "no split of 2 GPUs fits a 7.6B model's trainer state" in small.why["layout"]


def test_a_users_numbers_win_and_the_other_is_chosen(model):
    policy, hw = f"--model.policy={model(QWEN_05B)}", described("8xh100")
    searchers, ranks, plan = resolved([policy, *SETTING, "--runtime.num_searchers=3"], hw)
    assert searchers == 3 and ranks == 1 and "auto (num_ranks)" in plan.why["layout"]
    searchers, ranks, plan = resolved([policy, *SETTING, "--trainer.num_ranks=2"], hw)
    assert ranks == 2 and searchers == 6 and "auto (num_searchers)" in plan.why["layout"]
    searchers, ranks, plan = resolved([policy, *SETTING, "--trainer.num_ranks=2", "--runtime.num_searchers=4"], hw)
    assert (searchers, ranks) == (4, 2) and plan.why["layout"].startswith("2 rank(s) + 4 searcher(s)")


def test_where_there_is_nothing_to_split_auto_is_one_searcher_and_one_rank(model):
    for args, hw in (([], Hardware(cpus=2)), (["--runtime.type=ray"], Hardware(cpus=16))):
        searchers, ranks, plan = resolved(args, hw)
        assert (searchers, ranks) == (1, 1) and "layout" not in plan.why
    # a model without a config.json to read: one searcher a GPU beyond the trainer's, said so
    searchers, ranks, plan = resolved(["--model.policy=no/such-model-anywhere"], described("4xh100"))
    assert (searchers, ranks) == (3, 1) and "no config.json" in plan.why["num_searchers"]
    # a GPU the parts file does not know: predicted with an H100's, said so
    unknown = Hardware(cpus=64, gpus=4, bf16=True, gpu_name="NVIDIA B200")
    _, _, plan = resolved([f"--model.policy={model(QWEN_05B)}", *SETTING], unknown)
    assert "no parts for NVIDIA B200" in plan.why["layout"]


def test_a_resolved_config_keeps_its_numbers(model):
    """The plan resolves auto once: a run's saved config has the numbers, and planning it again
    (a resumed run, tba eval) changes nothing."""
    hw = described("8xh100")
    cfg, plan = plan_run(load_config(None, [f"--model.policy={model(QWEN_05B)}", *SETTING]), hardware=hw)
    again = make_plan(load_config(None, [f"--{k}={v}" for k, v in flat(cfg).items()]), hw)
    assert again.searcher_gpus == plan.searcher_gpus and again.why["layout"].startswith("1 rank(s) + 7 searcher(s)")


def flat(cfg) -> dict:
    return {
        "model.policy": cfg.model.policy,
        "generation.backend": cfg.generation.backend,
        "generation.max_new_tokens": cfg.generation.max_new_tokens,
        "runtime.num_searchers": cfg.runtime.num_searchers,
        "trainer.num_ranks": cfg.trainer.num_ranks,
    }


def test_print_plan_describes_another_machine(model, capsys):
    policy = f"--model.policy={model(QWEN_05B)}"
    assert main(["train", policy, *SETTING, "--print-plan", "--hardware=8xh100"]) == 0
    out = capsys.readouterr().out
    assert "8 GPUs (NVIDIA H100 80GB)" in out and "layout: auto (num_searchers, num_ranks): 1 rank(s) + 7" in out
    step = float(out.split("7 searcher(s): ")[1].split(" s a step")[0])
    assert math.isfinite(step) and step > 0
    assert main(["train", "--print-plan", "--hardware", "2x8xh200"]) == 0
    assert "2 nodes of 128 CPU cores, 8 GPUs (NVIDIA H200)" in capsys.readouterr().out
    assert main(["train", "--print-plan", "--hardware=9xq"]) == 2
    assert "is not a machine: write GPUSxKIND" in capsys.readouterr().err
    assert main(["train", "--hardware=8xh100"]) == 2
    assert "--hardware describes a machine for --print-plan" in capsys.readouterr().err


def test_a_described_machine_is_checked():
    assert described("cpu:16") == Hardware(cpus=16)
    assert described("4xa100,cpus=32") == Hardware(cpus=32, gpus=4, bf16=True, gpu_name="NVIDIA A100 80GB", nodes=1)
    for bad in ("8xh100,gpus=2", "0xh100", "h100x8", "8xh100,fast"):
        with pytest.raises(ConfigError, match="is not a machine"):
            described(bad)


def test_every_transport_names_its_parts_in_the_cost_model():
    from tba.plan.cost import parts
    from tba.weights.transports import TRANSPORTS, transport

    assert all(t.cost_parts in parts()["weights"] for t in TRANSPORTS.values())
    # gloo's broadcast goes through host memory, as the object store does (not measured apart on a GPU)
    assert [transport(n).cost_parts for n in ("in_process", "object_store", "broadcast", "ipc")] == [
        "in_process",
        "object_store",
        "object_store",
        "ipc",
    ]


def test_searchers_on_other_nodes_share_the_trainer_nodes_link_one_copy_a_node():
    w = Workload(7.6e9, 28, 128, 512, 128, 128, "vllm")
    network = parts()["weights"]["network_gb_s"]["value"]
    local = gpu_parts("h100", w, "object_store").load_s
    # every searcher remote: a copy for each of the 7 other nodes through one link
    seven = gpu_parts("h100", w, "object_store", remote=1.0, remote_nodes=7).load_s
    assert seven - local == pytest.approx(7 * w.weight_gb / network)
    one = gpu_parts("h100", w, "object_store", remote=1.0, remote_nodes=1).load_s
    assert one - local == pytest.approx(w.weight_gb / network)
    # half the searchers remote: half of them wait for it
    half = gpu_parts("h100", w, "object_store", remote=0.5, remote_nodes=7).load_s
    assert half - local == pytest.approx(3.5 * w.weight_gb / network)
