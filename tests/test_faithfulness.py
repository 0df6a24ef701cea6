"""Decisions that keep results honest: sliding-window models are refused at load, and in 16-bit dtypes (where a
padded batch rounds differently from single runs) an eval run's identity includes its batch size."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import Qwen2Config, Qwen3Config

from skipkv.cli import main
from skipkv.errors import SkipKVError
from skipkv.eval.runner import EvalConfig, run_eval
from skipkv.models import check_attention_layout, load_model

TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=512, max_position_embeddings=4096)


@pytest.mark.parametrize("config", [
    Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=2),
    Qwen3Config(**TINY, use_sliding_window=True, sliding_window=16, max_window_layers=0),
    Qwen3Config(**TINY, use_sliding_window=True, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"] * 2),  # Gemma-style alternation
], ids=["qwen2", "qwen3", "layer_types"])
def test_sliding_window_models_are_refused(tmp_path: Path, capsys, config):
    config.save_pretrained(tmp_path)  # the refusal comes from the config, before any tokenizer or weight is read
    with pytest.raises(SkipKVError, match="sliding-window attention"):
        load_model(str(tmp_path))
    assert main(["generate", "--model", str(tmp_path), "--max-new-tokens", "2", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sliding-window" in err


def test_windows_that_never_bind_are_accepted():
    # use_sliding_window with max_window_layers >= layers slides nowhere (transformers makes every layer full)
    check_attention_layout(Qwen2Config(**TINY, use_sliding_window=True, sliding_window=32, max_window_layers=4), "m")
    check_attention_layout(Qwen2Config(**TINY), "m")
    # transformers drops the window when use_sliding_window is off, whatever layer_types says
    check_attention_layout(Qwen3Config(**TINY, sliding_window=16, layer_types=["sliding_attention"] * 4), "m")
    # a window as long as the context is full attention
    check_attention_layout(Qwen3Config(**TINY, sliding_window=4096, layer_types=["sliding_attention"] * 4), "m")


def _cfg(out: Path, **kw) -> EvalConfig:
    args = dict(model="random:qwen2", dataset="gsm8k", policy="rkv", out=str(out), budget=16,
                policy_knobs={"interval": 4}, limit=1, max_new_tokens=6, quiet=True)
    return EvalConfig(**{**args, **kw})


def test_bf16_run_identity_includes_batch_size(tmp_path: Path):
    out = tmp_path / "bf16"
    run_eval(_cfg(out, dtype="bf16", batch_size=2))
    with pytest.raises(SkipKVError, match=r"engine.batch_size \(2 -> 3\)"):
        run_eval(_cfg(out, dtype="bf16", batch_size=3, limit=2))
    # (fp32 keeps batch size out of the identity: tests/test_eval_runner.py extends an fp32 run with another one)
