"""The `skipkv` command line: generate | policies | models | eval | sweep | report | show | bench | steer | calibrate |
serve.

    skipkv generate --model random:qwen2 --policy rkv --budget 64 --max-tokens 50 --json "Hello"
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

# Every subcommand: the module that registers it (its `register(subparsers)` adds it with all its flags) and the
# one-line help `skipkv --help` lists, in --help order. Only the module of the command being run is imported, so
# `skipkv --help` and `skipkv --version` import neither torch nor transformers (tests/test_cli_ux.py checks
# these lines against the modules' own).
COMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("skipkv.engine.cli", "generate completions with a compressed KV cache"),
    "policies": ("skipkv.engine.cli", "list KV-cache policies and their knobs"),
    "models": ("skipkv.models.cli", "pull and list offline pretrained models"),
    "eval": ("skipkv.eval.cli", "evaluate a policy on a benchmark (resumable)"),
    "sweep": ("skipkv.sweep", "run an eval grid (dataset x policy x budget x seed) from a YAML file"),
    "report": ("skipkv.report.cli", "tables and plots from run dirs (reads records; runs no model)"),
    "pack": ("skipkv.report.cli",
             "slim and compress finished run dirs' records (each prompt -> its sha256; gzip), read transparently"),
    "show": ("skipkv.report.cli", "HTML pages of what the cache kept, per example (runs traced with --trace)"),
    "bench": ("skipkv.report.bench_tools", "benchmarks (tables + JSON) and the tools that read finished runs"),
    "steer": ("skipkv.eval.steer_cli", "steering vectors (SEAL / SkipKV)"),
    "calibrate": ("skipkv.eval.calibrate", "TriAttention's per-model query statistics"),
    "serve": ("skipkv.serve.cli",
              "OpenAI-compatible server (/v1/completions, /v1/chat/completions, streaming)"),
}
COMMAND_MODULES = list(dict.fromkeys(module for module, _ in COMMANDS.values()))


class OneLineParser(argparse.ArgumentParser):
    """argparse, but a usage error is one line on stderr and exit code 2 (no usage dump)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message}\n")


def _one_line(text: str) -> str:
    return " ".join(text.split()) or "unknown error"


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser; with the flags of `command` only (None: every command's, importing every module)."""
    from skipkv.version import __version__

    parser = OneLineParser(prog="skipkv", description="LLM generation with a compressed KV cache.")
    parser.add_argument("--version", action="version", version=f"skipkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    full = [m for m in COMMAND_MODULES if command is None or COMMANDS.get(command, ("",))[0] == m]
    for module in full:
        importlib.import_module(module).register(sub)
    registered = set(sub.choices)
    for name, (_, help_text) in COMMANDS.items():
        if name not in registered:  # listed in --help; its flags are built only when it runs
            sub.add_parser(name, help=help_text)
    # --help order: the table's, whichever module registered what
    sub._choices_actions.sort(key=lambda a: list(COMMANDS).index(a.dest))
    return parser


def _command(argv: list[str]) -> str | None:
    """The subcommand named in argv (the first word that is not an option), if any."""
    return next((a for a in argv if not a.startswith("-")), None)


# Arguments that name files or folders: any bytes the OS allows, so an undecodable byte (kept by Python as a
# lone surrogate, PEP 383) is legitimate there and goes back to the OS as the same byte.
PATH_ARGS = frozenset({"out", "prompts", "data", "reference", "dirs", "config", "steering", "plot", "model"})


_FLAG_NAMES = {"prompt": "PROMPT", "example_id": "--id"}  # dests whose flag is not --<dest>


def check_arguments(args: argparse.Namespace) -> None:
    """Text is checked once, here at the edge: every text argument (a prompt, a stop string, a name, a key) must be
    encodable Unicode, or the command stops with one line, before a tokenizer or a server sees it."""
    from skipkv.files import check_text

    for name, value in vars(args).items():
        if name in PATH_ARGS:
            continue
        for i, v in enumerate(value if isinstance(value, (list, tuple)) else [value]):
            if isinstance(v, str):
                flag = _FLAG_NAMES.get(name) or f"--{name.removeprefix('knob_').replace('_', '-')}"
                check_text(v, f"{flag}" + (f" {i}" if isinstance(value, (list, tuple)) else ""))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(_command(argv) or "")
    args = parser.parse_args(argv)
    try:
        check_arguments(args)
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
