"""Bad input by class: configs checked when built, errors that name the real problem (paths, weights, hub,
binary files), output paths checked before work and never left half-made, atomic writes, the CLI's one-line
handler for environment errors (and only those)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from skipkv import cli
from skipkv.bench.decode import DecodeBenchConfig
from skipkv.config import SamplingParams
from skipkv.engine import generate
from skipkv.errors import SkipKVError
from skipkv.eval.runner import EvalConfig, run_eval
from skipkv.models import check_device, load_model
from skipkv.outputs import check_dir, check_file, made_dir, write_atomic


def run_cli(argv: list[str], capsys) -> tuple[int, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as exc:
        rc = exc.code
    err = capsys.readouterr().err
    return rc, err


def one_line_error(rc: int, err: str, *words: str) -> None:
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in lines[0], lines[0]


# ------------------------------------------------------------------------------------------ configs
EVAL = dict(model="random:qwen2", dataset="gsm8k", policy="rkv", budget=32, limit=1, max_new_tokens=2,
            dtype="fp32", quiet=True)


@pytest.mark.parametrize("field, value, word", [
    ("samples", 0, "samples"), ("samples", 1.5, "samples"), ("limit", 0, "limit"), ("limit", "3", "limit"),
    ("max_new_tokens", -1, "max_new_tokens"), ("budget", 0, "budget"), ("budget", True, "budget"),
    ("temperature", float("nan"), "temperature"), ("temperature", float("inf"), "temperature"),
    ("top_p", 0.0, "top_p"), ("top_k", -1, "top_k"), ("seed", -1, "seed"), ("batch_size", 0, "batch_size"),
    ("prefill_chunk", -8, "prefill_chunk"), ("prompt_style", "odd", "prompt_style"), ("dtype", "int3", "dtype"),
    ("device", "cuda:7", "cuda:7"), ("device", "nonsense", "device"), ("policy_knobs", {"window": 0}, "window"),
    ("policy_knobs", {"kernel": 4}, "kernel"), ("policy_knobs", {"mix_lambda": float("nan")}, "mix_lambda"),
    ("policy_knobs", [], "policy_knobs"), ("policy", "nope", "nope"), ("model", "", "model"),
])
def test_eval_config_is_checked_when_built(tmp_path: Path, field: str, value, word: str) -> None:
    with pytest.raises(SkipKVError, match=word):
        EvalConfig(**{**EVAL, "out": str(tmp_path / "run"), field: value})
    assert not (tmp_path / "run").exists()


def test_budget_ratio_range_and_cross_field_rules(tmp_path: Path) -> None:
    out = str(tmp_path / "r")
    for kw, word in (({"budget_ratio": 1.5, "budget": None}, "budget_ratio"),
                     ({"budget_ratio": float("nan"), "budget": None}, "budget_ratio"),
                     ({"budget_ratio": 0.5}, "either"), ({"samples": 2}, "temperature"),
                     ({"reference": str(tmp_path)}, "reference")):
        with pytest.raises(SkipKVError, match=word):
            EvalConfig(**{**EVAL, "out": out, **kw})


@pytest.mark.parametrize("kw, word", [
    ({"batch_size": 0}, "batch_size"), ({"batch_size": 10**10}, "batch_size"), ({"span": 0}, "span"),
    ({"lengths": (1, 8)}, "lengths"),
    ({"lengths": ()}, "lengths"), ({"budget": -1}, "budget"), ({"interval": 0}, "interval"),
    ({"policies": ("nope",)}, "nope"), ({"policies": ()}, "policy"), ({"window": -1}, "window"),
    ({"dtype": "int3"}, "dtype"),
])
def test_bench_config_is_checked_when_built(kw: dict, word: str) -> None:
    with pytest.raises(SkipKVError, match=word):
        DecodeBenchConfig(**kw)


def test_generation_longer_than_the_context_is_refused_before_allocating(tiny, monkeypatch) -> None:
    start = time.perf_counter()
    with pytest.raises(SkipKVError, match="exceed the model's context"):
        generate(tiny, ["hello"], SamplingParams(max_new_tokens=10**6))  # 10**9 is now refused by SamplingParams
    assert time.perf_counter() - start < 5
    monkeypatch.setattr(tiny.model.config, "max_position_embeddings", 32)  # the boundary, cheaply
    ctx = tiny.max_context
    with pytest.raises(SkipKVError, match="context"):
        generate(tiny, [[1] * (ctx - 2)], SamplingParams(max_new_tokens=3))
    assert generate(tiny, [[1] * (ctx - 3)], SamplingParams(max_new_tokens=3, ignore_eos=True))[0].generated_tokens == 3


def test_device_check() -> None:
    assert str(check_device("cpu")) == "cpu"
    for bad in ("cuda:7" if not __import__("torch").cuda.is_available() else "cuda:999", "tpu:0", "", "gpu", "meta"):
        with pytest.raises(SkipKVError, match="device"):
            check_device(bad)


# ------------------------------------------------------------------------------------------ models
@pytest.fixture(scope="module")
def saved_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("model") / "m"
    bundle = load_model("random:qwen2", dtype="fp32")
    bundle.model.save_pretrained(folder)
    bundle.tokenizer.save_pretrained(folder)
    return folder


def test_model_errors_name_the_real_problem(saved_model: Path, tmp_path: Path, monkeypatch) -> None:
    assert load_model(str(saved_model), dtype="fp32").family == "qwen2"
    with pytest.raises(SkipKVError, match="model path not found: /no/such/folder"):
        load_model("/no/such/folder")
    with pytest.raises(SkipKVError, match="model path not found"):
        load_model("./relative/missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(SkipKVError, match="is a file"):
        load_model(str(tmp_path / "file"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(SkipKVError, match="no config.json"):
        load_model(str(tmp_path / "empty"))
    # A half-written weights file, a garbage header, a shard the index lists but the folder lacks.
    for name, damage in (("truncated", lambda f: os.truncate(f, f.stat().st_size // 2)),
                         ("header", lambda f: f.write_bytes(b"\x00\x01garbage"))):
        broken = tmp_path / name
        shutil.copytree(saved_model, broken)
        damage(broken / "model.safetensors")
        with pytest.raises(SkipKVError, match=rf"{name}/model.safetensors is not a complete safetensors file"):
            load_model(str(broken))
    sharded = tmp_path / "sharded"
    shutil.copytree(saved_model, sharded)
    (sharded / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-2-of-2.safetensors"}}))
    with pytest.raises(SkipKVError, match="model-2-of-2.safetensors is missing"):
        load_model(str(sharded))
    for name, data in (("corrupt.gguf", b"GGUF\x03\x00\x00\x00garbage"), ("notgguf.gguf", b"hello")):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(SkipKVError, match=rf"{name} is not a valid GGUF file"):
            load_model(str(tmp_path / name))
    # A hub id while offline: one line at once, no retries.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(SkipKVError, match="offline"):
        load_model("no-such-org/no-such-model")
    assert time.perf_counter() - start < 5


def test_unreachable_hub_fails_at_once(monkeypatch) -> None:
    import skipkv.models as models

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert not models._hub_reachable()
    start = time.perf_counter()
    with pytest.raises(SkipKVError, match="offline"):
        load_model("no-such-org/no-such-model")
    assert time.perf_counter() - start < 5


def test_cli_binary_prompts_file_and_bad_model_are_one_line(tmp_path: Path, capsys) -> None:
    (tmp_path / "bin.jsonl").write_bytes(b"\x80\x81\xff")
    rc, err = run_cli(["generate", "--model", "random:qwen2", "--prompts", str(tmp_path / "bin.jsonl")], capsys)
    one_line_error(rc, err, "not UTF-8")
    rc, err = run_cli(["generate", "--model", str(tmp_path / "nope"), "hi"], capsys)
    one_line_error(rc, err, "model path not found")
    rc, err = run_cli(["generate", "--model", "random:qwen2", "--max-new-tokens", "1000000000", "hi"], capsys)
    one_line_error(rc, err, "context")


def test_cli_turns_environment_errors_into_one_line_and_keeps_bugs_loud(monkeypatch, capsys) -> None:
    import skipkv.engine.cli as engine_cli

    def failing(exc: BaseException):
        def cmd(args) -> int:
            raise exc
        return cmd

    for exc, word in ((PermissionError(13, "Permission denied", "/x/y"), "Permission denied: /x/y"),
                      (OSError(28, "No space left on device"), "No space left"),
                      (UnicodeDecodeError("utf-8", b"\x80", 0, 1, "invalid start byte"), "not utf-8 text")):
        monkeypatch.setattr(engine_cli, "cmd_policies", failing(exc))
        rc, err = run_cli(["policies"], capsys)
        one_line_error(rc, err, word)
    # A programming error is not an environment error: it keeps its traceback.
    monkeypatch.setattr(engine_cli, "cmd_policies", failing(KeyError("bug")))
    with pytest.raises(KeyError):
        cli.main(["policies"])


# ------------------------------------------------------------------------------------------ outputs
def test_output_path_checks(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    for bad, word in (("", "must name a path"), (" ", "must name a path"), (str(tmp_path / "afile"), "is a file"),
                      (str(tmp_path / "afile" / "sub"), "is a file"), ("a\0b", "NUL")):
        with pytest.raises(SkipKVError, match=word):
            check_dir(bad)
    with pytest.raises(SkipKVError, match="is a folder"):
        check_file(str(tmp_path))
    with pytest.raises(SkipKVError, match="is a file"):
        check_file(str(tmp_path / "afile" / "x.json"))
    assert check_file(str(tmp_path / "new" / "x.json")) == tmp_path / "new" / "x.json"
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_unwritable_output_is_refused(tmp_path: Path, monkeypatch) -> None:
    # root ignores mode bits, so unwritability is simulated where the check asks the OS
    real = os.access
    monkeypatch.setattr(os, "access", lambda p, m: False if Path(p) == tmp_path else real(p, m))
    with pytest.raises(SkipKVError, match="not writable"):
        check_dir(tmp_path / "out")
    with pytest.raises(SkipKVError, match="not writable"):
        check_file(tmp_path / "x.json")


def test_made_dir_removes_only_what_it_created(tmp_path: Path) -> None:
    (tmp_path / "keep").mkdir()
    with pytest.raises(RuntimeError):
        with made_dir(tmp_path / "keep" / "a" / "b"):
            assert (tmp_path / "keep" / "a" / "b").is_dir()
            raise RuntimeError
    assert (tmp_path / "keep").is_dir() and not (tmp_path / "keep" / "a").exists()
    with made_dir(tmp_path / "x") as created:
        created.clear()  # kept
    assert (tmp_path / "x").is_dir()
    with pytest.raises(SkipKVError, match="cannot create"):
        with made_dir(Path("/proc/skipkv-test/x")):
            pass


def test_write_atomic_never_leaves_half_a_file(tmp_path: Path, monkeypatch) -> None:
    target = tmp_path / "summary.json"
    target.write_text("old")
    real_replace = os.replace
    monkeypatch.setattr(os, "replace", lambda a, b: (_ for _ in ()).throw(OSError(28, "No space left on device")))
    with pytest.raises(SkipKVError, match="No space"):
        write_atomic(target, "new")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]
    monkeypatch.setattr(os, "replace", real_replace)
    write_atomic(target, "new")
    assert target.read_text() == "new"


def test_refused_eval_leaves_nothing_behind(tmp_path: Path) -> None:
    # Refused after the model loaded (prompt + generation beyond the context): no run dir, no lock, no parents.
    out = tmp_path / "a" / "b" / "run"
    with pytest.raises(SkipKVError, match="context"):
        run_eval(EvalConfig(**{**EVAL, "out": str(out), "max_new_tokens": 5000}))
    assert list(tmp_path.iterdir()) == []
    # An existing empty folder stays, empty.
    (tmp_path / "mine").mkdir()
    with pytest.raises(SkipKVError):
        run_eval(EvalConfig(**{**EVAL, "out": str(tmp_path / "mine"), "max_new_tokens": 5000}))
    assert list((tmp_path / "mine").iterdir()) == []


def test_eval_never_overwrites_files_it_did_not_write(tmp_path: Path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "summary.json").write_text('{"mine": true}')
    rc, err = run_cli(["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--out", "", "--limit", "1",
                       "--max-new-tokens", "2", "--quiet"], capsys)
    one_line_error(rc, err, "--out")
    rc, err = run_cli(["eval", "--model", "random:qwen2", "--dataset", "gsm8k", "--out", ".", "--limit", "1",
                       "--max-new-tokens", "2", "--quiet"], capsys)
    one_line_error(rc, err, "summary.json but no config.json")
    assert (tmp_path / "summary.json").read_text() == '{"mine": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]


def test_bench_out_is_checked_before_the_benchmark(tmp_path: Path, capsys, monkeypatch) -> None:
    import skipkv.bench.decode as decode

    monkeypatch.setattr(decode, "bench_policies", lambda *a, **k: pytest.fail("the benchmark ran"))
    (tmp_path / "afile").write_text("x")
    for out in (str(tmp_path / "afile" / "x.json"), str(tmp_path), ""):
        rc, err = run_cli(["bench", "decode", "--model", "random:qwen2", "--lengths", "2,3", "--out", out], capsys)
        one_line_error(rc, err, "--out")


def test_report_out_is_checked_first(tmp_path: Path, capsys) -> None:
    (tmp_path / "afile").write_text("x")
    for out in ("", str(tmp_path / "afile"), str(tmp_path / "afile" / "sub")):
        rc, err = run_cli(["report", str(tmp_path), "--out", out], capsys)
        one_line_error(rc, err, "--out")


def test_sweep_cells_are_checked_when_the_file_is_read(tmp_path: Path, capsys) -> None:
    for options, word in (({"batch_size": 0}, "batch_size"), ({"device": "cuda:7"}, "cuda:7"),
                          ({"prompt_style": "odd"}, "prompt_style")):
        raw = {"model": "random:qwen2", "datasets": ["gsm8k"], "policies": ["rkv"], "budgets": [16],
               "out": str(tmp_path / "runs"), "options": options}
        path = tmp_path / "s.yaml"
        path.write_text(json.dumps(raw))
        rc, err = run_cli(["sweep", str(path), "--dry-run"], capsys)
        one_line_error(rc, err, word, "rkv-b16")
    raw["options"], raw["out"] = {}, str(tmp_path / "s.yaml" / "below")
    path.write_text(json.dumps(raw))
    rc, err = run_cli(["sweep", str(path), "--dry-run"], capsys)
    one_line_error(rc, err, "is a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.yaml"]


def test_tiny_and_huge_temperatures_sample_without_nan(tiny) -> None:
    # 1e-300: logits / T overflowed to inf -> NaN probabilities (found by the fuzz test). Tiny T is greedy.
    greedy = generate(tiny, ["hello there"], SamplingParams(max_new_tokens=4, ignore_eos=True))[0].token_ids
    for t in (1e-300, 5e-324):
        out = generate(tiny, ["hello there"], SamplingParams(max_new_tokens=4, temperature=t, ignore_eos=True))
        assert out[0].token_ids == greedy
    assert len(generate(tiny, ["x"], SamplingParams(max_new_tokens=3, temperature=1e300, top_p=0.5, top_k=3,
                                                    ignore_eos=True))[0].token_ids) == 3


def test_a_budget_beyond_the_request_allocates_nothing_for_it(tiny) -> None:
    from skipkv.policies import make_policy

    # budget 4e9 tried to allocate ~500 GB for the slot (found by the fuzz test); the slot is sized by what
    # the request can hold, and the output is the full cache's.
    huge = make_policy("rkv", budget=4_424_011_758, interval=1)
    sp = SamplingParams(max_new_tokens=3, ignore_eos=True)
    assert huge.capacity(10, 3) == 13
    assert generate(tiny, ["hello"], sp, huge)[0].token_ids == generate(tiny, ["hello"], sp)[0].token_ids
