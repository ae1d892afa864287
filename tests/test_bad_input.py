"""What users get wrong fails up front, in one line: ``tba train`` exits with status 2 and a message
that names the problem and the fix, prints no traceback (only with ``--debug``), and leaves no run
directory behind. One table of cases, run in-process through ``tba.cli.main``; two real
subprocesses show the exit status and ``--debug``. Models, tokenizers and data are built here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
from tests.helpers.tiny_bpe import build_bpe_chat_model, build_bpe_tokenizer, build_reward_model
from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

from tba.cli import main
from tba.runtime.run_dir import check_run_dir, remove_unstarted

pytestmark = pytest.mark.slow  # end to end (make test-fast leaves it out)

REWARDS = """
def constant(completions, **kwargs):
    return [1.0] * len(completions)


def crashes(completions, **kwargs):
    return [len(c) / 0 for c in completions]


def one_short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)
"""


@pytest.fixture(scope="module")
def world(tmp_path_factory) -> dict[str, str]:
    """Paths of everything the cases point at, as ``{name: path}`` for the cases' ``{placeholders}``."""
    root = tmp_path_factory.mktemp("bad-input")
    chat = build_bpe_chat_model(root / "chat")
    no_tokenizer = build_bpe_chat_model(root / "no_tokenizer")
    for f in no_tokenizer.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            f.unlink()
    corrupt = build_bpe_chat_model(root / "corrupt")
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    bert = root / "bert"
    BertModel(BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2)).save_pretrained(
        bert
    )
    build_bpe_tokenizer().save_pretrained(bert)
    no_eos = root / "no_eos"
    PreTrainedTokenizerFast(tokenizer_object=build_bpe_tokenizer().backend_tokenizer).save_pretrained(no_eos)
    data = root / "data.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": 2 * i}) + "\n" for i in range(12)))
    (root / "empty.jsonl").write_text("")
    (root / "data.txt").write_text("What is 1 + 1?\n")
    (root / "rewards.py").write_text(REWARDS)
    (root / "bad.yaml").write_text("trainer:\n  lr: [1e-4\n")
    paths = {
        "chat": chat,
        "no_tokenizer": no_tokenizer,
        "corrupt": corrupt,
        "bert": bert,
        "classifier": build_reward_model(root / "classifier"),
        "no_eos": no_eos,
        "data": data,
        "empty": root / "empty.jsonl",
        "txt": root / "data.txt",
        "rewards": root / "rewards.py",
        "bad_yaml": root / "bad.yaml",
        "cache": root / "cache",
    }
    return {k: str(v) for k, v in paths.items()}


# A dataset task on the tiny chat model: every case below changes one thing of it.
DATA = [
    "--runtime.type=sync",
    "--task.name=dataset",
    "--task.path={data}",
    "--task.eval_size=4",
    "--task.reward_funcs=[{rewards}:constant]",
    "--model.policy={chat}",
    "--trainer.steps=1",
]


@dataclass
class Case:
    id: str
    args: list[str]  # after `tba train`; {placeholders} name paths of `world`
    says: list[str]  # what the message's line must contain
    before: str | None = None  # how the run directory looks before the start


