"""Random-weight models built from a config: no download, used by tests and benchmarks.

    load_model("random:qwen2")          # tiny Qwen2 (2 layers, hidden 64): unit tests
    load_model("random:qwen2:0.5b")     # Qwen2.5-0.5B shape (24 layers, 14 q / 2 kv heads): benchmarks
    load_model("random:llama:tiny")
    load_model("random:qwen2:sharp")    # tiny, with q/k scaled so attention is peaked: policy tests

A tiny random model attends almost uniformly, so a policy test on it passes whatever the scores say; the
`sharp` size scales every layer's q and k projections (weights and biases) by `SHARP_SCALE`, which makes each
query's softmax concentrate on a few keys, so what a policy keeps changes what the model generates.

The tokenizer is a byte-level one built in process (256 byte tokens + ChatML specials), so any text
round-trips and nothing is fetched from a hub.
"""

from __future__ import annotations

import contextlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast, Qwen2Config, Qwen3Config

from skipkv.errors import SkipKVError

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

SHARP_SCALE = 16.0  # q and k each x16: on the tiny shape a query puts ~all its mass on ~10 keys (entropy ~1 nat)
_TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=512, max_position_embeddings=4096)
# name -> (config class, {size: overrides}); realistic shapes follow the published configs.
FAMILIES: dict[str, tuple[type, dict[str, dict]]] = {
    "qwen2": (Qwen2Config, {
        "tiny": _TINY,
        "sharp": _TINY,
        "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=4096, max_position_embeddings=32768),
        "0.5b": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True),
        "1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, tie_word_embeddings=True),
        "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768),
    }),
    "llama": (LlamaConfig, {
        "tiny": _TINY,
        "sharp": _TINY,
        "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=32768, tie_word_embeddings=True),
        "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=32768),
    }),
    "qwen3": (Qwen3Config, {
        "tiny": dict(_TINY, head_dim=16),
        "0.6b": dict(hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, max_position_embeddings=32768,
                     tie_word_embeddings=True),
    }),
}


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE tokenizer with no merges: ids 0..255 are bytes, then the ChatML specials."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   bos_token=None, unk_token=None)
    fast.chat_template = CHATML
    return fast


def parse(spec: str) -> tuple[str, str]:
    """'random:qwen2:0.5b' -> ('qwen2', '0.5b'); size defaults to 'tiny'."""
    parts = spec.split(":")
    family = parts[1] if len(parts) > 1 else ""
    size = parts[2] if len(parts) > 2 else "tiny"
    if family not in FAMILIES:
        raise SkipKVError(f"unknown model family {family!r} in {spec!r}; supported: {', '.join(FAMILIES)}")
    sizes = FAMILIES[family][1]
    if size not in sizes:
        raise SkipKVError(f"unknown size {size!r} for random:{family}; choose one of: {', '.join(sizes)}")
    return family, size


def build_random(spec: str, dtype: torch.dtype, seed: int = 0, device: torch.device | str = "cpu"):
    """Instantiate (model, tokenizer, family) with seeded random weights. On a device other than the CPU the
    weights are drawn there (the 7B shape in seconds instead of minutes of CPU initialisation), so they differ from
    the CPU draw of the same seed; on the CPU they are what they have always been."""
    family, size = parse(spec)
    config_cls, sizes = FAMILIES[family]
    tokenizer = byte_tokenizer()
    config = config_cls(**sizes[size], bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                        pad_token_id=tokenizer.pad_token_id)
    where = torch.device(device)
    with torch.random.fork_rng(), contextlib.ExitStack() as stack:
        torch.manual_seed(seed)
        if where.type != "cpu":
            stack.enter_context(where)  # allocate and initialise on the device
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if size == "sharp":
        sharpen(model)
    return model, tokenizer, family


def sharpen(model) -> None:
    """Scale every layer's q and k projections (weight and bias) by SHARP_SCALE, in place: peaked attention."""
    with torch.no_grad():
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.mul_(SHARP_SCALE)
                if proj.bias is not None:
                    proj.bias.mul_(SHARP_SCALE)
