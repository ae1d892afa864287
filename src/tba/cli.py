"""Command line entry point: ``tba train [CONFIG.yaml] [--section.key=value ...] [--debug]``, and
``tba eval`` (:mod:`tba.eval_command`) and ``tba plot`` (:mod:`tba.plots`).

The config is parsed and validated before torch is imported, so a typo fails in a fraction of
a second with the path of the offending key. Everything else a user can get wrong (paths, models,
data, reward functions, the run directory) is checked before training starts and raises a
:class:`tba.errors.UserError`: one line that says what to fix, exit status 2, the traceback only
with ``--debug``. A start that fails leaves no run directory behind. Other exceptions are bugs and
keep their traceback.
"""

from __future__ import annotations

import argparse
import signal
import sys

from tba import __version__, allocator
from tba.config import ConfigError, absolute_paths, dump_config, load_config
from tba.errors import Terminated, UserError, interrupt_on_sigterm, report, sigterm_received
from tba.runtime.errors import RunFailed

USAGE = """tba train [CONFIG.yaml] [--section.key=value ...] [--print-config] [--print-plan [--hardware=SPEC]]
                 [--parts-from=RUN] [--debug]

Without a config file, trains the built-in demo: a tiny model learning integer arithmetic.
Examples:
  tba train
  tba train configs/demo.yaml --trainer.steps=100 --run.name=short
  tba train --objective.beta=0.1 --buffer.recent_prob=0.5
Bad input stops the run before training with one line that says what to fix (exit status 2);
--debug adds the traceback.
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="tba", description="Trajectory Balance with Asynchrony: RL post-training of language models."
    )
    parser.add_argument("--version", action="version", version=f"tba {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    train = sub.add_parser("train", usage=USAGE, help="train a policy (the built-in demo without a config)")
    train.add_argument("config", nargs="?", help="YAML config file; keys override the defaults")
    train.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    train.add_argument(
        "--print-plan", action="store_true", help="print the run plan for this machine and exit (loads no model)"
    )
    train.add_argument(
        "--hardware",
        metavar="SPEC",
        help="with --print-plan: plan for a described machine instead (8xh100, 2x8xh100 for two nodes, cpu:16)",
    )
    train.add_argument(
        "--parts-from",
        metavar="RUN",
        help="predict this run's pace (and the other layouts') from the parts a finished run measured (its folder)",
    )
    train.add_argument("--debug", action="store_true", help="show the traceback of a bad-input error too")
    sub.add_parser("eval", help="evaluate a run, a checkpoint or a model on its task (tba eval -h)", add_help=False)
    sub.add_parser("plot", help="plot and compare runs (tba plot -h)", add_help=False)
    entry_point = argv is None  # the process's own command line: it may re-execute itself
    argv = list(sys.argv[1:] if argv is None else argv)
    if entry_point:
        allocator.restore_environment()
    # each command's modules load only when it runs: matplotlib for plot, torch for eval and train
    # (after the config validated, so a typo fails in a fraction of a second)
    if argv and argv[0] == "plot":
        from tba.plots import cli_main as plot_main

        return plot_main(argv[1:])
    if argv and argv[0] == "eval":
        from tba.eval_command import cli_main as eval_main

        return eval_main(argv[1:])
    if not argv or argv[0] != "train" or any(a in ("-h", "--help") for a in argv[1:]):
        parser.parse_args(argv)  # usage, --version, --help and unknown commands
        return 2
    debug, print_plan = "--debug" in argv[1:], "--print-plan" in argv[1:]
    for flag in ("--hardware", "--parts-from"):
        if flag in argv[:-1]:  # the space-separated form
            i = argv.index(flag)
            argv[i : i + 2] = [f"{flag}={argv[i + 1]}"]
    machines = [a for a in argv[1:] if a.startswith("--hardware=")]
    measured = [a.split("=", 1)[1] for a in argv[1:] if a.startswith("--parts-from=")]
    try:
        if machines and not print_plan:
            raise ConfigError("--hardware describes a machine for --print-plan; add --print-plan (or drop it)")
        rest = [a for a in argv[1:] if a != "--debug" and a not in machines and not a.startswith("--parts-from=")]
        config_path, overrides, print_config = split_train_args(rest)
        cfg = load_config(config_path, overrides)
    except ConfigError as err:
        return report(err, debug)
    if print_config:
        print(dump_config(cfg), end="")
        return 0
    if print_plan:  # the decisions tba train would take here, before anything loads
        from tba.plan import plan_run
        from tba.plan.machines import described

        try:
            hardware = described(machines[-1].split("=", 1)[1]) if machines else None
            planned, plan = plan_run(absolute_paths(cfg), hardware=hardware)
            print("\n".join(plan.lines()))
            if measured:
                print("\n".join(pace_lines(planned, plan, measured[-1])))
        except (ConfigError, UserError) as err:
            return report(err, debug)
        return 0
    # the ray runtime's driver runs under jemalloc: a process of its own, started before the heavy
    # imports where the config names the runtime, else once the plan has chosen it
    if entry_point and cfg.runtime.type == "ray" and (failed := under_jemalloc(argv, debug)) is not None:
        return failed
    from tba.plan import plan_run  # which runtime runs decides the rest (the hardware: imports torch)

    try:
        cfg, plan = plan_run(absolute_paths(cfg))
    except ConfigError as err:
        return report(err, debug)
    if entry_point and plan.runtime == "ray" and (failed := under_jemalloc(argv, debug)) is not None:
        return failed
    if measured:
        try:
            print("\n".join(pace_lines(cfg, plan, measured[-1])), file=sys.stderr)
        except UserError as err:
            return report(err, debug)
    if plan.runtime == "ray":  # imports torch and ray: only once the config is valid
        from tba.runtime.async_loop import run_ray as train
    else:
        from tba.runtime.sync_loop import run_sync as train

    old_sigterm = interrupt_on_sigterm()  # the ray runtime sets it again after ray.init
    try:
        run_or_clean_up(train, cfg, plan)
    except UserError as err:
        return report(err, debug)
    except RunFailed as err:
        print(f"tba: {err}", file=sys.stderr)
        print("tba: what was written to the run directory is kept", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        # the shell's convention: 128 + the signal's number (SIGINT 2, SIGTERM 15)
        terminated = isinstance(err, Terminated) or sigterm_received()
        stopped = "terminated (SIGTERM)" if terminated else "interrupted"
        print(f"tba: {stopped}; what was written to the run directory is kept", file=sys.stderr)
        return 143 if terminated else 130
    finally:
        if old_sigterm is not None:
            signal.signal(signal.SIGTERM, old_sigterm)
    return 0


def pace_lines(cfg, plan, run_dir: str) -> list[str]:
    """What the parts measured by the run in ``run_dir`` predict for this run's layout and the others."""
    from tba.runtime.pace import foreseen, parts_of_run, run_layout

    parts, source = parts_of_run(run_dir)
    return foreseen(parts, run_layout(cfg.trainer, cfg.generation, plan, cfg.runtime.num_searchers), source)


