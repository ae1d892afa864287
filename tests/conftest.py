"""Shared fixtures: a tiny random Llama with the demo's character tokenizer, built in memory."""

from __future__ import annotations

import fcntl

import pytest
import torch

from tba.config import load_config
from tba.demo import ensure_tiny_model, ensure_tiny_tool_model
from tba.models.tiny import TinySpec, build_char_tokenizer, build_tiny_llama
from tba.types import Rollout


def xdist_worker(config) -> bool:
    """This process is a pytest-xdist worker (make test runs two)."""
    return hasattr(config, "workerinput")


def pytest_configure(config):
    """In a pytest-xdist worker, one torch thread: the workers already fill the cores, and idle
    OpenMP threads spin on a core another worker needs (tests that run the CLI or a runtime in
    this process set their own threads, as a run does)."""
    if xdist_worker(config):
        torch.set_num_threads(1)


# Files whose tests start processes (CLI runs, Ray instances, vLLM engines), by the seconds they
# took in `make test` on 2 cores (about 100 for test_vllm down to 7 for test_turns; the other files
# together 40). They run first (`make test` hands files out in this order: --no-loadscope-reorder),
# so that pytest-xdist's workers, a file at a time, do not end the suite on one of them alone while
# the other worker is done.
HEAVY_FIRST = [
    "test_vllm.py",
    "test_ranks.py",
    "test_ray_runtime.py",
    "test_prompt_accounting.py",
    "test_cli_integration.py",
    "test_ray_objectives.py",
    "test_ray_actors.py",
    "test_eval_command.py",
    "test_agents.py",
    "test_openenv.py",
    "test_lora.py",
    "test_task_training.py",
    "test_checkpoints.py",
    "test_bounds.py",
    "test_verifiers.py",
    "test_staleness.py",
    "test_bad_input.py",
    "test_docs.py",
    "test_logging_backends.py",
    "test_plots.py",
    "test_turns.py",
]


def pytest_collection_modifyitems(config, items):
    """The heavy files first; in each file, the tests on the shared local Ray instance before the
    others (:func:`_ray_only_where_asked` stops it for a test that does not ask for it, and each
    start costs seconds), each group in the file's order."""
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    joins_ray = lambda item: "_ray_for_the_session" in getattr(item, "fixturenames", ())  # noqa: E731
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), item.path.name, not joins_ray(item)))


# A small demo setting for end-to-end runs of the CLI: one-digit sums, 8 prompts a step. One thread:
# two test processes share the cores, and a run that planned two threads on a moment's idle cores
# would wait on the other test's process (3x slower: benchmarks/results/load/README.md).
SMALL_DEMO_ARGS = [
    "--run.threads=1",
    "--task.digits=1",
    "--task.operators=+",
    "--task.eval_size=20",
    "--generation.prompts_per_batch=8",
    "--trainer.batch_prompts=8",
    "--trainer.lr=3e-4",
    "--generation.max_new_tokens=4",
]


def stored_rollouts(run_dir, step) -> list[Rollout]:
    """The replay buffer's rollouts in the checkpoint of ``step``."""
    from tba.buffer import ReplayBuffer
    from tba.checkpoint import read_trainer_state

    buffer = ReplayBuffer()
    buffer.load_state_dict(read_trainer_state(run_dir / "checkpoints" / f"step_{step}")["buffer"])
    return buffer.rollouts()


