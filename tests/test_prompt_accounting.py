"""Every prompt of an epoch is accounted for: a searcher that dies, or a run that is killed and
resumed, goes on from its place in its prompts (tba.searcher.state) instead of drawing its epoch
again from the start, and the trainer's ledger (tba.runtime.ledger) counts each draw delivered,
dropped or in flight, with nothing skipped and nothing delivered twice."""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from tests.conftest import components, stored_rollouts
from tests.helpers.faults import frozen_after_new_groups, steps_done
from tests.helpers.processes import session_processes, wait_until
from tests.helpers.tiny_bpe import build_bpe_chat_model

from tba.checkpoint import CheckpointError, latest_checkpoint
from tba.config import load_config
from tba.metrics import read_metrics
from tba.runtime.ledger import PromptLedger
from tba.runtime.preflight import prepare_task
from tba.types import RolloutGroup, SearcherReport

ROWS = 10  # an epoch: each searcher goes through several in a run


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory):
    return build_bpe_chat_model(tmp_path_factory.mktemp("bpe-chat"))


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    return write_dataset(tmp_path_factory.mktemp("rows"), pace=0.0)


def write_dataset(root: Path, pace: float) -> Path:
    """The rows, and a reward function that takes ``pace`` seconds a call (a run that must last
    while a killed searcher's new process starts: its imports and models)."""
    rows = [{"prompt": [{"role": "user", "content": f"What is {a} plus 3?"}], "answer": a + 3} for a in range(ROWS)]
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "rewards.py").write_text(
        f"import time\n\ndef length(completions, **kwargs):\n    time.sleep({pace})\n"
        "    return [len(c[0]['content']) / 9 for c in completions]\n"
    )
    return root


def task_args(chat_model, dataset) -> list[str]:
    return [
        f"--model.policy={chat_model}",
        "--task.name=dataset",
        f"--task.path={dataset / 'data.jsonl'}",
        f"--task.reward_funcs=[{dataset / 'rewards.py'}:length]",
        "--task.eval_size=2",
        "--task.answer_column=answer",
        "--generation.group_size=3",
        "--generation.prompts_per_batch=3",
        "--generation.max_new_tokens=6",
        "--trainer.batch_prompts=3",
    ]


def group(searcher: int, draw: int) -> RolloutGroup:
    return RolloutGroup(f"p{draw}", [1], [[2], [3]], [0.0, 1.0], [0.0, 0.0], 0, searcher_id=searcher, draw=draw)


def test_the_ledger_counts_each_draw_once_and_finds_gaps_and_repeats():
    ledger = PromptLedger()
    place = lambda drawn, in_flight=0: {"drawn": drawn, "in_flight": in_flight}  # noqa: E731
    ledger.record([group(0, 0), group(0, 1), group(1, 0)], {0: SearcherReport(0, {}, place(3), [2])})
    ledger.record([group(1, 2)], {1: SearcherReport(1, {}, place(4, in_flight=1), [])})
    assert ledger.metrics() == {
        "prompts/drawn": 7.0,
        "prompts/delivered": 4.0,
        "prompts/dropped": 1.0,
        "prompts/in_flight": 1.0,
        "prompts/unaccounted": 1.0,  # searcher 1's draw 1: neither delivered, dropped nor in flight
        "prompts/twice": 0.0,
    }
    ledger.record([group(0, 1)], {})  # a draw delivered again: a searcher that started its epoch over
    again = PromptLedger()
    again.load_state_dict(json.loads(json.dumps(ledger.state_dict())))  # as a checkpoint keeps it
    summary = again.summary()
    assert summary["0"] == {
        "drawn": 3,
        "delivered": 2,
        "dropped": 1,
        "in_flight": 0,
        "unaccounted": 0,
        "twice": 1,
        "gaps": [],
    }
    assert summary["1"]["gaps"] == [[1, 2]] and summary["1"]["unaccounted"] == 1