def under_jemalloc(argv: list[str], debug: bool) -> int | None:
    """Re-execute ``tba ARGV`` under jemalloc (returns only where that does not apply: None), or the
    exit code of a jemalloc setting that cannot be honoured."""
    try:
        allocator.reexec_under_jemalloc(argv)
    except ValueError as err:
        return report(UserError(str(err)), debug)
    return None


def run_or_clean_up(train, cfg, plan) -> None:
    """``train(cfg, plan=plan)``; if it raises, remove the run directory that this start created, unless training
    wrote something there (the evaluation of the starting weights is not training), so that a
    failed start does not block reusing the run's name."""
    from tba.runtime.run_dir import created_run_dirs, remove_unstarted  # torch: only once a run starts

    created_run_dirs.clear()
    try:
        train(cfg, plan=plan)
    except BaseException:
        for run_dir in created_run_dirs:
            remove_unstarted(run_dir, step_zero=True)
        raise


def split_train_args(args: list[str]) -> tuple[str | None, list[str], bool]:
    """``[CONFIG] [--print-config] [--print-plan] [--a.b=c | --a.b c ...]`` → (config path, overrides,
    whether to print the config); ``--print-plan`` is left to the caller."""
    config_path, overrides, print_config = None, [], False
    i = 0
    while i < len(args):
        arg = args[i]
        if arg == "--print-config":
            print_config = True
        elif arg == "--print-plan":  # a flag main reads itself
            pass
        elif arg.startswith("--"):
            overrides.append(arg)
            if "=" not in arg and i + 1 < len(args) and not args[i + 1].startswith("--"):
                overrides.append(args[i + 1])  # the space-separated form: --a.b VALUE
                i += 1
        elif config_path is None:
            config_path = arg
        else:
            raise ConfigError(f"unexpected argument {arg!r}: give one config file, then --section.key=value overrides")
        i += 1
    return config_path, overrides, print_config


if __name__ == "__main__":
    sys.exit(main())
