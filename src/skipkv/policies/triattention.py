"""TriAttention (Mao et al., ICML 2026, arXiv 2604.04921): score keys from pre-RoPE query statistics calibrated
offline on the model, a trigonometric series in each head's distance preference, no attention matrix.

    skipkv calibrate --model random:qwen2 --out tri.safetensors
    skipkv generate --model random:qwen2 --policy triattention --stats-file tri.safetensors --budget 256 \\
        --max-new-tokens 600 --ignore-eos "Hi."

At each compression every cached key is rotated back to before RoPE (its true position is stored) and scored
for each query head of its kv group by scoring.trig.trig_scores: the calibrated mean query's expected logit
against it, averaged over future queries 1, 2, 4, ... <= `max_offset` positions past the newest token, plus
the bound on what the queries' spread around their mean adds. Per query head the candidates' scores are
z-scored (`zscore`), then reduced over the group (`aggregate`, max); each kv head keeps its `budget` best,
with the newest `window` (128) and the `sink` oldest kept whatever they score. It compresses whenever the cache
reaches `budget + interval` (every 128 generated tokens by default) and, with `phase` both, the prompt.

Statistics (`stats_file`, required): a file written by `skipkv calibrate` (safetensors: per layer and query
head the mean pre-RoPE query as complex frequency bands and the mean modulus of each band; metadata: model, the
text used, its sha256 and token count). A file calibrated on another model is refused with a one-line error: its
shape must match, and each layer's q_proj fingerprint (the sum and absolute sum of q_proj applied to a fixed probe
vector) must agree within 1% of the absolute sum; checked for every layer before an evaluation (`check_run`) and
at each layer's first compression.

Choices and departures (reference: WeianMao/triattention, triattention.py and pruning_utils.py):
- selection per (layer, kv head), each keeping `budget` (the reference's `per_layer_perhead_pruning` with max
  aggregation), in the uniform store; its default, one union over all layers' sampled heads that every layer
  keeps, does not fit a per-layer budget; every head is scored (the reference may sample heads);
- `zscore` z-scores each query head before the group's max (the reference's `normalize_scores` option);
- the prompt is compressed like any other entries with `phase` both; the reference pins the prompt, which is
  `--protect-prompt true` here; ties go to the older token instead of random noise; kept indices are sorted;
- statistics come from `skipkv calibrate` on a packaged text no evaluation uses (eval/calibrate.py), not from
  the reference's calibration traces.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.errors import SkipKVError
from skipkv.models.packed import LinearPart
from skipkv.models.rope import rope_frequencies
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.scoring.rope import rope_cos_sin, unrotate
from skipkv.scoring.trig import geometric_offsets, trig_scores

FORMAT = "skipkv-triattention-stats-v1"
FINGERPRINT_RTOL = 1e-2  # a model in bf16 and in fp32 agree to ~0.1%; another checkpoint's q_proj does not


def query_fingerprint(q_proj, dtype: torch.dtype) -> torch.Tensor:
    """[2] fp64: the sum and absolute sum of q_proj applied to a fixed probe vector. Works whatever form the
    linear takes (dense, packed, transposed, a part of a fused q/k/v product: models/packed.py keeps no dense q_proj
    weight) and at any dtype."""
    probe = torch.sin(torch.arange(q_proj.in_features, dtype=torch.float64) * 0.7)[None]
    owner = q_proj._fused[0] if isinstance(q_proj, LinearPart) else q_proj  # a fused part holds no tensor itself
    device = next(itertools.chain(owner.buffers(), owner.parameters())).device
    with torch.no_grad():
        y = q_proj(probe.to(device=device, dtype=dtype)).double()
    return torch.stack([y.sum(), y.abs().sum()]).cpu()


@dataclass(frozen=True)
class TriStats:
    """Calibrated statistics: q_mean [L, Hq, F] complex, q_abs [L, Hq, F], fingerprint [L, 2], metadata."""

    path: str
    meta: dict
    q_mean: torch.Tensor
    q_abs: torch.Tensor
    fingerprint: torch.Tensor

    @classmethod
    def load(cls, path: str) -> TriStats:
        from safetensors import safe_open

        if not Path(path).is_file():
            raise SkipKVError(f"triattention stats file not found: {path}")
        try:
            with safe_open(path, framework="pt") as f:
                meta = {k: json.loads(v) for k, v in (f.metadata() or {}).items()}
                t = {k: f.get_tensor(k) for k in f.keys()}
        except Exception:  # safetensors raises several types for a file that is not one
            raise SkipKVError(f"{path} is not a triattention stats file (skipkv calibrate writes them)") from None
        if meta.get("format") != FORMAT or not {"q_mean_real", "q_mean_imag", "q_abs", "fingerprint"} <= set(t):
            raise SkipKVError(f"{path} is not a triattention stats file (skipkv calibrate writes them)")
        return cls(path, meta, torch.complex(t["q_mean_real"].double(), t["q_mean_imag"].double()),
                   t["q_abs"].double(), t["fingerprint"].double())

    @staticmethod
    def save(path: str | Path, q_mean: torch.Tensor, q_abs: torch.Tensor, fingerprint: torch.Tensor,
             meta: dict) -> None:
        from safetensors.torch import save_file

        Path(path).parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(str(path) + ".tmp")
        tensors = {"q_mean_real": q_mean.real.double().contiguous(), "q_mean_imag": q_mean.imag.double().contiguous(),
                   "q_abs": q_abs.double().contiguous(), "fingerprint": fingerprint.double().contiguous()}
        save_file(tensors, str(tmp), metadata={k: json.dumps(v) for k, v in {"format": FORMAT, **meta}.items()})
        tmp.replace(path)  # atomic: never a half-written stats file

    def check_layer(self, layer: int, module, dtype: torch.dtype) -> None:
        """SkipKVError unless these statistics were calibrated on the model that `module` (layer `layer`'s
        attention) belongs to."""
        cfg = module.config
        D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        shape = (cfg.num_hidden_layers, cfg.num_attention_heads, D // 2)
        if tuple(self.q_mean.shape) != shape:
            raise SkipKVError(f"triattention stats {self.path} were calibrated on {self.meta.get('model')!r} "
                              f"(layers, query heads, bands {tuple(self.q_mean.shape)}); this model has {shape}")
        got = query_fingerprint(module.q_proj, dtype)
        want = self.fingerprint[layer]
        # Both figures relative to the absolute sum: the signed sum cancels, so its own relative error is noise.
        if float((got - want).abs().max()) > FINGERPRINT_RTOL * float(want[1]):
            raise SkipKVError(f"triattention stats {self.path} were calibrated on another model "
                              f"({self.meta.get('model')!r}): layer {layer}'s q_proj differs; run skipkv calibrate "
                              "on this one")


@POLICIES.register("triattention")
@dataclass(frozen=True)
class TriAttention(Policy):
    paper = "TriAttention (arXiv 2604.04921)"
    keeps = ("newest `window` (128) + per kv head the keys that calibrated pre-RoPE query statistics expect future "
             "queries to attend to (a trigonometric series in the distance, plus norms; no attention matrix); "
             "`--stats-file FILE` from `skipkv calibrate`; every 128 generated tokens")
    contract_knobs = {"stats_file": "@calibrated"}  # tests/test_policies.py writes a file for its tiny model

    budget: int = knob(2048, "tokens kept per request per kv head (the paper's 2048)", gt=0)
    window: int = knob(128, "newest tokens always kept", ge=1)
    stats_file: str = knob("", "statistics file from `skipkv calibrate` for this model (required)")
    max_offset: int = knob(65536, "future queries scored at offsets 1, 2, 4, ... up to this", gt=0)
    zscore: bool = knob(True, "z-score each query head's scores over the candidates before the group reduce")
    aggregate: str = knob("max", "reduce the query heads of a kv group", choices=("max", "mean"))

    needs: ClassVar[frozenset[str]] = frozenset()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.stats_file:
            raise SkipKVError(f"{type(self).__name__} needs --stats-file FILE (skipkv calibrate --model M --out FILE)")
        TriStats.load(self.stats_file)  # fail before any model loads

    @cached_property
    def _stats(self) -> TriStats:
        return TriStats.load(self.stats_file)

    @cached_property
    def _checked(self) -> set[int]:
        return set()  # layers whose module was checked against the statistics (ids of the modules)

    def check_run(self, bundle, dataset: str | None = None, example_ids: tuple | list = ()) -> None:
        for layer, block in enumerate(bundle.model.model.layers):
            self._stats.check_layer(layer, block.self_attn, bundle.dtype)

    def tri_scores(self, obs: Observation) -> torch.Tensor:
        """Scores [b, H, n]: per query head trig_scores, z-scored over the candidates, reduced over each group."""
        stats = self._stats
        if id(obs.module) not in self._checked:
            stats.check_layer(obs.layer, obs.module, obs.keys.dtype)
            self._checked.add(id(obs.module))
        inv_freq, scaling = rope_frequencies(obs.module.config)
        cos, sin = rope_cos_sin(inv_freq, obs.positions.cpu(), scaling)  # [b, H, n, D]
        keys = obs.keys.double()
        pre = unrotate(keys, cos.to(keys.device), sin.to(keys.device), scaling)
        start = obs.positions.amax(dim=(1, 2))  # [b]: each row's newest position, the round start
        dev = keys.device
        raw = trig_scores(pre, obs.positions.to(dev), start.to(dev), stats.q_mean[obs.layer].to(dev),
                          stats.q_abs[obs.layer].to(dev), inv_freq.to(dev),
                          geometric_offsets(self.max_offset).to(dev), scaling)  # [b, Hq, n]
        b, Hq, n = raw.shape
        H = keys.shape[1]
        if self.zscore:
            lo, hi = min(self.sink, n), max(n - self.kept_window(obs), min(self.sink, n))
            if hi - lo > 1:
                cand = raw[..., lo:hi]
                raw = (raw - cand.mean(dim=-1, keepdim=True)) / cand.std(dim=-1, unbiased=False,
                                                                        keepdim=True).clamp_min(1e-6)
        grouped = raw.view(b, H, Hq // H, n)
        return grouped.amax(dim=2) if self.aggregate == "max" else grouped.mean(dim=2)

    def score(self, obs: Observation) -> torch.Tensor:
        return self.tri_scores(obs)
