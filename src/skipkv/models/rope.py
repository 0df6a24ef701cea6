"""A model's rotary position embedding, read from its config, for policies that score keys or queries before RoPE
(TriAttention, Expected Attention): the inverse frequencies and transformers' attention scaling.

    python -c "from skipkv.models import load_model; from skipkv.models.rope import rope_frequencies; \\
        print(rope_frequencies(load_model('random:qwen2').config))"

The tables themselves (cos, sin, rotating and un-rotating) are pure tensor functions in skipkv.scoring.rope.
"""

from __future__ import annotations

import torch
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from skipkv.errors import SkipKVError


def rope_frequencies(config) -> tuple[torch.Tensor, float]:
    """(inv_freq [D/2] fp64, attention scaling) exactly as the model's rotary embedding builds them: the default
    RoPE from `rope_theta` and the head dim, or transformers' own initialiser for a scaled type (llama3, yarn...)."""
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if "rope_theta" not in params:
            raise SkipKVError("the model config names no rope_theta; its rotary embedding cannot be rebuilt")
        inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
        return inv_freq, 1.0
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise SkipKVError(f"rotary embedding type {rope_type!r} is not known to transformers")
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config)
    return inv_freq.double(), float(scaling)
