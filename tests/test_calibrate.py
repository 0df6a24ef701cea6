"""`skipkv calibrate` (eval/calibrate.py) and the TriAttention statistics file (policies/triattention.py): what it
holds against a naive recomputation of the pre-RoPE queries, its metadata, and the refusals (another model's
statistics, a missing or foreign file) as one line and exit code 2.

    python -m pytest tests/test_calibrate.py -q
"""

from __future__ import annotations

import hashlib

import pytest
import torch

from conftest import calibrated_stats
from skipkv import make_policy
from skipkv.cli import main
from skipkv.errors import SkipKVError
from skipkv.eval.calibrate import calibration_text
from skipkv.models import load_model
from skipkv.policies.triattention import TriStats


def test_calibrate_writes_the_mean_pre_rope_queries(tmp_path, capsys):
    out = tmp_path / "s.safetensors"
    code = main(["calibrate", "--model", "random:qwen2", "--dtype", "fp64", "--tokens", "40", "--segment", "16",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    stats = TriStats.load(str(out))
    label, text = calibration_text("python-docs")
    assert stats.meta["model"] == "random:qwen2" and stats.meta["text"] == label == "python-docs"
    assert stats.meta["tokens"] == 40 and stats.meta["text_sha256"] == hashlib.sha256(text.encode()).hexdigest()
    # Naive: each segment's hidden states into each layer, its input norm and q_proj, band by band.
    bundle = load_model("random:qwen2", dtype="fp64")
    ids = bundle.tokenizer(text, add_special_tokens=False)["input_ids"][:40]
    L, Hq, F = stats.q_mean.shape
    D = 2 * F
    total = [[[0j] * F for _ in range(Hq)] for _ in range(L)]
    modulus = [[[0.0] * F for _ in range(Hq)] for _ in range(L)]
    with torch.inference_mode():
        for s in (0, 16, 32):
            hs = bundle.model.model(input_ids=torch.tensor([ids[s:s + 16]]), output_hidden_states=True).hidden_states
            for layer, block in enumerate(bundle.model.model.layers):
                q = block.self_attn.q_proj(block.input_layernorm(hs[layer]))[0]  # [T, Hq*D]
                for t in range(q.shape[0]):
                    for h in range(Hq):
                        for f in range(F):
                            z = complex(float(q[t, h * D + f]), float(q[t, h * D + F + f]))
                            total[layer][h][f] += z / 40
                            modulus[layer][h][f] += abs(z) / 40
    torch.testing.assert_close(stats.q_mean, torch.tensor(total, dtype=torch.complex128))
    torch.testing.assert_close(stats.q_abs, torch.tensor(modulus, dtype=torch.float64))


def test_statistics_of_another_model_are_refused_in_one_line(capsys):
    """Stats calibrated on random:qwen2 given to random:qwen2:sharp (same shape, q_proj x16): exit 2, one line."""
    stats = calibrated_stats("random:qwen2")
    code = main(["generate", "--model", "random:qwen2:sharp", "--dtype", "fp64", "--policy", "triattention",
                 "--stats-file", stats, "--budget", "24", "--window", "4", "--interval", "4", "--max-new-tokens", "12",
                 "--ignore-eos", "--raw", "--no-stream", "Once upon a time, in a land far away, there lived a king"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "calibrated on another model" in err, err
    with pytest.raises(SkipKVError, match="another model"):  # before an evaluation: every layer, up front
        make_policy("triattention", stats_file=stats, budget=24, window=4).check_run(
            load_model("random:qwen2:sharp", dtype="fp64"))
    # The same model passes; so does one model in bf16 against its fp32 statistics (random:qwen2's weights are
    # drawn per dtype, so its fp32 and bf16 loads are one model, its fp64 load another).
    make_policy("triattention", stats_file=stats, budget=24, window=4).check_run(load_model("random:qwen2",
                                                                                            dtype="fp64"))
    make_policy("triattention", stats_file=calibrated_stats("random:qwen2", "fp32"), budget=24,
                window=4).check_run(load_model("random:qwen2", dtype="bf16"))


def test_a_model_of_another_shape_is_refused():
    with pytest.raises(SkipKVError, match="layers, query heads, bands"):
        make_policy("triattention", stats_file=calibrated_stats("random:qwen2"), budget=24, window=4).check_run(
            load_model("random:qwen2:small", dtype="fp64"))


@pytest.mark.parametrize("case", ["missing", "foreign", "none"])
def test_bad_stats_files_are_refused_before_loading(tmp_path, capsys, case):
    args = {"missing": ["--stats-file", str(tmp_path / "nope.safetensors")],
            "foreign": ["--stats-file", str(tmp_path / "x.safetensors")], "none": []}[case]
    (tmp_path / "x.safetensors").write_bytes(b"not a safetensors file")
    code = main(["generate", "--model", "random:qwen2", "--policy", "triattention", "--budget", "300", *args, "hi"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    want = {"missing": "not found", "foreign": "not a triattention stats file", "none": "needs --stats-file"}
    assert want[case] in err


def test_calibrate_bad_input_one_line(tmp_path, capsys):
    for argv in (["--text", "novel"], ["--tokens", "0"], ["--text-file", str(tmp_path / "absent.txt")]):
        code = main(["calibrate", "--model", "random:qwen2", "--out", str(tmp_path / "o.safetensors"), *argv])
        err = capsys.readouterr().err
        assert code == 2 and err.count("\n") == 1, (argv, err)


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="no oneDNN in this torch")
def test_calibrate_and_the_model_check_on_packed_fused_fp32_linears(tmp_path, monkeypatch, capsys):
    """fp32 on packed linears (the default on AVX2-only x86): q_proj is a part of a fused q/k/v product holding no
    tensor of its own; calibrating and checking still work, and the fingerprint matches the unpacked model's."""
    from skipkv.policies.triattention import query_fingerprint

    plain = load_model("random:qwen2", dtype="fp32")
    monkeypatch.setenv("SKIPKV_PACKED_LINEARS", "1")
    out = tmp_path / "s.safetensors"
    code = main(["calibrate", "--model", "random:qwen2", "--dtype", "fp32", "--tokens", "32", "--segment", "16",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr().err
    packed = load_model("random:qwen2", dtype="fp32")
    q_proj = packed.model.model.layers[0].self_attn.q_proj
    assert "part" in q_proj.extra_repr()  # the case that failed: no buffers or parameters on it
    torch.testing.assert_close(query_fingerprint(q_proj, torch.float32),
                               query_fingerprint(plain.model.model.layers[0].self_attn.q_proj, torch.float32),
                               rtol=1e-4, atol=1e-4)
    stats = TriStats.load(str(out))
    for layer, block in enumerate(packed.model.model.layers):  # as TriAttention checks a run's model
        stats.check_layer(layer, block.self_attn, torch.float32)
