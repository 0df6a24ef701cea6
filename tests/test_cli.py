"""Bad input gives one line on stderr and exit code 2; good input gives one JSON object per request."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from skipkv.cli import main


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        code = main(argv)
    except SystemExit as exc:  # argparse usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


BAD = {
    "budget_le_window": ["--policy", "rkv", "--budget", "8", "--window", "8", "hi"],
    "unknown_policy": ["--policy", "nope", "hi"],
    "unknown_family": ["--model", "random:gpt2", "hi"],
    "empty_prompt": ["   "],
    "too_long": ["x" * 5000],
    "zero_new_tokens": ["--max-new-tokens", "0", "hi"],
    "negative_new_tokens": ["--max-new-tokens", "-3", "hi"],
    "knob_of_other_policy": ["--policy", "rkv", "--prefill-window", "4", "hi"],
    "no_prompt": [],
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_one_line_exit_2(case, capsys):
    argv = ["generate", "--model", "random:qwen2", "--max-new-tokens", "4", *BAD[case]]
    if case == "unknown_family":
        argv = ["generate", "--max-new-tokens", "4", *BAD[case]]
    code, out, err = run(argv, capsys)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "error" in lines[0], err
    assert "Traceback" not in err


def test_json_output(capsys):
    code, out, err = run(["generate", "--model", "random:qwen2", "--policy", "rkv", "--budget", "16", "--interval", "4",
                          "--window", "4", "--max-new-tokens", "30", "--ignore-eos", "--json", "--raw", "a",
                          "a bit longer"], capsys)
    assert code == 0, err
    rows = [json.loads(line) for line in out.strip().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1]
    for r in rows:
        assert {"text", "prompt_tokens", "generated_tokens", "peak_kv_tokens", "peak_kv_bytes",
                "compressions"} <= set(r)
        assert r["generated_tokens"] == 30 and r["peak_kv_tokens"] <= 20 and r["compressions"] >= 1


def test_real_exit_code_from_a_subprocess(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "skipkv.cli", "generate", "--model", "random:qwen2",
                           "--policy", "nope", "hi"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "unknown policy" in proc.stderr


def test_prompts_file(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "one"}\n"two"\n')
    code, out, _ = run(["generate", "--model", "random:qwen2", "--max-new-tokens", "3", "--json", "--prompts", str(f)],
                       capsys)
    assert code == 0 and len(out.strip().splitlines()) == 2
    f.write_text('{"nope": 1}\n')
    code, _, err = run(["generate", "--model", "random:qwen2", "--prompts", str(f)], capsys)
    assert code == 2 and "prompt" in err