def test_a_searcher_goes_on_from_its_place_across_epochs(chat_model, dataset):
    cfg = load_config(None, [*task_args(chat_model, dataset), "--runtime.type=sync"])
    c = components(cfg)
    c.trainer.publish()
    s = c.searcher

    def batches(n: int) -> list[tuple]:
        return [(g.draw, g.prompt_id) for _ in range(n) for g in s.step()]

    first = batches(2)
    place = json.loads(json.dumps(s.place()))  # plain data, as it travels and as checkpoints keep it
    assert place["drawn"] == 6 and place["in_flight"] == 0
    ahead = batches(4)  # across an epoch's end (10 rows)
    s.resume_place(place)
    assert batches(4) == ahead  # the same prompts, with the same draws
    drawn = [d for d, _ in first + ahead]
    assert drawn == sorted(set(drawn)) and max(drawn) < 18  # (some groups dropped: too few usable completions)


def replayed_ids(cfg, searcher: int, n: int) -> list[str]:
    """The prompt ids a searcher's first ``n`` draws are, replayed from its seed (tba.searcher.base)."""
    task = prepare_task(cfg.model, cfg.task, cfg.objective, log=lambda _: None)[0]
    rng = random.Random(cfg.run.seed * 1000 + searcher)
    return [p.id for p in task.sample_prompts(n, rng)]


SEARCHERS, EVERY, PACE = 2, 2, 0.2


def delivered_by(run_dir: Path) -> set[int]:
    """The searchers whose groups the replay buffer of the run's latest checkpoint holds (none
    while there is no checkpoint, or while the one found is pruned as it is read)."""
    latest = latest_checkpoint(run_dir)
    try:
        return {r.searcher_id for r in stored_rollouts(run_dir, int(latest.name.split("_")[1]))} if latest else set()
    except (OSError, CheckpointError):
        return set()


def start(tmp_path: Path, args: list[str], *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "tba", "train", *args, *extra],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "TERM": "dumb"},
        start_new_session=True,  # its own session: its processes are findable, and killed together
    )