CASES = [
    # config: keys, values, batch shapes
    Case("unknown key", ["--trainer.lrr=1e-4"], ["trainer.lrr: unknown key", "did you mean trainer.lr?"]),
    Case("unknown section", ["--optimiser.lr=1"], ["optimiser: unknown key", "remove it"]),
    Case("key of another task", ["--task.digitz=3"], ["task.digitz: unknown key", "did you mean task.digits?"]),
    Case("negative learning rate", ["--trainer.lr=-1"], ["trainer.lr", "greater than 0", "got -1"]),
    Case("not a number", ["--trainer.steps=many"], ["trainer.steps", "valid integer", "got 'many'"]),
    Case("group of one", ["--generation.group_size=1"], ["generation.group_size", "greater than or equal to 2"]),
    Case(
        "micro-batch does not divide the batch",
        ["--trainer.batch_prompts=8", "--trainer.micro_batch_prompts=3"],
        ["micro_batch_prompts 3 does not divide trainer.batch_prompts 8", "use a divisor of 8"],
    ),
    Case("micro-batch of zero", ["--trainer.micro_batch_prompts=0"], ["micro_batch_prompts 0 does not divide"]),
    Case(
        "fewer samples than the group",
        ["--generation.samples_per_prompt=4"],
        ["samples_per_prompt 4 is below group_size 8"],
    ),
    Case(
        "buffer smaller than one batch",
        ["--buffer.capacity=100"],
        ["buffer.capacity 100 holds fewer completions than one batch", "raise buffer.capacity"],
    ),
    Case(
        "per-prompt capacity below min_completions",
        ["--buffer.per_prompt_capacity=2", "--buffer.min_completions=3"],
        ["per_prompt_capacity 2 is below buffer.min_completions 3", "raise per_prompt_capacity"],
    ),
    Case(
        "beta_final without anneal steps",
        ["--objective.beta_final=0.01"],
        ["beta_final needs beta_anneal_steps > 0", "unset beta_final"],
    ),
    Case("resume without a run", ["--run.resume=true", "--run.name="], ["resume=true needs run.name"]),
    Case("unknown task", ["--task.name=maths"], ["'maths'", "'arithmetic', 'dataset', 'gsm8k'"]),
    Case("dataset task without rewards", ["--task.name=dataset", "--task.path=x.jsonl"], ["give reward_funcs"]),
    Case("config file missing", ["missing.yaml"], ["config file missing.yaml does not exist"]),
    Case("config file not YAML", ["{bad_yaml}"], ["is not valid YAML at line 3"]),
    Case("two config files", ["a.yaml", "b.yaml"], ["unexpected argument 'b.yaml'", "give one config file"]),
    Case("no GPU", ["--run.device=cuda", *DATA], ["run.device=cuda but no CUDA device", "use run.device=cpu"]),
    Case("not a device", ["--run.device=gpu", *DATA], ["run.device='gpu' is not a device", "use auto, cpu"]),
    # models
    Case(
        "missing local model",
        [*DATA, "--model.policy=./models/nope"],
        ["model.policy ./models/nope does not exist", "give a folder holding a saved model"],
    ),
    Case(
        "hub id without network",
        [*DATA, "--model.policy=someone/no-such-model"],
        ["'someone/no-such-model' is not in the local Hugging Face cache", "hf download someone/no-such-model"],
    ),
    Case(
        "folder without a tokenizer",
        [*DATA, "--model.policy={no_tokenizer}"],
        ["holds no tokenizer files", "set model.tokenizer"],
    ),
    Case("bare encoder", [*DATA, "--model.policy={bert}"], ["is a BertModel, not a causal language model"]),
    Case(
        "reward model as the policy",
        [*DATA, "--model.policy={classifier}"],
        ["is a Qwen2ForSequenceClassification, not a causal language model", "task.reward_model"],
    ),
    Case(
        "reward model as the reference",
        [*DATA, "--model.reference={classifier}"],
        ["model.reference", "not a causal language model"],
    ),
    Case(
        "tokenizer without EOS",
        [*DATA, "--model.tokenizer={no_eos}"],
        ["model.tokenizer", "has no EOS token", "tokenizer that has one"],
    ),
    Case("missing tokenizer", [*DATA, "--model.tokenizer=/no/tokenizer"], ["model.tokenizer /no/tokenizer does not"]),
    Case("unknown built-in model", ["--model.policy=builtin:tiny-chess"], ["unknown built-in model 'builtin:tiny"]),
    Case("unreadable weights", [*DATA, "--model.policy={corrupt}"], ["cannot load model", "SafetensorError"]),
    # data
    Case(
        "missing data file",
        [*DATA, "--task.path=./data/missing.jsonl"],
        ["task.path ./data/missing.jsonl does not exist"],
    ),
    Case(
        "missing column",
        [*DATA, "--task.prompt_column=question"],
        ["has no column 'question' (task.prompt_column)", "its columns are: prompt, answer"],
    ),
    Case("empty dataset", [*DATA, "--task.path={empty}"], ["empty.jsonl is empty", "at least one row"]),
    Case("unknown file type", [*DATA, "--task.path={txt}"], ["unknown file type '.txt'", ".jsonl"]),
    Case(
        "all prompts too long",
        [*DATA, "--task.max_prompt_tokens=2"],
        ["all 8 are longer than task.max_prompt_tokens=2", "raise it"],
    ),
    Case("evaluation takes every row", [*DATA, "--task.eval_size=12"], ["holds out every row", "lower task.eval_size"]),
    # reward functions
    Case(
        "reward file missing",
        [*DATA, "--task.reward_funcs=[./nope.py:score]"],
        ["nope.py' does not exist", "fix the path"],
    ),
    Case(
        "reward function not in the file",
        [*DATA, "--task.reward_funcs=[{rewards}:scor]"],
        ["has no attribute 'scor'", "it defines: constant, crashes, one_short"],
    ),
    Case(
        "reward module not importable",
        [*DATA, "--task.reward_funcs=[no_such_package.rewards:score]"],
        ["no_such_package"],
    ),
    Case(
        "reward function raises",
        [*DATA, "--task.reward_funcs=[{rewards}:crashes]"],
        ["raised ZeroDivisionError", "make it handle any completion"],
    ),
    Case(
        "answer function not in the file",
        [*DATA, "--task.answer_func={rewards}:answer"],
        ["task.answer_func", "has no attribute 'answer'", "it defines: constant, crashes, one_short"],
    ),
    Case(
        "reward function returns too few",
        [*DATA, "--task.reward_funcs=[{rewards}:one_short]"],
        ["returned 1 values for 2 completions", "return one reward per completion"],
    ),
    # run directories
    Case(
        "run exists",
        [*DATA, "--run.name=r"],
        ["already holds a run", "pick another run.name", "--run.resume=true"],
        before="trained",
    ),
    Case(
        "tools for a model without a chat template",
        ["--task.tools=[tba.tasks.calculator:calculator]"],
        ["task.tools: the tokenizer has no chat template", "Qwen2.5-0.5B-Instruct"],
    ),
    Case(
        "a tool that cannot be imported",
        ["--model.policy=builtin:tiny-tools", "--task.tools=[no_such_module:add]"],
        ["task.tools 'no_such_module:add': cannot import module 'no_such_module'"],
    ),
    Case(
        "tools and an environment",
        ["--task.tools=[tba.tasks.calculator:calculator]", "--task.environment=tba.tasks.calculator:calculator"],
        ["task.tools and task.environment", "leave task.environment unset"],
    ),
    Case(
        "an environment that is not one",
        ["--model.policy=builtin:tiny-tools", "--task.environment=tba.tasks.calculator:calculator"],
        ["task.environment: tba.tasks.calculator:calculator(**task.environment_args) failed"],
    ),
    Case(
        "output folder not writable",
        [*DATA, "--run.output_dir={data}/runs"],
        ["data.jsonl is a file, not a folder", "set run.output_dir to a writable folder"],
    ),
    Case(
        "resume a run that does not exist",
        [*DATA, "--run.name=r", "--run.resume=true"],
        ["runs/r does not exist", "drop --run.resume"],
    ),
    Case(
        "resume with nothing to resume",
        [*DATA, "--run.name=r", "--run.resume=true"],
        ["holds no checkpoint, so there is nothing to resume", "start afresh under another run.name"],
        before="no checkpoint",
    ),
]


