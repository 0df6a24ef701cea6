"""SkipKV's whole-sentence eviction on TriAttention's scores: a combination of the two methods, ours.

    skipkv calibrate --model random:qwen2 --out tri.safetensors
    skipkv generate --model random:qwen2 --policy skipkv_tri --stats-file tri.safetensors --budget 256 \\
        --window 32 --interval 64 --max-new-tokens 600 --ignore-eos "Hi."

Why: SkipKV (arXiv 2512.07993) removes redundant sentences whole but ranks the rest by R-KV's attention score;
TriAttention (arXiv 2604.04921) ranks keys far better than R-KV on reasoning traces in its paper, yet evicts
token by token, so a repeated derivation survives wherever its keys look important. Here each cached key scores
TriAttention's (triattention.py: calibrated pre-RoPE statistics, z-scored per query head, max over the group)
minus `sentence_weight` x the similarity of the flagged sentence holding it, flags exactly as SkipKV raises them
(skipkv.py: mean last-layer hidden states of closed sentences, the earlier of a pair above `tau` flagged, at
each decode-time compression; none at prefill). Steering (`--steering FILE`) works as in SkipKV.

Knobs keep defaults for now: TriAttention's (`window` 128, `interval` 128, `budget` 2048, `zscore`, max
over the group) and SkipKV's (`tau` 0.95, the reference delimiters and check words), except `sentence_weight`
(100): TriAttention's z-scored scores spread over a few units where R-KV's are ~1e-3, so weight 1 would no
longer put a flagged sentence first; at 100 x a similarity above `tau` it goes first, whole, as in SkipKV.
Choosing the knobs on the calibration slice (GSM8K 1200-1223) is pending (issue 45, item 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation
from skipkv.policies.skipkv import SentenceEviction
from skipkv.policies.triattention import TriAttention


@POLICIES.register("skipkv_tri")
@dataclass(frozen=True)
class SkipKVTri(SentenceEviction, TriAttention):
    paper = "SkipKV (arXiv 2512.07993) on TriAttention (arXiv 2604.04921)"
    keeps = ("TriAttention's scores (`--stats-file FILE`) minus `sentence_weight` (100) × the similarity of "
             "SkipKV's redundant sentences: flagged sentences go first, whole; knobs at their defaults, tuning on "
             "the calibration slice pending")

    # TriAttention's defaults, restated: the SentenceEviction base (a Policy) would otherwise bring back Policy's.
    budget: int = knob(2048, "tokens kept per request per kv head (TriAttention's 2048)", gt=0)
    window: int = knob(128, "newest tokens always kept (TriAttention's 128)", ge=1)
    sentence_weight: float = knob(100.0, "scale of the flagged-sentence penalty (TriAttention's z-scores spread "
                                  "over a few units)", ge=0.0)

    needs: ClassVar[frozenset[str]] = frozenset({"hidden"})

    def base_score(self, obs: Observation) -> torch.Tensor:
        return self.tri_scores(obs)

    def check_run(self, bundle, dataset: str | None = None, example_ids: tuple | list = ()) -> None:
        TriAttention.check_run(self, bundle, dataset, example_ids)
        SentenceEviction.check_run(self, bundle, dataset, example_ids)
