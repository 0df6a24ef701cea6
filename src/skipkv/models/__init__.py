"""Model loading: a hub id or local folder, a GGUF file, an offline recipe name, or `random:<family>[:<size>]`.

    bundle = load_model("random:qwen2")                       # tests
    bundle = load_model("qwen2.5-coder-0.5b-instruct")        # after `skipkv models pull ...`
    bundle = load_model("/path/model.gguf")                   # dequantised by transformers (needs `gguf`)
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import torch

from skipkv.errors import SkipKVError
from skipkv.hardware import DtypeChoice, resolve_auto, tune_allocator
from skipkv.plan import KernelPlan

SUPPORTED_FAMILIES = ("qwen2", "llama", "qwen3")
DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32, "float32": torch.float32,
          "fp16": torch.float16, "float16": torch.float16, "fp64": torch.float64, "float64": torch.float64}


@dataclass
class ModelBundle:
    """A loaded model with what the engine needs to drive it."""

    # transformers' classes: an HF *ForCausalLM and an HF tokenizer (Any: their attributes are read by name,
    # e.g. model.model.layers, tokenizer.apply_chat_template, which their annotations do not describe)
    model: Any
    tokenizer: Any
    name: str
    family: str
    dtype_choice: DtypeChoice | None = None  # set when the dtype was "auto": what it picked here, and why
    # every kernel choice its forwards make, resolved once (plan.py); load_model applies its linears
    # (models/patches.py). None: the plan of the model as it is (a transformers model loaded elsewhere).
    plan: KernelPlan = None  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        if self.plan is None:
            from skipkv.models.patches import linears_of

            self.plan = KernelPlan.resolve(self.dtype, self.device, linears=linears_of(self.model))

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


def auto_dtype(device: str | torch.device | None) -> str:
    """The throughput dtype for a device on this machine (bf16 on CUDA and on CPUs with native bf16, else fp32);
    `skipkv.hardware.choose_dtype` gives the reason too."""
    from skipkv.hardware import choose_dtype

    return choose_dtype(device).dtype


def resolve_dtype(dtype: str | torch.dtype, device: str | torch.device | None = "cpu") -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        dtype = auto_dtype(device)
    if dtype not in DTYPES:
        raise SkipKVError(f"unknown dtype {dtype!r}; choose one of: auto, {', '.join(DTYPES)}")
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
def check_device(device: str | torch.device) -> torch.device:
    """`device` parsed and usable in this torch build (a CPU build has no cuda:N), else a one-line error."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError, ValueError):
        raise SkipKVError(f"unknown device {device!r}; e.g. cpu, cuda, cuda:0") from None
    if dev.type == "cpu":
        return dev
    if dev.type == "meta":  # shapes only, no data: nothing could be generated on it
        raise SkipKVError("device 'meta' holds no weights; use cpu or cuda")
    try:
        torch.empty(0, device=dev)  # the one test every backend answers the same way
    except (RuntimeError, AssertionError, ValueError) as exc:  # torch raises AssertionError for a CPU build
        raise SkipKVError(f"device {device!r} is not available here ({str(exc).splitlines()[0][:120]})") from None
    return dev


# Hub ids are "name" or "org/name"; anything else that does not exist on disk is a missing local path.
_HUB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*(/[A-Za-z0-9][A-Za-z0-9._-]*)?$")


def _hub_reachable(timeout_s: float = 3.0) -> bool:
    """Whether the hub's host answers on its port; without it, transformers retries for ~30 s per file."""
    url = urlsplit(os.environ.get("HF_ENDPOINT", "https://huggingface.co"))
    try:
        with socket.create_connection((url.hostname or "", url.port or (443 if url.scheme == "https" else 80)),
                                      timeout=timeout_s):
            return True
    except OSError:
        return False


