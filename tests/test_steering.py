"""Steering: vector files, the residual add (exactly alpha * v at the right rows and tokens), seal, bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from conftest import PROMPTS
from skipkv import SamplingParams, generate, make_policy
from skipkv.cli import main
from skipkv.config import EngineConfig
from skipkv.engine import make_requests
from skipkv.engine.runner import ModelRunner
from skipkv.errors import SkipKVError
from skipkv.eval.steering import build_from_chains, nn_boundaries
from skipkv.models.patches import routed
from skipkv.sentences import TokenTables
from skipkv.steering import SteeringFile, SteerState

LAYER = 1


def write_vector(path: Path, hidden: int = 64, layers=(0, 1), dataset: str = "gsm8k", ids=("gsm8k-test-0999",),
                 best: int = 1, seed: int = 0) -> str:
    g = torch.Generator().manual_seed(seed)
    vectors = {L: torch.randn(hidden, generator=g) for L in layers}
    SteeringFile.save(path, vectors, {"model": "random:qwen2", "dataset": dataset, "ids": list(ids),
                                      "hidden_size": hidden, "best_layer": best, "counts": {}, "separability": {}})
    return str(path)


@pytest.fixture(scope="module")
def vec_file(tmp_path_factory):
    return write_vector(tmp_path_factory.mktemp("steer") / "v.safetensors")


def drive(bundle, policy, prompts: list[str], forced: list[list[int]], steer: bool) -> list[torch.Tensor]:
    """Teacher-forced decode (the fed tokens are `forced`, whatever is sampled); returns the residual entering
    layer LAYER at every decode step, [B, E] each, as the layer sees it (after any steering)."""
    sp = SamplingParams(max_new_tokens=len(forced[0]) + 1, ignore_eos=True)
    reqs = make_requests(bundle, prompts, sp, policy)
    hook = policy.steering_hook(bundle) if steer else None
    runner = ModelRunner(bundle, policy, num_slots=len(prompts), steering=hook)
    seen: list[torch.Tensor] = []

    def record(module, args, kwargs):
        seen.append((args[0] if args else kwargs["hidden_states"])[:, -1].clone())

    handle = bundle.model.model.layers[LAYER].register_forward_pre_hook(record, with_kwargs=True)
    try:
        with routed(bundle.model), torch.inference_mode():
            runner.prefill(reqs)
            for r, f in zip(reqs, forced):
                r.output_ids.append(f[0])
            for k in range(1, len(forced[0])):
                runner.decode()
                for r, f in zip(reqs, forced):
                    r.output_ids.append(f[k])
    finally:
        handle.remove()
        if hook is not None:
            hook.remove()
    return seen[1:]  # drop the prefill forward


def naive_checks(tok, ids: list[int]) -> int:
    """Closed sentences (ending with a newline) that contain 'Wait' as a word, by plain text."""
    text = tok.decode(ids)
    return sum(1 for s in text.split("\n")[:-1] if "Wait" in s.replace("Waiting", ""))


@pytest.mark.parametrize("name", ["seal", "skipkv"])
def test_steering_adds_alpha_v_exactly_at_double_newlines(tiny, vec_file, name):
    tok = tiny.tokenizer
    texts = ["a\n\nWait b.\nWait c\n\n\nd\n\nx", "Wait\nq\n\nr s\nWait\n\nWait t\n\nu"]
    forced = [tok.encode(t) for t in texts]
    n = min(len(f) for f in forced)
    forced = [f[:n] for f in forced]
    prompts = ["The quick brown fox", "2 + 2 ="]
    knobs = dict(steering=vec_file, steering_layer=LAYER, alpha0=-1.5, steer_scope="always")
    if name == "skipkv":  # budget large enough not to evict: eviction would change keys that later rows read
        knobs.update(budget=512, window=4, interval=8, gamma=0.25, alpha_update="sentence", check_words="reference")
    policy = make_policy(name, **knobs)
    on = drive(tiny, policy, prompts, forced, steer=True)
    off = drive(tiny, policy, prompts, forced, steer=False)
    v = SteeringFile.load(vec_file).vector(LAYER).to(torch.float64)
    fired = 0
    for k in range(1, n):  # decode step k feeds forced[b][k-1]
        for b, f in enumerate(forced):
            fed, prev = f[k - 1], (f[k - 2] if k >= 2 else tok.encode(prompts[b])[-1])
            nn = tok.decode([prev]).endswith("\n") and tok.decode([fed]).startswith("\n")
            alpha = -1.5
            if name == "skipkv":
                alpha -= 0.25 * naive_checks(tok, tok.encode(prompts[b]) + f[:k - 1])
            want = alpha * v if nn else torch.zeros_like(v)
            fired += nn
            torch.testing.assert_close(on[k - 1][b] - off[k - 1][b], want, rtol=0, atol=1e-12)
    assert fired >= 6


def test_think_scope_gates_on_think_tags():
    tok = type("T", (), {})()
    tables = TokenTables(delimiter=torch.zeros(8, dtype=torch.bool),
                         has_nn=torch.tensor([0, 1, 0, 0, 0, 0, 0, 0]).bool(),
                         starts_nl=torch.zeros(8, dtype=torch.bool), ends_nl=torch.zeros(8, dtype=torch.bool),
                         check=None, check_ids=None, think_open=5, think_close=6, tokenizer=tok)
    st = SteerState(tables, "auto", prompt_ids=[2, 3], alpha=-1.0)
    assert st.scope == "think"
    assert [st.gate(t) for t in (1, 5, 1, 2, 1, 6, 1)] == [False, False, True, False, True, False, False]
    assert SteerState(tables, "think", prompt_ids=[2, 5], alpha=-1.0).gate(1)  # <think> in the prompt
    assert SteerState(tables, "always", prompt_ids=[], alpha=-1.0).gate(1)


def test_seal_batch_equals_singles(tiny, vec_file):
    policy = make_policy("seal", steering=vec_file, steer_scope="always", alpha0=-4.0)
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (12, 20, 8, 16)]
    batched = generate(tiny, PROMPTS, sps, policy, EngineConfig(batch_size=4))
    for p, sp, r in zip(PROMPTS, sps, batched):
        alone = generate(tiny, [p], sp, policy)[0]
        assert r.token_ids == alone.token_ids and r.extra == alone.extra


def test_build_from_chains_is_the_class_mean_difference(tiny):
    tok = tiny.tokenizer
    prompt = tok.encode("Q: two plus two?\n")
    chains_text = ["Start.\n\nSo x = 2.\n\nWait, check it.\n\nThen 4.\n\nAlternatively, count.\n\nDone",
                   "Go.\n\nAdd 2 and 2.\n\nHold on, verify.\n\nIt is 4.",
                   "Hm.\n\nFirst 1.\n\nWait.\n\nNext 3.",
                   "Ok.\n\nSum is 4.\n\nLet me check again.\n\nYes 4."]
    chains = [(f"ex{i}", prompt, tok.encode(t)) for i, t in enumerate(chains_text)]
    vectors, meta = build_from_chains(tiny, chains, [0, 1])
    assert meta["counts"] == {"execution": 9, "reflection": 4, "transition": 1}
    assert meta["ids"] == ["ex0", "ex1", "ex2", "ex3"] and meta["best_layer"] in (0, 1)
    assert set(meta["separability"]) == {"0", "1"}
    # Independent path: a pre-hook records each layer's input over the whole sequence.
    tables = TokenTables.build(tok, gate=True)
    from skipkv.sentences import classify_step

    for L in (0, 1):
        pos, neg = [], []
        for _, p, out in chains:
            got = []
            h = tiny.model.model.layers[L].register_forward_pre_hook(
                lambda m, a, kw, got=got: got.append((a[0] if a else kw["hidden_states"])[0].clone()),
                with_kwargs=True)
            with torch.inference_mode():
                tiny.model.model(input_ids=torch.tensor([p + out]))
            h.remove()
            text = tok.decode(out)
            bounds = nn_boundaries(tables, out)
            steps = text.split("\n\n")[1:]
            assert len(bounds) == len(steps)
            for b, step in zip(bounds, steps):
                (neg if classify_step(step) == "execution" else pos).append(got[0][len(p) + b])
        want = torch.stack(pos).mean(0) - torch.stack(neg).mean(0)
        torch.testing.assert_close(vectors[L].double(), want.double(), rtol=1e-6, atol=1e-6)


def test_build_from_chains_that_never_reflect_says_so(tiny):
    # the offline Qwen coder models' case: execution steps only -> the error names the model, not the sample size
    tok = tiny.tokenizer
    prompt = tok.encode("Q: two plus two?\n")
    chains = [(f"ex{i}", prompt, tok.encode("Go.\n\nAdd 2 and 2.\n\nIt is 4.")) for i in range(2)]
    with pytest.raises(SkipKVError, match="'execution': 4, 'reflection': 0.*may not re-check itself"):
        build_from_chains(tiny, chains, [0])


# ------------------------------------------------------------------------------------------- bad input
def run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_bad_steering_input_is_one_line_exit_2(tmp_path, capsys):
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a tensor file")
    cases = {
        "missing": (["--policy", "skipkv", "--steering", str(tmp_path / "nope.safetensors")],
                    "steering file not found"),
        "format": (["--policy", "skipkv", "--steering", str(garbage)], "is not a steering file"),
        "hidden": (["--policy", "skipkv", "--steering", write_vector(tmp_path / "h.safetensors", hidden=32)],
                   "hidden size 32"),
        "layer_range": (["--policy", "seal", "--steering", write_vector(tmp_path / "l.safetensors", layers=(5,),
                                                                        best=5)],
                        "outside the model's layers"),
        "layer_absent": (["--policy", "seal", "--steering", write_vector(tmp_path / "a.safetensors"),
                          "--steering-layer", "3"], "no vector for layer 3"),
        "tau_zero": (["--policy", "skipkv", "--tau", "0"], "tau must be > 0"),
        "tau_big": (["--policy", "skipkv", "--tau", "1.01"], "tau must be <= 1"),
        "seal_no_vector": (["--policy", "seal"], "seal needs a steering vector"),
    }
    for name, (extra, msg) in cases.items():
        code, out, err = run(["generate", "--model", "random:qwen2", "--max-new-tokens", "4", "--budget", "24",
                              "--window", "4", *extra, "hi"], capsys)
        assert code == 2, name
        assert err.count("\n") == 1 and msg in err, (name, err)
        assert out == ""


def test_eval_refuses_overlapping_steering_ids(tmp_path, capsys):
    vec = write_vector(tmp_path / "v.safetensors", ids=("gsm8k-test-0001", "gsm8k-test-0500"))
    out_dir = tmp_path / "run"
    argv = ["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--limit", "2", "--policy", "seal",
            "--steering", vec, "--max-new-tokens", "4", "--out", str(out_dir), "--quiet"]
    code, _, err = run(argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "built from 1 of the evaluated gsm8k examples" in err
    assert not out_dir.exists()  # nothing written
    # Other examples of the same dataset, or another dataset, are fine; records carry the policy's stats.
    vec2 = write_vector(tmp_path / "v2.safetensors", ids=("gsm8k-test-0500",))
    code, _, err = run(argv[:argv.index(vec)] + [vec2] + argv[argv.index(vec) + 1:], capsys)
    assert code == 0, err
    rec = [json.loads(x) for x in (out_dir / "records.jsonl").read_text().splitlines()]
    assert len(rec) == 2 and all("steered_tokens" in r for r in rec)


def test_steer_build_without_steps_is_one_line_exit_2(tmp_path, capsys):
    out = tmp_path / "v.safetensors"
    code, _, err = run(["steer", "build", "--model", "random:qwen2", "--dataset", "gsm8k", "--limit", "1",
                        "--layers", "0", "--max-new-tokens", "4", "--out", str(out)], capsys)
    assert code == 2 and err.count("\n") == 1 and "needs both execution and reflection" in err
    assert not out.exists()
    code, _, err = run(["steer", "build", "--model", "random:qwen2", "--dataset", "gsm8k", "--limit", "1",
                        "--layers", "0,7", "--out", str(out)], capsys)
    assert code == 2 and "outside the model's layers" in err and not out.exists()
