"""Model loading: a hub id or local folder, a GGUF file, an offline recipe name, or `random:<family>[:<size>]`.

    bundle = load_model("random:qwen2")                       # tests
    bundle = load_model("qwen2.5-coder-0.5b-instruct")        # after `skipkv models pull ...`
    bundle = load_model("/path/model.gguf")                   # dequantised by transformers (needs `gguf`)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from skipkv.errors import SkipKVError

SUPPORTED_FAMILIES = ("qwen2", "llama", "qwen3")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


@dataclass
class ModelBundle:
    """A loaded model with what the engine needs to drive it."""

    model: torch.nn.Module  # an HF *ForCausalLM
    tokenizer: object  # an HF tokenizer
    name: str
    family: str

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))


def home() -> Path:
    """Where pulled models live: $SKIPKV_HOME or ~/.cache/skipkv."""
    return Path(os.environ.get("SKIPKV_HOME", Path.home() / ".cache" / "skipkv"))


def resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise SkipKVError(f"unknown dtype {dtype!r}; choose one of: {', '.join(DTYPES)}")
    return DTYPES[dtype]


def _check_family(model_type: str, name: str) -> str:
    if model_type not in SUPPORTED_FAMILIES:
        raise SkipKVError(f"model {name!r} has family {model_type!r}; supported: {', '.join(SUPPORTED_FAMILIES)}")
    return model_type


def check_attention_layout(config, name: str) -> None:
    """Refuse sliding-window attention layers (Qwen2 `use_sliding_window`, Gemma-style `layer_types`): the skipkv
    attention backend attends over each slot's whole cache, so such a layer would silently see too much."""
    window = getattr(config, "sliding_window", None)
    sliding = [i for i, t in enumerate(getattr(config, "layer_types", None) or []) if t == "sliding_attention"]
    if sliding and window is not None and window < int(getattr(config, "max_position_embeddings", 1 << 30)):
        raise SkipKVError(f"model {name!r} has sliding-window attention (window {window}) in layers "
                          f"{', '.join(map(str, sliding))}, which skipkv does not support")


def load_model(name: str, dtype: str | torch.dtype = "bf16", device: str = "cpu", seed: int = 0) -> ModelBundle:
    """Load `name` (see module docstring) for inference, in eval mode, on `device`."""
    torch_dtype = resolve_dtype(dtype)
    if name.startswith("random:"):
        from skipkv.models.random import build_random

        model, tokenizer, family = build_random(name, torch_dtype, seed=seed)
        check_attention_layout(model.config, name)
        return ModelBundle(model.to(device).eval(), tokenizer, name, family)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from skipkv.models.recipes import RECIPES

    kwargs: dict = {}
    path = Path(name)
    if name in RECIPES:
        folder = RECIPES[name].folder()
        if not (folder / "config.json").exists():
            raise SkipKVError(f"model {name!r} is not pulled yet; run: skipkv models pull {name}")
        source = str(folder)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise SkipKVError(f"GGUF file not found: {name}")
        source, kwargs = str(path.parent), {"gguf_file": path.name}
    else:
        source = name
        if not path.exists() and os.environ.get("HF_HUB_OFFLINE") == "1":
            raise SkipKVError(f"model {name!r} is neither a local folder nor a pulled model, and the hub is offline")
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        raise SkipKVError(f"cannot load model {name!r}: {str(exc).splitlines()[0]}") from None
    family = _check_family(config.model_type, name)
    check_attention_layout(config, name)
    tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    return ModelBundle(model.to(device).eval(), tokenizer, name, family)
