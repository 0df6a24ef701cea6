"""The `skipkv` command line: generate | policies | models | eval | sweep | report | bench | serve.

    skipkv generate --model random:qwen2 --policy rkv --budget 64 --max-new-tokens 50 --json "Hello"
    skipkv policies

Every subcommand lives in the module that owns it (it exposes `register(subparsers)`); this file only
assembles them and turns a SkipKVError into a one-line message with exit code 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from skipkv.errors import SkipKVError

# Modules that contribute subcommands, in the order they appear in --help.
COMMAND_MODULES = [
    "skipkv.engine.cli",
    "skipkv.models.cli",
    "skipkv.eval.cli",
    "skipkv.sweep",
    "skipkv.report.cli",
    "skipkv.bench.cli",
    "skipkv.serve.cli",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}\n")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="skipkv", description="LLM generation with a compressed KV cache.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SkipKVError as exc:
        print(f"skipkv: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("skipkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
