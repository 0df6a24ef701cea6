"""The eval runner end to end on a tiny random model through the real engine: the issue's command twice,
resume after kill -9, refusal to mix configs, budget ratios, samples, summary arithmetic."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import skipkv
from skipkv.cli import main
from skipkv.errors import SkipKVError
from skipkv.eval.runner import EvalConfig, run_eval, sample_seed, summarize

ISSUE_ARGS = ["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--limit", "6", "--policy", "rkv",
              "--budget", "32", "--interval", "8", "--max-new-tokens", "40", "--quiet"]


def records(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "records.jsonl").read_text().splitlines()]


def small(out: Path, **kw) -> EvalConfig:
    args = dict(model="random:qwen2", dataset="gsm8k", policy="rkv", out=str(out), budget=32,
                policy_knobs={"interval": 8}, limit=4, max_new_tokens=16, dtype="fp32", quiet=True)
    return EvalConfig(**{**args, **kw})


def test_issue_command_twice(tmp_path: Path) -> None:
    out = tmp_path / "run"
    assert main(ISSUE_ARGS + ["--out", str(out)]) == 0
    first = (out / "records.jsonl").read_bytes()
    assert main(ISSUE_ARGS + ["--out", str(out)]) == 0
    assert (out / "records.jsonl").read_bytes() == first  # the second run found everything done
    rows = records(out)
    assert len(rows) == 6 and len({(r["id"], r["sample"]) for r in rows}) == 6
    summary = json.loads((out / "summary.json").read_text())
    assert summary["n"] == 6 and summary["complete"] is True
    assert summary["mean_generated_tokens"] == pytest.approx(sum(r["generated_tokens"] for r in rows) / 6)
    config = json.loads((out / "config.json").read_text())
    assert config["policy"]["name"] == "rkv" and config["policy"]["budget"] == 32 and config["policy"]["interval"] == 8
    assert config["sampling"]["max_new_tokens"] == 40 and config["environment"]["versions"]["torch"]
    for r in rows:
        assert r["budget"] == 32 and 0 < r["generated_tokens"] <= 40
        assert r["prompt"].startswith("<|im_start|>user\nAnswer the following questions.")
        assert r["peak_kv_bytes"] > 0 and isinstance(r["correct"], bool)


def test_resume_after_kill_9(tmp_path: Path) -> None:
    out, ref = tmp_path / "killed", tmp_path / "uninterrupted"
    args = ["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--limit", "4", "--policy", "rkv", "--budget",
            "16", "--interval", "4", "--max-new-tokens", "24", "--dtype", "fp32", "--quiet"]
    src = str(Path(skipkv.__file__).parent.parent)
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.Popen([sys.executable, "-m", "skipkv.cli", *args, "--batch-size", "1", "--out", str(out)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    path = out / "records.jsonl"
    deadline = time.time() + 60
    while time.time() < deadline and proc.poll() is None:
        if path.exists() and path.read_bytes().count(b"\n") >= 1:
            break
        time.sleep(0.01)
    assert proc.poll() is None, f"the run ended before it could be killed: {proc.stderr.read().decode()[-500:]}"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    before = path.read_bytes()
    done_before = before.count(b"\n")
    assert 1 <= done_before < 4
    # A write cut in half by the kill (possible in principle; simulated here).
    with open(path, "ab") as f:
        f.write(b'{"id": "gsm8k-test-0003", "sample": 0, "prompt": "<|im_sta')

    assert main(args + ["--out", str(out)]) == 0
    after = path.read_bytes()
    assert after.startswith(before)  # finished records were kept byte for byte
    rows = records(out)
    assert len(rows) == 4 and len({(r["id"], r["sample"]) for r in rows}) == 4
    assert len({r["session"] for r in rows}) == 2

    # Same records as a run that was never interrupted (greedy; a different batch size on purpose).
    assert main(args + ["--batch-size", "8", "--out", str(ref)]) == 0
    by_key = {(r["id"], r["sample"]): r for r in records(ref)}
    for r in rows:
        twin = by_key[(r["id"], r["sample"])]
        for key in ("prompt", "output", "generated_tokens", "correct", "extracted", "seed"):
            assert r[key] == twin[key], (r["id"], key)


def test_a_different_config_is_refused_and_a_larger_limit_extends(tmp_path: Path, capsys) -> None:
    out = tmp_path / "run"
    run_eval(small(out, limit=1))
    first = (out / "records.jsonl").read_bytes()
    with pytest.raises(SkipKVError, match=r"different run: policy.budget \(32 -> 48\)"):
        run_eval(small(out, limit=1, budget=48))
    with pytest.raises(SkipKVError, match="prompt_style"):
        run_eval(small(out, limit=1, prompt_style="raw"))
    # through the CLI: exit code 2 and one line on stderr
    code = main(["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--policy", "rkv", "--budget", "32",
                 "--interval", "8", "--max-new-tokens", "17", "--dtype", "fp32", "--limit", "1", "--quiet",
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "sampling.max_new_tokens (16 -> 17)" in err
    assert (out / "records.jsonl").read_bytes() == first
    # limit, samples and batch size are not part of a run's identity: a larger limit extends it
    run_eval(small(out, limit=2, batch_size=3))
    assert (out / "records.jsonl").read_bytes().startswith(first)
    assert [r["id"] for r in records(out)] == ["gsm8k-test-0000", "gsm8k-test-0001"]


def test_blind_runs_show_progress_but_no_accuracy(tmp_path: Path, capsys) -> None:
    """`--blind` (and every sweep cell): the progress bar and the closing line leave the accuracy out; the run
    and its records are the same."""
    args = ["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--policy", "full", "--max-new-tokens", "4",
            "--dtype", "fp32", "--limit", "2"]
    assert main(args + ["--out", str(tmp_path / "seen")]) == 0
    seen = capsys.readouterr()
    assert "acc=" in seen.err and "accuracy" in seen.out
    assert main(args + ["--blind", "--out", str(tmp_path / "blind")]) == 0
    blind = capsys.readouterr()
    assert "acc=" not in blind.err and "accuracy" not in blind.out
    assert "2/2" in blind.err and "2 examples" in blind.out
    assert [r["output"] for r in records(tmp_path / "blind")] == [r["output"] for r in records(tmp_path / "seen")]


def test_budget_ratio_from_a_full_reference(tmp_path: Path) -> None:
    full, rkv = tmp_path / "full", tmp_path / "rkv"
    run_eval(small(full, policy="full", budget=None, policy_knobs={}, limit=2, max_new_tokens=20))
    mean = json.loads((full / "summary.json").read_text())["mean_generated_tokens"]
    run_eval(small(rkv, budget=None, budget_ratio=0.6, reference=str(full), limit=2, max_new_tokens=20,
                   policy_knobs={"window": 2, "interval": 4}))
    config = json.loads((rkv / "config.json").read_text())
    assert config["budget_mode"] == "reference"
    assert config["policy"]["budget"] == round(0.6 * mean)
    assert config["budget_reference"] == {"mean_generated_tokens": mean}
    assert {r["budget"] for r in records(rkv)} == {round(0.6 * mean)}
    with pytest.raises(SkipKVError, match="full-cache run"):
        run_eval(small(tmp_path / "x", budget=None, budget_ratio=0.5, reference=str(rkv)))
    with pytest.raises(SkipKVError, match="needs --reference"):
        run_eval(small(tmp_path / "y", budget=None, budget_ratio=0.5))
    with pytest.raises(SkipKVError, match="either --budget or --budget-ratio"):
        run_eval(small(tmp_path / "z", budget_ratio=0.5, reference=str(full)))


def test_long_context_budget_is_a_fraction_of_each_length(tmp_path: Path) -> None:
    out = tmp_path / "niah"
    run_eval(EvalConfig(model="random:qwen2", dataset="niah", policy="snapkv", out=str(out), budget_ratio=0.25,
                        dataset_options={"lengths": [400, 600], "depths": [0.0, 1.0]}, max_new_tokens=4,
                        dtype="fp32", quiet=True))
    rows = records(out)
    assert sorted((r["length"], r["depth"]) for r in rows) == [(400, 0.0), (400, 1.0), (600, 0.0), (600, 1.0)]
    for r in rows:
        assert r["budget"] == round(0.25 * r["length"])
        assert r["length"] - 12 <= r["prompt_tokens"] <= r["length"]
        assert r["compressions"] >= 1  # the prompt is longer than the budget
    config = json.loads((out / "config.json").read_text())
    assert config["budget_mode"] == "prompt_length" and config["policy"]["budget"] is None
    assert config["dataset"]["lengths"] == [400, 600]
    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["by"]["length"]) == {"400", "600"} and set(summary["by"]["depth"]) == {"0.0", "1.0"}
    with pytest.raises(SkipKVError, match="context"):
        run_eval(EvalConfig(model="random:qwen2", dataset="niah", policy="full", out=str(tmp_path / "long"),
                            dataset_options={"lengths": [8192]}, quiet=True))


def test_samples_and_code_grading(tmp_path: Path) -> None:
    out = tmp_path / "he"
    run_eval(EvalConfig(model="random:qwen2", dataset="humaneval", policy="full", out=str(out), limit=2, samples=2,
                        temperature=0.8, max_new_tokens=6, prompt_style="raw", dtype="fp32", quiet=True,
                        grader_options={"timeout_s": 3.0}))
    rows = records(out)
    assert sorted((r["id"], r["sample"]) for r in rows) == [("HumanEval/0", 0), ("HumanEval/0", 1),
                                                              ("HumanEval/1", 0), ("HumanEval/1", 1)]
    assert len({r["seed"] for r in rows}) == 4
    assert all(r["seed"] == sample_seed(0, r["id"], r["sample"]) for r in rows)
    assert all(r["grade_detail"] and not r["correct"] for r in rows)  # random weights write no working code
    config = json.loads((out / "config.json").read_text())
    assert config["sampling"]["stop"] and config["grader"]["timeout_s"] == 3.0
    assert json.loads((out / "summary.json").read_text())["samples"] == 2
    with pytest.raises(SkipKVError, match="temperature"):
        run_eval(small(tmp_path / "greedy", samples=2))
    with pytest.raises(SkipKVError, match="has no option"):
        run_eval(small(tmp_path / "opt", grader_options={"timeout_s": 1.0, "colour": "red"}))


def test_one_writer_per_directory(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    with open(out / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        with pytest.raises(SkipKVError, match="another skipkv eval"):
            run_eval(small(out))


def test_summary_arithmetic() -> None:
    def r(i: str, s: int, ok: bool, gen: int, session: float, t: float) -> dict:
        return {"id": i, "sample": s, "correct": ok, "score": float(ok), "generated_tokens": gen, "prompt_tokens": 10,
                "peak_kv_tokens": 10 + gen, "peak_kv_bytes": 100 * (10 + gen), "compressions": 1,
                "decode_peak_kv_tokens": gen, "decode_peak_kv_bytes": 100 * gen,
                "finish_reason": "eos", "session": session, "finished_at": t}

    rows = [r("a", 0, True, 10, 0.0, 1.0), r("a", 1, False, 20, 0.0, 2.0), r("a", 2, True, 30, 5.0, 6.0),
            r("a", 3, True, 40, 5.0, 7.0), r("b", 0, False, 50, 5.0, 8.0)]
    s = summarize(rows)
    # pass@1: a = 3/4, b = 0/1 -> (0.75 + 0) / 2, not 3/5
    assert s["accuracy"] == pytest.approx(0.375)
    assert (s["n"], s["n_examples"], s["samples"]) == (5, 2, 4)
    assert s["mean_generated_tokens"] == 30 and s["peak_kv_tokens"] == 60 and s["peak_kv_bytes"] == 6000
    assert s["mean_decode_peak_kv_tokens"] == 30 and s["mean_decode_peak_kv_bytes"] == 3000
    # two sessions: 30 tokens in 2 s, then 120 tokens in 3 s
    assert s["tokens_per_second"] == pytest.approx(150 / 5)
    assert summarize([]) == {"n": 0, "n_examples": 0}


def test_sample_seeds_are_stable_and_distinct() -> None:
    assert sample_seed(0, "x", 0) == sample_seed(0, "x", 0)
    seeds = {sample_seed(s, i, k) for s in (0, 1) for i in ("x", "y") for k in range(3)}
    assert len(seeds) == 12 and all(0 <= v < 2**31 for v in seeds)


def test_a_knob_added_later_at_its_default_still_resumes(tmp_path: Path) -> None:
    """A run dir written before a knob existed (its config lacks `protect_prompt`) resumes when the knob is at
    its default, and is refused when it is set otherwise."""
    out = tmp_path / "run"
    run_eval(small(out, limit=1))
    path = out / "config.json"
    config = json.loads(path.read_text())
    assert config["policy"].pop("protect_prompt") is False
    path.write_text(json.dumps(config))
    first = (out / "records.jsonl").read_bytes()
    run_eval(small(out, limit=2))  # resumes: the default keeps the earlier behaviour
    assert (out / "records.jsonl").read_bytes().startswith(first)
    assert len(records(out)) == 2
    with pytest.raises(SkipKVError, match=r"different run: policy.protect_prompt \(\"<absent>\" -> true\)"):
        run_eval(small(out, limit=2, policy_knobs={**small(out).policy_knobs, "protect_prompt": True}))
    del config["policy"]["window"]  # a knob the run dir lacks and the new run sets to a non-default value
    path.write_text(json.dumps(config))
    with pytest.raises(SkipKVError, match=r"policy.window"):
        run_eval(small(out, limit=2, policy_knobs={**small(out).policy_knobs, "window": 3}))


def test_a_16bit_run_resumes_only_on_the_attention_it_began_with(tmp_path: Path, monkeypatch) -> None:
    """bf16 decode attention rounds differently with each kernel and p.V dtype, so a bf16 run resumes only on the
    one it recorded; a record from before `pv` existed ("grouped_fp32") is the grouped kernel with p.V in fp32."""
    from skipkv import kernels

    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    monkeypatch.delenv(kernels.PV_ENV, raising=False)
    out = tmp_path / "run"
    run_eval(small(out, limit=1, dtype="bf16"))
    path = out / "config.json"
    config = json.loads(path.read_text())
    assert kernels.attention_kernel(config["environment"]["decode_attention_cpu"]) == ("grouped", "model")
    config["environment"]["decode_attention_cpu"] = {"kernel": "grouped_fp32", "reason": "older record"}
    path.write_text(json.dumps(config))
    with pytest.raises(SkipKVError, match="p.V in fp32, this run would use grouped and model; resume it with "
                                          "SKIPKV_DECODE_SDPA=0 SKIPKV_DECODE_PV=fp32"):
        run_eval(small(out, limit=2, dtype="bf16"))
    monkeypatch.setenv(kernels.PV_ENV, "fp32")
    run_eval(small(out, limit=2, dtype="bf16"))  # the recorded kernel: resumes
    assert len(records(out)) == 2
    monkeypatch.setenv(kernels.SDPA_ENV, "1")
    with pytest.raises(SkipKVError, match="resume it with SKIPKV_DECODE_SDPA=0"):
        run_eval(small(out, limit=3, dtype="bf16"))
    fp32 = tmp_path / "fp32"  # fp32 runs do not depend on the 16-bit kernel
    run_eval(small(fp32, limit=1))
    monkeypatch.setenv(kernels.PV_ENV, "model")
    run_eval(small(fp32, limit=2))
    assert len(records(fp32)) == 2


def test_a_bf16_run_resumes_only_on_the_linears_it_began_with(tmp_path: Path, monkeypatch) -> None:
    """oneDNN's bf16 kernel, fp32 products of upcast weights and torch's own bf16 linear round differently, so a
    bf16 run begun on one (e.g. the upcast path of an AVX2 CPU) is refused on another (a CPU with AVX512-BF16
    would pack) with the switches that restore it; a record from before the upcast path is not checked."""
    from skipkv import kernels

    monkeypatch.setenv(kernels.SDPA_ENV, "0")
    monkeypatch.setenv(kernels.PV_ENV, "fp32")
    monkeypatch.setenv(kernels.PACK_ENV, "0")
    monkeypatch.setenv(kernels.UPCAST_ENV, "1")
    out = tmp_path / "run"
    run_eval(small(out, limit=1, dtype="bf16"))
    config = json.loads((out / "config.json").read_text())
    assert kernels.linear_kernel(config["environment"]) == "upcast"
    monkeypatch.setenv(kernels.UPCAST_ENV, "0")
    with pytest.raises(SkipKVError, match="was run with upcast bf16 linears, this run would use torch; resume it "
                                          "with SKIPKV_PACKED_LINEARS=0 SKIPKV_UPCAST_LINEARS=1"):
        run_eval(small(out, limit=2, dtype="bf16"))
    assert len(records(out)) == 1
    monkeypatch.setenv(kernels.UPCAST_ENV, "1")
    run_eval(small(out, limit=2, dtype="bf16"))  # the recorded linears: resumes
    assert len(records(out)) == 2
    del config["environment"]["upcast_linears_cpu_bf16"]  # written before the upcast path existed
    (out / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv(kernels.UPCAST_ENV, "0")
    run_eval(small(out, limit=3, dtype="bf16"))
    assert len(records(out)) == 3
    fp32 = tmp_path / "fp32"  # fp32 runs do not depend on the bf16 linears
    run_eval(small(fp32, limit=1))
    monkeypatch.setenv(kernels.UPCAST_ENV, "1")
    run_eval(small(fp32, limit=2))
    assert len(records(fp32)) == 2
    monkeypatch.setenv(kernels.PACK_ENV, "1")  # but they do on whether their own linears are packed
    with pytest.raises(SkipKVError, match="was run with unpacked fp32 linears, this run would use packed ones; "
                                          "resume it with SKIPKV_PACKED_LINEARS=0"):
        run_eval(small(fp32, limit=3))
    assert len(records(fp32)) == 2
    monkeypatch.setenv(kernels.PACK_ENV, "0")  # and on whether their decode step was compiled (it rounds otherwise)
    monkeypatch.setenv(kernels.STEP_ENV, "compiled")
    with pytest.raises(SkipKVError, match="was run with the eager decode step, this run would use the compiled one; "
                                          "resume it with SKIPKV_DECODE_STEP=eager"):
        run_eval(small(fp32, limit=3))
    monkeypatch.setenv(kernels.STEP_ENV, "eager")
    run_eval(small(fp32, limit=3))
    assert len(records(fp32)) == 3


def test_unpad_prefill_is_in_a_16bit_runs_identity_when_on(tmp_path: Path) -> None:
    """A bf16 run records engine.unpad_prefill (its rows can round differently); a bf16 dir written before it
    existed (no key: it ran padded) is refused with the way to resume it, and resumes with it off; fp32 runs do
    not record it (they resume either way)."""
    out = tmp_path / "run"
    run_eval(small(out, limit=1, dtype="bf16"))
    path = out / "config.json"
    config = json.loads(path.read_text())
    assert config["engine"]["unpad_prefill"] is True
    del config["engine"]["unpad_prefill"]
    path.write_text(json.dumps(config))
    with pytest.raises(SkipKVError, match=r'engine.unpad_prefill \("<absent>" -> true\); it ran before the '
                                          r"unpadded prefill: resume it with --no-unpad-prefill"):
        run_eval(small(out, limit=2, dtype="bf16"))
    run_eval(small(out, limit=2, dtype="bf16", unpad_prefill=False))
    assert len(records(out)) == 2
    fp32 = tmp_path / "fp32"
    run_eval(small(fp32, limit=1))
    assert "unpad_prefill" not in json.loads((fp32 / "config.json").read_text())["engine"]
    run_eval(small(fp32, limit=2, unpad_prefill=False))
    assert len(records(fp32)) == 2


def test_every_generating_process_logs_its_environment(tmp_path: Path) -> None:
    """sessions.jsonl holds one line per process that generated, keyed by the `session` its records carry, so a
    run resumed on another machine says which records each one produced; a resume with nothing to do adds none."""
    out = tmp_path / "run"
    run_eval(small(out, limit=1))
    run_eval(small(out, limit=2))
    run_eval(small(out, limit=2))  # nothing left to generate
    lines = [json.loads(line) for line in (out / "sessions.jsonl").read_text().splitlines()]
    assert [line["session"] for line in lines] == [r["session"] for r in records(out)]
    assert lines[0]["session"] != lines[1]["session"]
    assert all(line["environment"]["machine"]["cpus"] >= 1 for line in lines)


def test_share_prefix_is_in_the_identity_only_when_on(tmp_path: Path) -> None:
    """A run dir written without --share-prefix (or before it existed) has no engine.share_prefix and resumes
    with it off; one written with it refuses a resume without it (in 16-bit dtypes the tokens can differ)."""
    off, on = tmp_path / "off", tmp_path / "on"
    run_eval(small(off, limit=1))
    assert "share_prefix" not in json.loads((off / "config.json").read_text())["engine"]
    run_eval(small(off, limit=2))
    assert len(records(off)) == 2
    run_eval(small(on, limit=2, batch_size=2, share_prefix=4))
    assert json.loads((on / "config.json").read_text())["engine"]["share_prefix"] == 4
    with pytest.raises(SkipKVError, match=r"different run: engine.share_prefix"):
        run_eval(small(on, limit=2, batch_size=2))
