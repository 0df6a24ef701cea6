"""Steering vector files: safetensors with one vector per layer and JSON metadata.

    skipkv steer build --model qwen2.5-coder-0.5b-instruct --dataset math500 --offset 400 --limit 20 \\
        --layers 8,12,16 --out benchmarks/steering/qwen2.5-coder-0.5b.safetensors
    vec = SteeringFile.load("benchmarks/steering/qwen2.5-coder-0.5b.safetensors"); vec.vector(12)  # [E]

Tensors: `layer_<L>` [E] for every layer L built, v = mean(reflection ∪ transition) − mean(execution) of the
hidden state entering decoder layer L at each step's "\\n\\n" token (SEAL's recipe, research/algorithms.md §4).
Metadata (all JSON strings): format, model, dataset, ids (example ids used), layers, hidden_size, counts
({execution, reflection, transition}), separability ({layer: {auc, fisher}} on the held-out half),
best_layer (highest held-out AUC), max_new_tokens, prompt_style.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from skipkv.errors import SkipKVError

FORMAT = "skipkv-steering-v1"
_REQUIRED = ("format", "model", "dataset", "ids", "layers", "hidden_size", "best_layer")


@dataclass(frozen=True)
class SteeringFile:
    path: str
    meta: dict
    vectors: dict[int, torch.Tensor] | None = None  # None when only the metadata was read

    @property
    def layers(self) -> list[int]:
        return [int(x) for x in self.meta["layers"]]

    @property
    def hidden_size(self) -> int:
        return int(self.meta["hidden_size"])

    @property
    def best_layer(self) -> int:
        return int(self.meta["best_layer"])

    @property
    def ids(self) -> list[str]:
        return [str(x) for x in self.meta["ids"]]

    def resolve_layer(self, layer: int) -> int:
        """-1 = the file's best layer; else `layer`, which the file must hold."""
        if layer < 0:
            return self.best_layer
        if layer not in self.layers:
            raise SkipKVError(f"steering file {self.path} has no vector for layer {layer}; it holds layers "
                              f"{', '.join(map(str, self.layers))}")
        return layer

    def vector(self, layer: int) -> torch.Tensor:
        assert self.vectors is not None, "read with SteeringFile.load to get the vectors"
        return self.vectors[layer]

    @classmethod
    def read_meta(cls, path: str) -> SteeringFile:
        """Only the metadata (cheap: the header): checks that `path` is a steering file."""
        from safetensors import safe_open

        p = Path(path)
        if not p.is_file():
            raise SkipKVError(f"steering file not found: {path}")
        try:
            with safe_open(str(p), framework="pt") as f:
                raw = f.metadata() or {}
                keys = set(f.keys())
        except Exception:  # safetensors raises several types for a file that is not one
            raise SkipKVError(f"{path} is not a steering file (safetensors written by skipkv steer build)") from None
        from skipkv.files import parse_json
        from skipkv.files.schemas import validate

        meta = {k: parse_json(v, f"{path}: metadata {k[:40]!r}", "steering_meta") for k, v in raw.items()}
        missing = [k for k in _REQUIRED if k not in meta]
        if missing or meta.get("format") != FORMAT:
            raise SkipKVError(f"{path} is not a steering file (missing {missing[0] if missing else 'format'})")
        validate("steering_meta", meta, f"{path}: metadata")
        absent = [L for L in meta["layers"] if f"layer_{L}" not in keys]
        if absent:
            raise SkipKVError(f"{path}: metadata lists layer {absent[0]} but the file has no vector for it")
        return cls(str(path), meta)

    @classmethod
    def load(cls, path: str) -> SteeringFile:
        from safetensors.torch import load_file

        head = cls.read_meta(path)
        tensors = load_file(path)
        return cls(head.path, head.meta, {int(L): tensors[f"layer_{L}"] for L in head.layers})

    @staticmethod
    def save(path: str | Path, vectors: dict[int, torch.Tensor], meta: dict) -> None:
        from safetensors.torch import save_file

        meta = {"format": FORMAT, **meta, "layers": sorted(vectors)}
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        save_file({f"layer_{L}": v.detach().float().contiguous().cpu() for L, v in vectors.items()}, str(tmp),
                  metadata={k: json.dumps(v) for k, v in meta.items()})
        tmp.replace(path)  # atomic: never a half-written vector file