@pytest.mark.slow
def test_a_run_that_loses_a_searcher_and_its_trainer_accounts_for_every_prompt(chat_model, tmp_path):
    """Two searchers on a 10-row dataset: one is killed at a random moment, then, once its new
    process is back and a checkpoint came after, ``tba train`` itself (SIGKILL: its Ray processes
    must be gone within 30 s, stopped by the run's watchdog); the run resumes for two more
    checkpoints. Each searcher's draws in the resumed run are exactly 0, 1, ... up to its latest:
    delivered (and trained, or in the buffer) or dropped, none twice, none skipped; their prompts
    are the searcher's epochs replayed from its seed; what the killed trainer had received after
    its checkpoint was drawn again; the replay buffer and the metrics go on from the checkpoint."""
    run_dir, dataset = tmp_path / "r", write_dataset(tmp_path, PACE)
    args = [
        *task_args(chat_model, dataset),
        "--runtime.type=ray",
        f"--runtime.num_searchers={SEARCHERS}",
        "--runtime.searcher_cpus=0.25",
        "--runtime.trainer_cpus=1",
        "--run.threads=1",
        "--buffer.per_prompt_capacity=null",  # nothing evicted: what the checkpoint held is all still there
        "--trainer.steps=100000",  # until it is killed
        f"--trainer.checkpoint_every={EVERY}",
        "--eval.every=100000",
        "--logging.progress=false",
        f"--run.output_dir={tmp_path}",
        "--run.name=r",
    ]
    chance = random.Random(0)
    metrics, errors = run_dir / "metrics.jsonl", run_dir / "errors.log"
    proc = start(tmp_path, args)
    try:
        searchers = lambda: sorted(p for p, cmd in session_processes(proc.pid).items() if "SearcherWorker" in cmd)  # noqa: E731
        # every searcher has sent a batch: one killed while it still starts would be restarted by Ray
        # before its first call, unseen by the run
        wait_until(proc, lambda: delivered_by(run_dir) == set(range(SEARCHERS)) and len(searchers()) == SEARCHERS)
        time.sleep(chance.uniform(0, 1))
        os.kill(chance.choice(searchers()), signal.SIGKILL)
        wait_until(proc, lambda: errors.is_file() and "is back after" in errors.read_text())
        back = steps_done(run_dir)  # the new process goes on from the dead one's place
        checkpoint = (back // EVERY + 2) * EVERY
        wait_until(proc, lambda: (run_dir / "checkpoints" / f"step_{checkpoint}").is_dir())
        time.sleep(chance.uniform(0, 1))
        # stopped (SIGSTOP) where it has taken in groups since its latest checkpoint: they die with
        # it, and the resumed run must draw them again
        wait_until(proc, lambda: frozen_after_new_groups(proc.pid, run_dir))
        ours = session_processes(proc.pid)
        os.kill(proc.pid, signal.SIGKILL)  # tba train alone: the watchdog stops its Ray processes
        killed_at = time.time()
        proc.wait()
        alive = ours
        while alive and time.time() - killed_at < 30:
            time.sleep(0.2)
            alive = {pid: cmd for pid, cmd in session_processes(proc.pid).items() if pid in ours}
        print(f"\nafter SIGKILL of tba train: its {len(ours)} processes were gone in {time.time() - killed_at:.1f} s")
        assert not alive, f"still alive 30 s after SIGKILL of tba train: {alive}"
    finally:
        for pid in session_processes(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    before = read_metrics(metrics)
    killed_at = max(r["prompts/drawn"] for r in before if "prompts/drawn" in r)
    assert max(r["searcher/restarts"] for r in before if "searcher/restarts" in r) == 1
    resumed_from = int(latest_checkpoint(run_dir).name.split("_")[1])

    final = resumed_from + 2 * EVERY  # enough to take in what the killed run had after its checkpoint
    resumed = subprocess.run(
        [sys.executable, "-m", "tba", "train", *args, "--run.resume=true", f"--trainer.steps={final}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    cfg = load_config(None, args)
    for account in summary["prompts"].values():
        assert account["twice"] == 0 and account["gaps"] == [] and account["unaccounted"] == 0, account
        assert account["delivered"] + account["dropped"] == account["drawn"] and account["in_flight"] == 0
    # the prompts of the delivered draws are those of each searcher's epochs, replayed from its seed
    expected = {s: replayed_ids(cfg, int(s), a["drawn"]) for s, a in summary["prompts"].items()}
    for r in stored_rollouts(run_dir, final):
        assert r.prompt_id in expected[str(r.searcher_id)]
    # the replay buffer came back whole: each rollout of the checkpoint is still there, as it was
    # or replaced by a newer copy of the same completion; the new searchers sampled from the
    # checkpoint's weights on, and the metrics read as one run
    kept = stored_rollouts(run_dir, resumed_from)
    after = {(r.prompt_id, r.completion): r for r in stored_rollouts(run_dir, final)}
    assert kept and all(r.arrival_step < resumed_from for r in kept)
    for r in kept:
        now = after[(r.prompt_id, r.completion)]
        assert now == r or now.arrival_step >= resumed_from
    new = [r for r in after.values() if r.arrival_step >= resumed_from]
    assert new and all(r.policy_version >= resumed_from for r in new), (
        "new searchers start from the checkpoint's weights"
    )
    records = read_metrics(metrics)
    assert all(r["buffer/evicted"] == 0 for r in records if "buffer/evicted" in r)
    assert [r["step"] for r in records if "train/loss" in r] == list(range(1, final + 1))
    # the resumed run drew again what the killed one had drawn after its last checkpoint
    at_checkpoint = [r for r in records if r["step"] == resumed_from and "prompts/drawn" in r]
    reissued = killed_at - at_checkpoint[0]["prompts/drawn"]
    accounts = summary["prompts"]
    print(
        f"\nprompts: {sum(a['drawn'] for a in accounts.values())} drawn by {SEARCHERS} searchers, "
        f"{sum(a['delivered'] for a in accounts.values())} delivered, {sum(a['dropped'] for a in accounts.values())} "
        f"dropped, none twice or skipped; {reissued:g} drawn again after the resume"
    )
    assert reissued > 0