def _check_weights(source: Path, gguf_file: str | None) -> None:
    """Open the header of every weight file before transformers does, so a truncated, half-written or
    corrupt file is reported by name rather than as a parser traceback."""
    if gguf_file is not None:
        from gguf import GGUFReader

        path = source / gguf_file
        try:
            GGUFReader(path)
        except Exception as exc:  # the GGUF parser's failures (struct.error, ValueError, ...) are not enumerable
            first = str(exc).splitlines()[0][:120]
            raise SkipKVError(f"{path} is not a valid GGUF file (truncated or corrupt: {first})") from None
        return
    if not source.is_dir():
        return
    index = source / "model.safetensors.index.json"
    if index.exists():
        from skipkv.files import read_json

        try:
            shards = set(read_json(index, "safetensors_index")["weight_map"].values())
        except SkipKVError as exc:
            raise SkipKVError(f"not a valid safetensors index: {exc}") from None
        if any(Path(s).name != s for s in shards):  # a shard name is a file beside the index, never a path
            raise SkipKVError(f"{index}: a shard name is a path, not a file name")
        missing = sorted(s for s in shards if not (source / s).is_file())
        if missing:
            raise SkipKVError(f"{source / missing[0]} is missing (listed in {index.name}); the download is incomplete")
    from safetensors import safe_open

    for path in sorted(source.glob("*.safetensors")):
        try:
            with safe_open(str(path), "pt") as f:
                f.keys()
        except Exception as exc:  # SafetensorError is not importable under a stable name across versions
            raise SkipKVError(f"{path} is not a complete safetensors file ({str(exc).splitlines()[0][:120]})") from None


def load_model(name: str, dtype: str | torch.dtype = "auto", device: str = "cpu", seed: int = 0) -> ModelBundle:
    """Load `name` (see module docstring) for inference, in eval mode, on `device`.

    dtype "auto" (the default) is bf16 on CUDA and on CPUs with native bf16 matmul, fp32 elsewhere
    (`skipkv.hardware`); the bundle's `dtype_choice` records what was picked and why."""
    check_device(device)
    if torch.device(device).type == "cpu":
        tune_allocator()  # before the weights and every activation (hardware.py: freed memory stays for reuse)
    choice = None
    if isinstance(dtype, str):
        dtype, choice = resolve_auto(dtype, device)
    torch_dtype = resolve_dtype(dtype)
    if not isinstance(name, str) or not name.strip():
        raise SkipKVError(f"model must be a non-empty name or path, got {name!r}")
    if name.startswith("random:"):
        from skipkv.models.random import build_random

        model, tokenizer, family = build_random(name, torch_dtype, seed=seed, device=device)
        check_attention_layout(model.config, name)
        return _bundle(model.to(device).eval(), tokenizer, name, family, choice)

    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from skipkv.models.recipes import RECIPES

    kwargs: dict = {}
    path = Path(name).expanduser()
    if name in RECIPES:
        folder = RECIPES[name].folder()
        if not (folder / "config.json").exists():
            raise SkipKVError(f"model {name!r} is not pulled yet; run: skipkv models pull {name}")
        source = str(folder)
        _check_weights(folder, None)
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise SkipKVError(f"GGUF file not found: {name}")
        source, kwargs = str(path.parent), {"gguf_file": path.name}
        _check_weights(path.parent, path.name)
    elif path.exists():
        if not path.is_dir():
            raise SkipKVError(f"model path {name} is a file; give a model folder or a .gguf file")
        if not (path / "config.json").is_file():
            raise SkipKVError(f"model folder {name} has no config.json")
        source = str(path)
        _check_weights(path, None)
    elif not _HUB_ID.match(name):
        raise SkipKVError(f"model path not found: {name}")
    else:
        source = name
        # Offline (declared, or the hub does not answer): only the local hub cache is tried, and a miss is
        # one line at once instead of half a minute of retries and warnings.
        if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on") or not _hub_reachable():
            kwargs["local_files_only"] = True
    try:
        config = AutoConfig.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        if kwargs.get("local_files_only"):
            raise SkipKVError(f"model {name!r} is not a local folder, a pulled model or in the hub cache, and the "
                              "hub cannot be reached (offline)") from None
        raise SkipKVError(f"cannot load model {name!r}: {str(exc).splitlines()[0]}") from None
    family = _check_family(config.model_type, name)
    check_attention_layout(config, name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        hf_model: Any = AutoModelForCausalLM.from_pretrained(source, dtype=torch_dtype, **kwargs)
    except (OSError, ValueError) as exc:
        raise SkipKVError(f"cannot load model {name!r}: {str(exc).splitlines()[0][:200]}") from None
    return _bundle(hf_model.to(device).eval(), tokenizer, name, family, choice)


def _bundle(model: Any, tokenizer: Any, name: str, family: str, choice: DtypeChoice | None) -> ModelBundle:
    """The bundle, with its kernel plan resolved once (plan.py) and its linears replaced as the plan says
    (models/patches.apply_linears: prepacked, upcast or transposed where that is faster)."""
    from skipkv.models.patches import apply_linears

    param = next(model.parameters())
    plan = apply_linears(model, KernelPlan.resolve(param.dtype, param.device))
    return ModelBundle(model, tokenizer, name, family, choice, plan)