def shared_cache(tmp_path_factory, request, name: str, build) -> object:
    """A model cache folder built once per test run by ``build(path)``; with pytest-xdist the workers
    share one beside their temporary directories: the first builds it, the others wait on its lock."""
    if not xdist_worker(request.config):
        path = tmp_path_factory.mktemp(name)
    else:
        path = tmp_path_factory.getbasetemp().parent / name
        path.mkdir(exist_ok=True)
    with open(path.parent / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        build(str(path))
    return path


@pytest.fixture(scope="session")
def demo_cache(tmp_path_factory, request):
    """A model cache holding the small demo setting's warm-started model, so searcher processes
    find it instead of building it."""
    task = load_config(None, SMALL_DEMO_ARGS).task
    return shared_cache(
        tmp_path_factory, request, "tba-cache", lambda p: ensure_tiny_model(task, p, log=lambda m: None)
    )


@pytest.fixture(autouse=True, scope="session")
def _plans_for_an_idle_machine():
    """Runs in the test process plan their threads for an idle machine: what the other test worker
    keeps busy must not change them, nor so the numbers that tests compare between runs. Runs of the
    command line measure the load, as a user's do; tests/test_threads.py describes loaded machines."""
    patch = pytest.MonkeyPatch()
    patch.setattr("tba.hardware.busy_cores", lambda window_s=0.0: 0.0)
    yield
    patch.undo()


def start_local_ray() -> None:
    """The test process's local Ray instance (2 CPUs), started on first use and kept until a test
    that does not ask for it (:func:`_ray_only_where_asked`): in-process runs join it (``run_ray``
    starts no instance of its own while one is up), which saves each of them Ray's start and stop."""
    import ray

    if not ray.is_initialized():
        ray.init(
            address="local", num_cpus=2, include_dashboard=False, _node_ip_address="127.0.0.1", configure_logging=False
        )


def stop_local_ray() -> None:
    import ray

    if ray.is_initialized():
        ray.shutdown()


@pytest.fixture(scope="session")
def _ray_for_the_session():
    yield
    stop_local_ray()


@pytest.fixture
def local_ray(_ray_for_the_session):
    """The shared local Ray instance (:func:`start_local_ray`)."""
    start_local_ray()


@pytest.fixture(autouse=True)
def _ray_only_where_asked(request):
    """An idle Ray instance takes CPU from the tests beside it (about 4% of a core): the shared one
    stops before a test that does not ask for it (a test that starts its own instance or cluster, or
    none), so it lives across consecutive tests that join it."""
    if "_ray_for_the_session" not in request.fixturenames:
        stop_local_ray()


@pytest.fixture(scope="session")
def tool_model(tmp_path_factory, request):
    """A folder holding the tool demo model of ``configs/tools.yaml``'s setting (the shipped one)."""
    task = load_config("configs/tools.yaml", []).task
    found = []
    build = lambda p: found.append(ensure_tiny_tool_model(task, p, log=lambda m: None))  # noqa: E731
    shared_cache(tmp_path_factory, request, "tba-tool-cache", build)
    return found[0]


SMALL = TinySpec(hidden_size=32, layers=2, heads=2, intermediate_size=64, max_positions=64)


@pytest.fixture(scope="session")
def tokenizer():
    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    torch.manual_seed(0)
    model = build_tiny_llama(tokenizer, SMALL)
    model.eval()
    return model


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory, tokenizer):
    """A saved Hugging Face checkpoint (model + tokenizer) in a temporary directory."""
    path = tmp_path_factory.mktemp("tiny-checkpoint")
    torch.manual_seed(0)
    build_tiny_llama(tokenizer, SMALL).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_tiny_checkpoint(path, spec: TinySpec):
    """The demo's tokenizer on a random tiny Llama of ``spec``, saved as a Hugging Face folder."""
    tokenizer = build_char_tokenizer()
    torch.manual_seed(0)
    build_tiny_llama(tokenizer, spec).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def assert_reports_declared(reported: dict) -> None:
    """What a searcher reports (``Searcher.metrics()``) is declared in ``tba.searcher.counters``, and
    every counter declared for all searchers is there: a renamed counter fails here, not as a zero."""
    from tba.searcher.counters import ACTOR_KEYS, COUNTERS, declared

    undeclared = sorted(k for k in reported if not declared(k))
    assert not undeclared, f"declare {undeclared} in tba.searcher.counters.COUNTERS"
    missing = [c.key for c in COUNTERS if not (c.optional or c.key in ACTOR_KEYS or c.key in reported)]
    assert not missing, f"the searcher no longer reports {missing}"


def components(cfg, log=lambda _: None, **kwargs):
    """``build_components`` as ``tba train`` calls it: the task prepared and checked, the plan made
    ready (models built and checked, EOS ids known)."""
    from tba.plan import plan_run
    from tba.runtime.build import build_components
    from tba.runtime.preflight import prepare_task, ready_plan

    prepared = prepare_task(cfg.model, cfg.task, cfg.objective, cfg.eval.samples, log)
    cfg, plan = plan_run(cfg)  # every auto decided, as tba train does
    plan = ready_plan(cfg.model, cfg.generation, cfg.task, plan, prepared[1], log, task=prepared[0])
    return build_components(cfg, plan, log, prepared=prepared, **kwargs)
