"""The command line a person expects: a fast --help, --version, progress, a resume message, one name per meaning.

    python -m pytest tests/test_cli_ux.py -q
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from skipkv import cli
from skipkv.version import __version__


def test_help_imports_neither_torch_nor_transformers():
    code = ("import sys, time, contextlib, io\n"
            "t = time.perf_counter()\n"
            "from skipkv.cli import main\n"
            "out = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n"
            "    try:\n"
            "        main(['--help'])\n"
            "    except SystemExit:\n"
            "        pass\n"
            "print(time.perf_counter() - t, 'torch' in sys.modules, 'transformers' in sys.modules, "
            "'generate' in out.getvalue() and 'serve' in out.getvalue())\n")
    seconds, torch_in, transformers_in, listed = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert (torch_in, transformers_in, listed) == ("False", "False", "True")
    print(f"skipkv --help: {float(seconds):.3f} s in-process")


def test_command_table_matches_the_modules(capsys):
    parser = cli.build_parser()  # every module registers its own commands with their own help
    sub = next(a for a in parser._actions if a.dest == "command")
    assert {a.dest: a.help for a in sub._choices_actions} == {n: h for n, (_, h) in cli.COMMANDS.items()}
    assert [a.dest for a in sub._choices_actions] == list(cli.COMMANDS)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"skipkv {__version__}"


def test_max_tokens_everywhere_with_the_old_alias():
    for argv in (["generate", "x"], ["eval", "--model", "m", "--dataset", "gsm8k", "--out", "o"],
                 ["bench", "throughput"], ["steer", "build", "--model", "m", "--dataset", "d", "--limit", "1",
                                            "--layers", "1", "--out", "o"]):
        parser = cli.build_parser(argv[0])
        new = parser.parse_args(argv + ["--max-tokens", "7"])
        old = parser.parse_args(argv + ["--max-new-tokens", "7"])
        assert new.max_new_tokens == old.max_new_tokens == 7, argv


def test_reference_share_is_the_reference_budget(tmp_path, capsys):
    from skipkv.eval.cli import _budget_ratio

    parser = cli.build_parser("eval")
    base = ["eval", "--model", "m", "--dataset", "gsm8k", "--out", "o"]
    assert _budget_ratio(parser.parse_args(base + ["--reference-share", "0.2", "--reference", "r"])) == 0.2
    assert _budget_ratio(parser.parse_args(base + ["--budget-ratio", "0.2", "--reference", "r"])) == 0.2  # old
    assert cli.main(base + ["--reference-share", "0.2"]) == 2
    assert "needs --reference" in capsys.readouterr().err
    assert cli.main(base + ["--reference-share", "0.2", "--budget-ratio", "0.3", "--reference", "r"]) == 2
    assert "not both" in capsys.readouterr().err


def test_generate_shows_progress_for_several_prompts(tmp_path, capsys):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps(p) for p in ["one", "two", "three"]) + "\n")
    argv = ["generate", "--model", "random:qwen2", "--dtype", "fp32", "--max-tokens", "3", "--ignore-eos",
            "--prompts", str(prompts), "--json"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    assert len(out.out.splitlines()) == 3 and "3/3" in out.err and "generate" in out.err
    assert cli.main(argv + ["--no-progress"]) == 0
    assert "3/3" not in capsys.readouterr().err


def test_bench_decode_shows_progress(capsys):
    assert cli.main(["bench", "decode", "--model", "random:qwen2", "--policies", "full", "--lengths", "4,6",
                     "--span", "2", "--dtype", "fp32"]) == 0
    out = capsys.readouterr()
    assert "decode steps" in out.err and "5/5" in out.err and "| full |" in out.out


def test_eval_says_it_resumes(tmp_path, capsys):
    base = ["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--policy", "full", "--max-tokens", "4",
            "--dtype", "fp32", "--out", str(tmp_path / "run")]
    assert cli.main(base + ["--limit", "2"]) == 0
    assert "resuming" not in capsys.readouterr().err
    assert cli.main(base + ["--limit", "3"]) == 0
    assert "resuming: 2 of 3 records done" in capsys.readouterr().err


class _Bar:
    """Records what the progress bar shows at each update."""

    def __init__(self) -> None:
        self.postfix: dict = {}
        self.shown: list[dict] = []

    def set_postfix(self, refresh: bool = True, **kw) -> None:
        self.postfix = kw

    def update(self, n: int) -> None:
        self.shown.append(dict(self.postfix))


def test_running_accuracy_counts_the_example_just_finished():
    from skipkv.eval.runner import advance

    bar = _Bar()
    advance(bar, correct=1, finished=1, blind=False)
    advance(bar, correct=1, finished=2, blind=False)
    assert bar.shown == [{"acc": "1.000"}, {"acc": "0.500"}]
    blind = _Bar()
    advance(blind, correct=1, finished=1, blind=True)
    assert blind.shown == [{}]


def test_generate_takes_the_repetition_penalty(capsys):
    from skipkv.engine.cli import sampling_from_args

    args = cli.build_parser("generate").parse_args(["generate", "--repetition-penalty", "1.3", "x"])
    assert sampling_from_args(args).repetition_penalty == 1.3
    assert cli.main(["generate", "--model", "random:qwen2", "--repetition-penalty", "0", "x"]) == 2
    assert "repetition_penalty must be > 0.0" in capsys.readouterr().err
