"""Configuration: defaults, YAML files, dotted overrides, validation messages, the CLI's config path."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tba.cli import main
from tba.config import Config, ConfigError, dump_config, load_config, parse_overrides
from tba.plan.auto import flat_weight, grad_clip


def write_yaml(tmp_path: Path, text: str, name: str = "cfg.yaml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


# --- defaults and merging -----------------------------------------------------------------------


def test_defaults_validate() -> None:
    cfg = load_config()
    assert cfg == Config()
    assert cfg.trainer.lr == 1e-4
    assert cfg.generation.group_size == 8
    assert cfg.objective.beta == 0.05
    assert cfg.objective.beta_final is None
    assert cfg.run.name is None and cfg.run.resume is False
    assert cfg.model.policy == "builtin:tiny-arithmetic"


def test_yaml_file_is_merged_into_defaults_and_overrides_win(tmp_path: Path) -> None:
    path = write_yaml(
        tmp_path,
        """
        run:
          name: from-file
          seed: 3
        trainer:
          lr: 0.001
          steps: 50
        """,
    )
    cfg = load_config(path)
    assert (cfg.run.name, cfg.run.seed, cfg.trainer.lr, cfg.trainer.steps) == ("from-file", 3, 0.001, 50)
    assert cfg.trainer.batch_prompts == 16  # untouched keys keep their defaults
    assert cfg.run.output_dir == "runs"

    cfg = load_config(str(path), ["--trainer.lr=2e-5", "--run.seed", "9", "--objective.beta=0.1"])
    assert cfg.trainer.lr == 2e-5  # override wins over the file
    assert cfg.trainer.steps == 50  # sibling key from the file survives the nested merge
    assert cfg.run.seed == 9
    assert cfg.run.name == "from-file"
    assert cfg.objective.beta == 0.1


def test_empty_yaml_file_means_defaults(tmp_path: Path) -> None:
    assert load_config(write_yaml(tmp_path, "")) == Config()


def test_missing_file_and_non_mapping_file_are_config_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"does not exist"):
        load_config(tmp_path / "nope.yaml")
    with pytest.raises(ConfigError, match=r"must hold a mapping of sections, got list"):
        load_config(write_yaml(tmp_path, "- 1\n- 2\n"))


# --- parse_overrides ----------------------------------------------------------------------------


def test_parse_overrides_equals_and_space_forms() -> None:
    tree = parse_overrides(["--a.b=c", "--a.d", "e", "--x.y.z=1", "--top=2"])
    assert tree == {"a": {"b": "c", "d": "e"}, "x": {"y": {"z": 1}}, "top": 2}


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("7", 7),
        ("-1", -1),
        ("0.5", 0.5),
        ("3.0e-4", 3e-4),
        ("true", True),
        ("false", False),
        ("null", None),
        ("~", None),
        ("hello", "hello"),
        ("cuda:1", "cuda:1"),
        ("", ""),
    ],
)
def test_override_values_are_yaml_scalars(raw: str, expected: object) -> None:
    value = parse_overrides([f"--s.k={raw}"])["s"]["k"]
    assert value == expected and type(value) is type(expected)
    value = parse_overrides(["--s.k", raw])["s"]["k"]
    assert value == expected and type(value) is type(expected)


def test_value_containing_equals_sign_is_kept_whole() -> None:
    assert parse_overrides(["--run.name=a=b"]) == {"run": {"name": "a=b"}}


def test_exponent_floats_reach_float_fields() -> None:
    # PyYAML reads "3e-4" (no dot) as a string; validation still makes it the float 0.0003.
    cfg = load_config(None, ["--trainer.lr=3e-4", "--objective.beta_final", "1e-3", "--objective.beta_anneal_steps=5"])
    assert cfg.trainer.lr == pytest.approx(3e-4, rel=1e-15) and isinstance(cfg.trainer.lr, float)
    assert cfg.objective.beta_final == pytest.approx(1e-3, rel=1e-15)


def test_typed_values_from_overrides() -> None:
    cfg = load_config(
        None,
        [
            "--trainer.steps=12",
            "--logging.tensorboard=true",
            "--trainer.grad_clip=null",
            "--buffer.per_prompt_capacity",
            "null",
            "--run.threads",
            "2",
            "--model.dtype=float32",
        ],
    )
    assert cfg.trainer.steps == 12 and isinstance(cfg.trainer.steps, int)
    assert cfg.logging.tensorboard is True
    assert cfg.trainer.grad_clip is None
    assert cfg.buffer.per_prompt_capacity is None
    assert cfg.run.threads == 2
    assert cfg.model.dtype == "float32"


def test_flat_weight_auto_is_zero_in_ray_and_one_in_sync() -> None:
    cfg = load_config(None)
    assert cfg.buffer.flat_weight == "auto"
    assert flat_weight(cfg.buffer, "ray") == 0.0 and flat_weight(cfg.buffer, "sync") == 1.0
    explicit = load_config(None, ["--buffer.flat_weight=0.25"]).buffer
    assert flat_weight(explicit, "ray") == flat_weight(explicit, "sync") == 0.25
    for bad in ("1.5", "-0.1", "nan"):
        with pytest.raises(ConfigError, match=r"flat_weight is a relative weight in \[0, 1\] or 'auto'"):
            load_config(None, [f"--buffer.flat_weight={bad}"])


def test_grad_clip_auto_is_none_for_tb_and_one_for_the_others() -> None:
    cfg = load_config(None)
    assert cfg.trainer.grad_clip == "auto" and cfg.objective.type == "tb"
    assert grad_clip(cfg.trainer, "tb") is None
    for kind in ("grpo", "dr_grpo", "ppo", "rloo", "online_dpo"):
        assert grad_clip(cfg.trainer, kind) == 1.0
    explicit = load_config(None, ["--trainer.grad_clip=0.5"]).trainer
    assert grad_clip(explicit, "tb") == 0.5 and grad_clip(explicit, "grpo") == 0.5
    off = load_config(None, ["--trainer.grad_clip=null"]).trainer
    assert grad_clip(off, "grpo") is None
    for bad in ("0", "-1"):
        with pytest.raises(ConfigError, match="grad_clip must be positive, None .no clipping. or 'auto'"):
            load_config(None, [f"--trainer.grad_clip={bad}"])
    with pytest.raises(ConfigError, match="trainer.grad_clip"):
        load_config(None, ["--trainer.grad_clip=often"])


@pytest.mark.parametrize(
    ("args", "match"),
    [
        (["trainer.lr=1"], r"expected an override like --section.key=value"),
        (["--trainer.lr"], r"override --trainer.lr has no value"),
        (["--trainer.lr", "--trainer.steps=3"], r"override --trainer.lr has no value"),
        (["--trainer..lr=1"], r"malformed override key 'trainer..lr'"),
        (["--trainer=1", "--trainer.lr=2"], r"override 'trainer.lr' conflicts with an earlier one"),
    ],
)
def test_malformed_overrides(args: list[str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        parse_overrides(args)


# --- validation errors --------------------------------------------------------------------------


def test_unknown_key_names_the_dotted_path() -> None:
    with pytest.raises(ConfigError, match=r"trainer\.lrr: unknown key"):
        load_config(None, ["--trainer.lrr=1e-4"])


def test_unknown_key_in_yaml_file(tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "generation:\n  temprature: 0.7\n")
    with pytest.raises(ConfigError, match=r"generation\.temprature: unknown key"):
        load_config(path)


def test_unknown_top_level_section() -> None:
    with pytest.raises(ConfigError, match=r"optimizer: unknown key"):
        load_config(None, ["--optimizer.lr=1"])


@pytest.mark.parametrize(
    ("override", "path"),
    [
        ("--trainer.lr=-1", "trainer.lr"),
        ("--trainer.lr=0", "trainer.lr"),
        ("--generation.group_size=1", "generation.group_size"),
        ("--objective.beta=0", "objective.beta"),
        ("--buffer.recent_prob=1.5", "buffer.recent_prob"),
        ("--trainer.steps=many", "trainer.steps"),
        ("--trainer.lr_schedule=step", "trainer.lr_schedule"),
        ("--task.operators=+/", "task"),
    ],
)
def test_bad_values_name_the_key(override: str, path: str) -> None:
    with pytest.raises(ConfigError, match=r"invalid configuration") as info:
        load_config(None, [override])
    assert f" {path}: " in str(info.value)


def test_every_bad_key_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, ["--trainer.lr=-1", "--trainer.lrr=2", "--bogus.x=1"])
    message = str(info.value)
    assert "trainer.lr: Input should be greater than 0 (got -1)" in message
    assert "trainer.lrr: unknown key" in message
    assert "bogus: unknown key" in message


def test_micro_batch_must_divide_batch() -> None:
    with pytest.raises(ConfigError, match=r"micro_batch_prompts 4 does not divide trainer.batch_prompts 6"):
        load_config(None, ["--trainer.batch_prompts=6", "--trainer.micro_batch_prompts=4"])
    cfg = load_config(None, ["--trainer.batch_prompts=6", "--trainer.micro_batch_prompts=3"])
    assert cfg.trainer.micro_batch_prompts == 3


def test_resume_needs_a_run_name() -> None:
    with pytest.raises(ConfigError, match=r"resume=true needs run.name"):
        load_config(None, ["--run.resume=true"])
    assert load_config(None, ["--run.resume=true", "--run.name=r1"]).run.resume is True


def test_beta_final_needs_anneal_steps() -> None:
    with pytest.raises(ConfigError, match=r"beta_final needs beta_anneal_steps > 0"):
        load_config(None, ["--objective.beta_final=0.01"])
    cfg = load_config(None, ["--objective.beta_final=0.01", "--objective.beta_anneal_steps=100"])
    assert (cfg.objective.beta_final, cfg.objective.beta_anneal_steps) == (0.01, 100)


def test_assignment_is_validated() -> None:
    cfg = Config()
    with pytest.raises(ValueError):
        cfg.trainer.lr = -1.0


# --- dump_config --------------------------------------------------------------------------------


def test_dump_config_round_trips(tmp_path: Path) -> None:
    cfg = load_config(
        None,
        [
            "--run.name=rt",
            "--trainer.lr=3e-4",
            "--objective.beta=0.014",
            "--objective.beta_final=0.004",
            "--objective.beta_anneal_steps=500",
            "--trainer.micro_batch_prompts=4",
            "--trainer.grad_clip=null",
            "--buffer.reward_inv_temp=1e-5",
        ],
    )
    text = dump_config(cfg)
    data = yaml.safe_load(text)
    assert list(data) == list(Config.model_fields)  # sections in schema order
    assert data["trainer"]["lr"] == 3e-4
    path = tmp_path / "dumped.yaml"
    path.write_text(text)
    again = load_config(path)
    assert again == cfg
    assert again.buffer.reward_inv_temp == 1e-5
    assert load_config(path) != Config()


def test_dump_of_defaults_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "defaults.yaml"
    path.write_text(dump_config(Config()))
    assert load_config(path) == Config()


# --- the CLI's config handling ------------------------------------------------------------------


def test_cli_print_config_shows_overrides(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    path = write_yaml(tmp_path, "trainer:\n  steps: 33\n")
    assert main(["train", str(path), "--trainer.lr=2e-4", "--print-config"]) == 0
    out = capsys.readouterr().out
    data = yaml.safe_load(out)
    assert data["trainer"]["steps"] == 33
    assert data["trainer"]["lr"] == 2e-4
    assert load_config(None, ["--trainer.steps=33", "--trainer.lr=2e-4"]) == Config.model_validate(data)


def test_cli_print_config_without_file(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--objective.beta=0.2", "--print-config"]) == 0
    data = yaml.safe_load(capsys.readouterr().out)
    assert data["objective"]["beta"] == 0.2
    assert Config.model_validate(data) == load_config(None, ["--objective.beta=0.2"])


@pytest.mark.parametrize(
    ("override", "needle"),
    [
        ("--trainer.lr=-1", "trainer.lr:"),
        ("--trainer.lrr=1", "trainer.lrr: unknown key"),
        ("--generation.group_size=1", "generation.group_size:"),
    ],
)
def test_cli_bad_override_exits_2_naming_the_key(capsys: pytest.CaptureFixture[str], override, needle) -> None:
    assert main(["train", override, "--print-config"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("tba: invalid configuration")
    assert needle in captured.err


def test_cli_missing_config_file_exits_2(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["train", str(tmp_path / "missing.yaml"), "--print-config"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_cli_requires_a_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main([])
    assert info.value.code == 2


def test_cli_space_separated_override(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "--trainer.steps", "5", "--print-config"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["trainer"]["steps"] == 5


def test_numeric_looking_names_stay_strings() -> None:
    cfg = load_config(None, ["--run.name=2024"])
    assert cfg.run.name == "2024"


def test_cli_rejects_a_second_positional_argument(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "a.yaml", "b.yaml"]) == 2
    assert "unexpected argument 'b.yaml'" in capsys.readouterr().err


def test_shipped_demo_config_is_the_default() -> None:
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "configs" / "demo.yaml"
    assert load_config(path) == load_config(None)


def test_task_sections_are_a_union_picked_by_name():
    from tba.config import DatasetTaskConfig, GSM8KTaskConfig

    assert load_config(None, ["--task.digits=1"]).task.name == "arithmetic"  # no name: the default task
    cfg = load_config(None, ["--task.name=gsm8k"])
    assert isinstance(cfg.task, GSM8KTaskConfig) and cfg.task.path == "openai/gsm8k" and cfg.task.eval_split == "test"
    cfg = load_config(None, ["--task.name=dataset", "--task.path=d.jsonl", "--task.reward_funcs=[m:f]"])
    assert isinstance(cfg.task, DatasetTaskConfig) and cfg.task.prompt_column == "prompt"
    with pytest.raises(ConfigError, match="'arithmetic', 'dataset', 'gsm8k'"):
        load_config(None, ["--task.name=nope"])
    with pytest.raises(ConfigError) as err:
        load_config(None, ["--task.name=dataset"])
    assert "task.path: Field required" in str(err.value)
    with pytest.raises(ConfigError, match="give reward_funcs"):
        load_config(None, ["--task.name=dataset", "--task.path=d.jsonl"])
    with pytest.raises(ConfigError, match="task.digits: unknown key"):  # an arithmetic key on another task
        load_config(None, ["--task.name=gsm8k", "--task.digits=2"])
    with pytest.raises(ConfigError, match="reward_weights has 2 entries for 1"):
        load_config(
            None, ["--task.name=dataset", "--task.path=d", "--task.reward_funcs=[m:f]", "--task.reward_weights=[1,2]"]
        )


def test_recipes_validate():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "configs"
    g = load_config(root / "gsm8k_rho1b.yaml")
    assert (g.generation.group_size, g.generation.samples_per_prompt, g.trainer.batch_prompts) == (20, 24, 7)
    assert (g.objective.beta, g.objective.beta_final, g.objective.beta_anneal_steps) == (0.014, 0.004, 500)
    assert g.trainer.steps == 700 and g.trainer.sync_interval == 2 and g.buffer.recent_prob == 0.95
    t = load_config(root / "tldr_pythia410m.yaml")
    assert t.task.name == "tldr" and t.generation.unfinished_reward == -1.0 and t.objective.beta_final_from == 32
    assert (t.buffer.recent_prob, t.buffer.reward_inv_temp, t.trainer.sync_interval) == (0.5, 1.0, 10)
    c = load_config(root / "custom_task.yaml")
    assert c.task.name == "dataset" and len(c.task.reward_funcs) == 2


def test_samples_per_prompt_and_pass_k_are_checked():
    with pytest.raises(ConfigError, match="samples_per_prompt 4 is below group_size 8"):
        load_config(None, ["--generation.samples_per_prompt=4"])
    with pytest.raises(ConfigError, match=r"pass_k \[8\] must lie between 1 and samples=4"):
        load_config(None, ["--eval.samples=4", "--eval.pass_k=[1, 8]"])


@pytest.mark.parametrize(
    "recipe", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs").glob("*.yaml"))
)
def test_every_recipe_prints_its_config(recipe: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = Path(__file__).resolve().parents[1] / "configs" / recipe
    assert main(["train", str(path), "--print-config"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["task"]["name"] == load_config(path).task.name


def test_model_folders_become_absolute_with_the_home_expanded(tmp_path: Path, monkeypatch) -> None:
    """A config may name a model folder from ``~`` or relative to where it runs: searcher processes
    and a resumed run get its absolute path; hub ids and built-in names stay as they are."""
    from tba.config import absolute_paths

    (tmp_path / "home" / "models" / "m").mkdir(parents=True)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path / "home")
    cfg = absolute_paths(
        load_config(None, ["--model.policy=~/models/m", "--model.reference=models/m", "--model.tokenizer=org/name"])
    )
    assert cfg.model.policy == cfg.model.reference == str(tmp_path / "home" / "models" / "m")
    assert cfg.model.tokenizer == "org/name"
    assert absolute_paths(load_config(None, [])).model.policy == "builtin:tiny-arithmetic"


def test_the_files_of_user_code_become_absolute_and_module_names_stay(tmp_path: Path, monkeypatch) -> None:
    """Reward functions, tools, an environment or an agent named by a file relative to where the
    run starts: searcher processes (another working directory) and a resumed run find the file."""
    from tba.config import absolute_paths

    for name in ("r.py", "t.py", "a.py"):
        (tmp_path / name).write_text("")
    monkeypatch.chdir(tmp_path)
    cfg = absolute_paths(
        load_config(
            None,
            [
                "--task.name=dataset",
                "--task.path=org/data",
                "--task.reward_funcs=[r.py:f, my.module:g]",
                "--task.tools=[t.py:calc]",
            ],
        )
    )
    assert cfg.task.reward_funcs == [f"{tmp_path / 'r.py'}:f", "my.module:g"]
    assert cfg.task.tools == [f"{tmp_path / 't.py'}:calc"]
    agent = absolute_paths(load_config(None, ["--task.agent=a.py:run"]))
    assert agent.task.agent == f"{tmp_path / 'a.py'}:run"
    assert absolute_paths(load_config(None, ["--task.environment=pkg.envs:Env"])).task.environment == "pkg.envs:Env"
