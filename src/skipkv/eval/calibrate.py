"""`skipkv calibrate`: TriAttention's per-model statistics (policies/triattention.py) from text no evaluation uses.

    skipkv calibrate --model qwen2.5-coder-0.5b-instruct --out benchmarks/triattention/qwen2.5-coder-0.5b.safetensors

The model reads the text in segments of `--segment` tokens (plain forwards, no cache); a hook on every layer's
q_proj (followed by its q_norm where the model has one, Qwen3) takes each token's pre-RoPE query, and per layer
and query head the file keeps the mean of each RoPE frequency band as a complex number and the mean of its
modulus, with each layer's q_proj fingerprint (the model check) and metadata: model, text, its sha256, tokens.

Text (`--text`): `python-docs` (default), the docstrings of a fixed list of Python standard-library modules,
packaged with every Python and used by no evaluation set here (prose and code, like the model's inputs; the
sha256 in the file pins the Python version's wording); or `--text-file FILE`, any UTF-8 text.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
from pathlib import Path

import torch

from skipkv.errors import SkipKVError
from skipkv.hardware import DTYPE_HELP, set_threads

# Pure-Python standard-library modules present in every CPython install; their docstrings, in this order.
PYTHON_DOC_MODULES = (
    "difflib", "textwrap", "heapq", "bisect", "argparse", "json", "decimal", "fractions", "statistics", "functools",
    "collections", "random", "string", "calendar", "csv", "shlex", "fnmatch", "glob", "tempfile", "contextlib",
    "dataclasses", "enum", "abc", "numbers", "pprint", "reprlib", "graphlib", "ipaddress", "locale", "gettext",
    "optparse", "configparser", "zipfile", "tarfile", "shutil", "pathlib", "queue", "sched", "threading", "logging",
    "unittest", "doctest", "pickle", "copy", "typing", "inspect", "ast", "tokenize", "codecs", "base64", "hashlib",
    "hmac", "secrets", "uuid", "urllib.parse", "http.client", "email.message", "smtplib", "socket", "selectors",
    "asyncio", "subprocess", "signal", "struct", "weakref", "types", "operator", "datetime", "timeit", "trace",
    "pdb", "profile", "pstats", "sysconfig", "warnings", "traceback",
)


def calibration_text(name: str, text_file: str | None = None) -> tuple[str, str]:
    """(label, text): the named packaged text, or a file's."""
    if text_file:
        return f"file:{Path(text_file).name}", Path(text_file).read_text(encoding="utf-8")
    if name != "python-docs":
        raise SkipKVError(f"unknown calibration text {name!r}; use python-docs or --text-file FILE")
    docs = [(importlib.import_module(m).__doc__ or "").strip() for m in PYTHON_DOC_MODULES]
    return name, "\n\n".join(d for d in docs if d)


def query_statistics(bundle, ids: list[int], segment: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per layer and query head, over every token of `ids` read in segments: the mean pre-RoPE query per RoPE
    band (complex [L, Hq, F]) and the mean modulus per band ([L, Hq, F]); and q_proj fingerprints [L, 2]."""
    from skipkv.policies.triattention import query_fingerprint
    from skipkv.scoring.trig import complex_pairs

    model = bundle.model
    cfg = model.config
    L, Hq = cfg.num_hidden_layers, cfg.num_attention_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    total = torch.zeros(L, Hq, D // 2, dtype=torch.complex128)
    modulus = torch.zeros(L, Hq, D // 2, dtype=torch.float64)
    hooks = []

    def hook_for(layer: int, attn):
        def hook(_mod, _inp, out):
            q = out.view(*out.shape[:-1], Hq, D)  # [1, T, Hq, D]
            if getattr(attn, "q_norm", None) is not None:
                q = attn.q_norm(q)
            z = complex_pairs(q[0].double())  # [T, Hq, F]
            total[layer] += z.sum(dim=0).cpu()
            modulus[layer] += z.abs().sum(dim=0).cpu()
        return hook

    for layer, block in enumerate(model.model.layers):
        hooks.append(block.self_attn.q_proj.register_forward_hook(hook_for(layer, block.self_attn)))
    try:
        with torch.inference_mode():
            for s in range(0, len(ids), segment):
                model.model(input_ids=torch.tensor([ids[s:s + segment]], device=bundle.device), use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    fingerprint = torch.stack([query_fingerprint(b.self_attn.q_proj, bundle.dtype) for b in model.model.layers])
    return total / len(ids), modulus / len(ids), fingerprint


def calibrate(model: str, out: str, text: str = "python-docs", text_file: str | None = None, tokens: int = 8192,
              segment: int = 1024, dtype: str = "auto") -> dict:
    """The whole command: load, read the text, write the file. Returns the metadata written."""
    from skipkv.models import load_model
    from skipkv.policies.triattention import TriStats

    if tokens <= 0 or segment <= 0:
        raise SkipKVError("--tokens and --segment must be positive")
    label, body = calibration_text(text, text_file)
    bundle = load_model(model, dtype=dtype)
    ids = bundle.tokenizer(body, add_special_tokens=False)["input_ids"][:tokens]
    if len(ids) < 2:
        raise SkipKVError(f"calibration text {label!r} has fewer than 2 tokens")
    q_mean, q_abs, fingerprint = query_statistics(bundle, ids, segment)
    meta = {"model": bundle.name, "text": label, "text_sha256": hashlib.sha256(body.encode()).hexdigest(),
            "tokens": len(ids), "segment": segment, "dtype": str(bundle.dtype).removeprefix("torch.")}
    TriStats.save(out, q_mean, q_abs, fingerprint, meta)
    return meta


def cmd_calibrate(args: argparse.Namespace) -> int:
    set_threads(args.threads)
    meta = calibrate(args.model, args.out, args.text, args.text_file, args.tokens, args.segment, args.dtype)
    print(f"{args.out}: {meta['model']}, {meta['tokens']} tokens of {meta['text']} (sha256 {meta['text_sha256'][:12]})")
    return 0


def register(sub) -> None:
    p = sub.add_parser("calibrate", help="TriAttention's per-model query statistics")
    p.add_argument("--model", required=True)
    p.add_argument("--out", required=True, help="output .safetensors file")
    p.add_argument("--text", default="python-docs", help="packaged calibration text (python-docs)")
    p.add_argument("--text-file", default=None, help="calibrate on this UTF-8 text file instead")
    p.add_argument("--tokens", type=int, default=8192, help="tokens of the text to read (default 8192)")
    p.add_argument("--segment", type=int, default=1024, help="tokens per forward (default 1024)")
    p.add_argument("--dtype", default="auto", help=DTYPE_HELP)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (default 0: torch's, one per core)")
    p.set_defaults(func=cmd_calibrate)
