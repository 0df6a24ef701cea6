"""The `skipkv` command line: generate | policies | models | eval | sweep | report | show | bench | steer | calibrate |
serve.

    skipkv generate --model random:qwen2 --policy rkv --budget 64 --max-new-tokens 50 --json "Hello"
    skipkv policies

Every subcommand lives in the module that owns it (it exposes `register(subparsers)`); this file only
assembles them and turns a SkipKVError into a one-line message with exit code 2; so are an OSError (the
environment refused a file operation) and a UnicodeDecodeError (a binary file where text was expected) that
reach it, and nothing else: any other exception is a bug and keeps its traceback.
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
    "skipkv.eval.steer_cli",
    "skipkv.eval.calibrate",
    "skipkv.serve.cli",
]


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "unknown error"


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
        print(f"skipkv: error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except UnicodeDecodeError as exc:
        # A file read at the edge that is not text (a binary file given where a text one is expected).
        print(f"skipkv: error: a file is not {exc.encoding} text (byte {exc.start}: {exc.reason})", file=sys.stderr)
        return 2
    except OSError as exc:
        # The environment refused a file operation (missing, unwritable, disk full ...): not a bug of ours.
        # Programming errors (TypeError, KeyError, ...) are not caught: they keep their traceback.
        where = f": {exc.filename}" if exc.filename else ""
        print(f"skipkv: error: {_one_line(exc.strerror or str(exc))}{where}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("skipkv: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
