"""The reflective testbed: s1 budget forcing in the engine, the r1think prompt recipe, calibration slices (offset)."""

from __future__ import annotations

import json
from collections import Counter

import pytest

from conftest import PROMPTS
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine.request import FORCE_TEXT, _opens_think_end
from skipkv.models import load_model


@pytest.fixture(scope="module")
def stopper():
    """A random model whose most frequent greedy token on PROMPTS[0] is declared an EOS: it stops early, often."""
    bundle = load_model("random:qwen2", dtype="fp64")
    plain = generate(bundle, PROMPTS[:1], SamplingParams(max_new_tokens=60, ignore_eos=True), make_policy("full"))[0]
    tok, _ = Counter(plain.token_ids[3:]).most_common(1)[0]
    bundle.model.generation_config.eos_token_id = [tok]
    bundle.tokenizer.eos_token_id = None  # only the declared stop ends a request (byte tokenizer's EOS is unused)
    return bundle, tok, plain.token_ids


def forced_ids(tokenizer, before_ids: list[int]) -> list[int]:
    text = tokenizer.decode(before_ids, skip_special_tokens=True)
    return tokenizer.encode(("" if text.endswith("\n") else "\n\n") + FORCE_TEXT, add_special_tokens=False)


def test_budget_forcing_replaces_the_stop_by_wait(stopper):
    bundle, stop, plain = stopper
    tok = bundle.tokenizer
    k = plain.index(stop)
    base = generate(bundle, PROMPTS[:1], SamplingParams(max_new_tokens=60), make_policy("full"))[0]
    assert base.finish_reason == "eos" and base.token_ids == plain[:k + 1] and base.forced_waits == 0
    for K in (1, 2, 3):
        res = generate(bundle, PROMPTS[:1], SamplingParams(max_new_tokens=60, force_wait=K), make_policy("full"))[0]
        w = forced_ids(tok, plain[:k])
        # Up to the stop the run is the plain one; the stop itself became the forced text, fed token by token.
        assert res.token_ids[:k] == plain[:k] and res.token_ids[k:k + len(w)] == w
        assert stop not in res.token_ids[:-1] and res.forced_waits <= K
        if res.finish_reason == "eos":  # it tried to stop K + 1 times: the last one was let through
            assert res.forced_waits == K
        assert res.text.count(FORCE_TEXT) >= res.forced_waits >= 1


def test_budget_forcing_batch_equals_singles_under_every_kind_of_policy(stopper):
    bundle, _, _ = stopper
    sp = SamplingParams(max_new_tokens=50, force_wait=2)
    # Budget 32: PROMPTS[0] is forced before its first compression, and compressions then evict around the
    # forced tokens.
    for policy in (make_policy("full"), make_policy("rkv", budget=32, window=4, interval=8),
                   make_policy("skipkv", budget=32, window=4, interval=8)):
        batched = generate(bundle, PROMPTS, sp, policy, EngineConfig(batch_size=4))
        assert batched[0].forced_waits >= 1 and (not policy.compresses or batched[0].compressions > 0)
        for prompt, res in zip(PROMPTS, batched):
            alone = generate(bundle, [prompt], sp, policy)[0]
            assert (res.token_ids, res.forced_waits, res.finish_reason) == \
                (alone.token_ids, alone.forced_waits, alone.finish_reason)


def test_think_end_detection():
    assert _opens_think_end("</think>") == 0 and _opens_think_end(".\n</think>\n\n") == 2
    assert _opens_think_end(" </") == 1 and _opens_think_end(".\n</th") == 2
    assert _opens_think_end("<") == -1 and _opens_think_end("a/b") == -1 and _opens_think_end("</b>") == -1


def test_r1think_prompt_opens_thinking_after_reflective_exemplars(tiny):
    from skipkv.eval import prompts
    from skipkv.eval.datasets import Example, get_dataset, data_request
    from skipkv.errors import SkipKVError

    ex = get_dataset("gsm8k").load(data_request({}))[0]
    text = prompts.render(tiny.tokenizer, ex, "r1think")
    assert text.endswith("<think>\n") and ex.inputs["question"] in text
    for q, thinking, answer in prompts.R1_EXEMPLARS:
        assert q in text and thinking in text and "\\boxed{" in answer
    assert sum(text.count(w) for w in ("Wait,", "Let me verify", "Alternatively,")) >= 7
    code = Example(id="c", task="code", inputs={"prompt": "def f():"}, reference="")
    with pytest.raises(SkipKVError, match="r1think is for math"):
        prompts.render(tiny.tokenizer, code, "r1think")


def test_eval_offset_and_force_wait_are_recorded(tmp_path, capsys):
    import json

    from skipkv.cli import main

    out = tmp_path / "run"
    argv = ["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--offset", "1200", "--limit", "2",
            "--policy", "full", "--max-new-tokens", "8", "--prompt", "r1think", "--force-wait", "2", "--quiet",
            "--out", str(out)]
    assert main(argv) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["dataset"]["offset"] == 1200 and cfg["sampling"]["force_wait"] == 2
    assert cfg["prompt_style"] == "r1think"
    ids = [json.loads(line)["id"] for line in (out / "records.jsonl").read_text().splitlines()]
    from skipkv.eval.datasets import data_request, get_dataset

    allx = get_dataset("gsm8k").load(data_request({}))
    assert sorted(ids) == sorted(ex.id for ex in allx[1200:1202])
    # The same dir with another offset is another run: refused, one line, exit 2.
    assert main(argv[:6] + ["1300"] + argv[7:]) == 2
    assert "offset" in capsys.readouterr().err
    assert main(["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--offset", "-1", "--policy", "full",
                 "--out", str(tmp_path / "bad")]) == 2


def test_reproduce_script_dry_runs_end_to_end(tmp_path):
    """benchmarks/reproduce_skipkv.sh on random:qwen2 at a tiny budget: sweep file, every cell, the tables."""
    import os
    import subprocess
    from pathlib import Path

    from test_steering import write_vector

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "repro"
    env = dict(os.environ, DEVICE="cpu", DTYPE="fp32", BUDGETS="40", INTERVAL="8", WINDOW="4", MAX_NEW="16",
               SAMPLES="1", LIMIT="2", AIME_LIMIT="1", BATCH="2", OUT=str(out),
               STEERING=write_vector(tmp_path / "v.safetensors", dataset="math500", ids=("math500-test-0400",)))
    run = subprocess.run(["bash", str(root / "benchmarks" / "reproduce_skipkv.sh"), "random:qwen2"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-2000:]
    tables = (out / "tables.md").read_text()
    for name in ("FullKV", "R-KV", "SnapKV", "H2O", "SkipKV (eviction only)", "SkipKV", "SEAL (full cache)"):
        assert f"| {name} |" in tables
    assert "### math500: pass@1 (%)" in tables and "### aime24: mean generated tokens" in tables
    assert "budget 40" in tables and "| - |" not in tables and "*" not in tables  # every cell ran to the end
    cfg = json.loads((out / "runs" / "math500" / "skipkv-steer-b40" / "config.json").read_text())
    assert cfg["policy"]["interval"] == 8 and cfg["sampling"]["temperature"] == 0.6
