"""Command line entry point: ``tba train [CONFIG.yaml] [--section.key=value ...]``.

The config is parsed and validated before torch is imported, so a typo fails in a fraction of
a second with the path of the offending key.
"""

from __future__ import annotations

import argparse
import sys

from tba import __version__
from tba.config import ConfigError, load_config

USAGE = """tba train [CONFIG.yaml] [--section.key=value ...]

Without a config file, trains the built-in demo: a tiny model learning integer arithmetic.
Examples:
  tba train
  tba train configs/demo.yaml --trainer.steps=100 --run.name=short
  tba train --objective.beta=0.1 --buffer.recent_prob=0.5
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
    args, overrides = parser.parse_known_args(argv)

    if args.command == "train":
        config_path = args.config
        if config_path is not None and config_path.startswith("--"):  # an override, not a file
            overrides.insert(0, config_path)
            config_path = None
        try:
            cfg = load_config(config_path, overrides)
        except ConfigError as err:
            print(f"tba: {err}", file=sys.stderr)
            return 2
        if args.print_config:
            from tba.config import dump_config

            print(dump_config(cfg), end="")
            return 0
        from tba.runtime.sync import run_sync  # imports torch: only once the config is valid

        try:
            run_sync(cfg)
        except (FileExistsError, FileNotFoundError) as err:
            print(f"tba: {err}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("tba: interrupted; what was written to the run directory is kept", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