def make_run_dir(run_dir: Path, how: str) -> None:
    (run_dir / "checkpoints").mkdir(parents=True)
    if how == "trained":
        (run_dir / "metrics.jsonl").write_text('{"step": 0, "time_s": 0.0}\n')


def files_under(path: Path) -> list[Path]:
    return sorted(path.rglob("*"))


def refuse_to_run(monkeypatch) -> None:
    """Whatever would start the run fails the test: the Ray runtime (its cluster and searcher
    actors), generation (the starting weights' evaluation, a searcher's step) and training (a
    trainer's step). A case that passes reported its bad input before any of it, however long the
    checks took."""
    import tba.runtime.async_loop
    import tba.runtime.sync_loop
    from tba.searcher import Searcher, StreamingSearcher
    from tba.trainer import Trainer

    def refused(what: str):
        def started(*args, **kwargs):
            raise AssertionError(f"{what} started: the bad input was not reported up front")

        return started

    for owner, name, what in [
        (tba.runtime.async_loop, "ray_session", "the Ray runtime"),
        (tba.runtime.sync_loop, "ray_session", "the Ray runtime"),
        (tba.runtime.async_loop, "evaluate_policy", "the starting weights' evaluation"),
        (tba.runtime.sync_loop, "evaluate_policy", "the starting weights' evaluation"),
        (Searcher, "step", "generation"),
        (StreamingSearcher, "step", "generation"),
        (Trainer, "step", "training"),
        (Trainer, "skip", "training"),
    ]:
        monkeypatch.setattr(owner, name, refused(what))


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_up_front_in_one_line(case: Case, world, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # relative paths in the cases resolve here
    runs = tmp_path / "runs"
    runs.mkdir()
    if case.before:
        make_run_dir(runs / "r", case.before)
    before = files_under(runs)
    args = [a.format(**world) for a in case.args]
    refuse_to_run(monkeypatch)  # so the failure must come first: no clock decides "up front"
    status = main(["train", f"--run.output_dir={runs}", f"--model.cache_dir={world['cache']}", *args])
    err = capsys.readouterr().err
    assert status == 2, err
    assert "Traceback" not in err
    message = err.strip().splitlines()[-1]
    assert message.startswith("tba: ")
    for words in case.says:
        assert words in message, f"{words!r} not in {message!r}"
    assert files_under(runs) == before, "a failed start must leave the run directories as they were"


def test_a_failed_start_does_not_block_its_run_name(tmp_path):
    """What a start that died before training leaves (a config, empty folders) is no run: the name is
    free again, and the clean-up removes it; a directory with training output is never removed."""
    from tba.config import load_config

    cfg = load_config(None, [f"--run.output_dir={tmp_path}", "--run.name=r"])
    started = tmp_path / "r"
    (started / "checkpoints").mkdir(parents=True)
    (started / "config.yaml").write_text("run: {}\n")
    assert check_run_dir(cfg.run, cfg.task.name) == started
    (started / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n{"step": 1}\n')
    assert not remove_unstarted(started) and started.is_dir()
    # the starting weights' evaluation: no training, but the name stays taken; the clean-up after a
    # failed start of this very directory removes it
    (started / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n')
    (started / "samples.jsonl").write_text('{"step": 0, "completion": "7"}\n')
    (started / "checkpoints" / "step_0").write_text("weights")
    assert not remove_unstarted(started, step_zero=True) and started.is_dir()  # a checkpoint is training output
    (started / "checkpoints" / "step_0").unlink()
    assert not remove_unstarted(started) and started.is_dir()
    assert remove_unstarted(started, step_zero=True) and not started.exists()


@pytest.mark.parametrize(
    ("debug", "args", "says"),
    [
        (False, ["--trainer.lrr=1e-4"], "trainer.lrr: unknown key (did you mean trainer.lr?)"),  # before torch loads
        (True, [*DATA, "--task.prompt_column=question"], "has no column 'question' (task.prompt_column)"),
    ],
    ids=["config", "data-debug"],
)
def test_the_command_line_exits_2_and_shows_the_traceback_only_with_debug(debug, args, says, world, tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TERM": "dumb"}
    proc = subprocess.run(
        [sys.executable, "-m", "tba", "train", *[a.format(**world) for a in args], *(["--debug"] if debug else [])],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("tba: ") and says in last
    assert ("Traceback (most recent call last)" in proc.stderr) == debug
    assert not (tmp_path / "runs").exists()
