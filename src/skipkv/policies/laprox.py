"""LaProx (Mai & Kim, arXiv 2605.07234): output-aware scores, made comparable across layers, one model-wide top-k.

    skipkv generate --model random:qwen2 --policy laprox --budget-ratio 0.1 --json "a long prompt ..."

Score of cached token i in layer l, over the observation window (the last `prefill_window` prompt queries j):

    score_l(i) = || sum_h sum_j A_{h,j,i} * V_{g(h),i} @ W_O^h ||

A is the softmax of each window query over the causal keys (window keys included), V the value of token i
in the query head's kv group g(h) (GQA: shared within a group), W_O^h [D, E] the head's slice of `o_proj`.
Heads are summed BEFORE the norm, so heads that cancel or reinforce each other count (the paper's point).
`norm` picks the variant:
  - "sum": the norm of the window-summed output vector (one [n, Hq*D] x [Hq*D, E] product per layer);
  - "frobenius": the exact per-query contributions, ||C_i||_F with C_i[j] = sum_h A_{h,j,i} u_{h,i}, via the
    per-head-pair Gram trick ||C_i||^2 = sum_{h,h'} (a_{h,i} . a_{h',i}) (V_{g(h),i}^T W_O^h W_O^h'^T V_{g(h'),i}),
    never materialising [w, n, E].
Scores are normalised per layer over that layer's candidates (`normalize`: zscore = the seed's (s - mu)/sigma,
sum = share of the layer's total, none), then ONE top-k runs over every layer's candidates at once: the model
keeps `budget` x layers entries, or `budget_ratio` x prompt length x layers. Every layer always keeps its
`sink` oldest and `prefill_window` newest tokens, and at least `min_layer_tokens` entries in all.

Granularity (`granularity`): "layer" (the default, as the research notes' sketch: all kv heads of a layer keep
the same tokens) or "head": the seed's "normalise head contributions to one scale, one top-k over the union of
(layer, head)". With head, the score of token i for kv head g of layer l sums the seed's formula over g's query
heads only, score_{l,g}(i) = || sum_{h in g} sum_j A_{h,j,i} V_{g,i} W_O^h || (the same `norm` variants, over
that head group), each (layer, kv head) is normalised over its own candidates, and ONE top-k runs over every
(layer, kv head) at once: the model keeps `budget` x layers x kv heads entries. Every (layer, kv head) keeps its
`sink` oldest and `prefill_window` newest tokens and at least `min_layer_tokens` entries. Heads of one layer
then hold different counts; the engine gives such policies a head-split store (cache/store.py), in which each
(layer, kv head) is allocated for what it keeps, so the saving is real.

Phase: prefill only (the seed targets long prompts). Decode steps then append one entry per layer and never
evict; the per-layer capacity after prefill is what each layer kept + max_new_tokens. With chunked prefill
(`--prefill-chunk`) the model-wide selection runs after every chunk with the whole prompt's budget, so the
peak stays near budget + chunk per layer. A prompt whose entries all fit the budget is not compressed.
Departures (the method section is not public, see research/algorithms.md §7): the window size (32), the
z-score over candidates only, and tie-breaking (older layer, then older token) are our choices.

Ablation axes (each a knob; the defaults are the seed's method, the row every ablation is read against):
  - `scoring`: "output" (the score above) or "attention" (attention only: sum_h sum_j A_{h,j,i}, the
    head-summed window attention, no values, no o_proj);
  - `allocation`: "model" (one top-k over every layer's normalised candidates) or "layer" (every layer keeps
    the same share, its own top-k; `normalize` then changes nothing, since each normalisation is monotone
    within a layer);
  - `kernel`: 1 (the seed) or a max-pool width over each layer's candidate scores before normalising, as
    SnapKV does (7), so that the neighbours of a strong token (the other digits of a needle) survive with it.
    With `kernel` > 1 the method is a LaProx-SnapKV hybrid (SnapKV's pooling, which also moves budget between
    layers under the model-wide top-k), reported as such; it was added after plain LaProx had been seen
    dropping needle digits, not as part of the seed's method.
  - `granularity`: "layer" or "head" (above).
`ABLATION_AXES` lists them.
The sweep configs name the variants (labels such as `laprox-attn`, `laprox-layer`, `laprox-pool7`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.errors import SkipKVError
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.scoring import pool1d

NORMS = ("sum", "frobenius")
NORMALIZATIONS = ("zscore", "sum", "none")
SCORINGS = ("output", "attention")
ALLOCATIONS = ("model", "layer")
GRANULARITIES = ("layer", "head")
# The knobs the ablation crosses; the seed's method is every axis at its default (see the module docstring).
ABLATION_AXES = ("scoring", "allocation", "kernel", "granularity")


def window_attention(queries: torch.Tensor, keys: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal softmax of the window queries over all keys: queries [b, Hq, w, D] are the tokens of the last w
    keys of keys [b, H, n, D] (query j sits at key index n - w + j). Returns A [b, Hq, w, n] (query-head order
    h = kv_head * G + g, as transformers' repeat_kv)."""
    b, Hq, w, D = queries.shape
    H, n = keys.shape[1], keys.shape[2]
    dt = torch.float64 if keys.dtype == torch.float64 else torch.float32
    q = queries.reshape(b, H, Hq // H, w, D).to(dt)
    logits = torch.einsum("bhgwd,bhnd->bhgwn", q, keys.to(dt)) * scale
    visible = torch.arange(n, device=keys.device)[None, :] <= (n - w + torch.arange(w, device=keys.device))[:, None]
    logits = logits.masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).reshape(b, Hq, w, n)


def output_scores(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, o_weight: torch.Tensor,
                  norm: str = "sum", scale: float | None = None, chunk: int = 512) -> torch.Tensor:
    """LaProx score of every cached token: queries [b, Hq, w, D], keys/values [b, H, n, D], o_weight [E, Hq*D]
    (nn.Linear layout) -> [b, n] (fp32, fp64 for fp64 inputs)."""
    b, Hq, w, D = queries.shape
    H, n = keys.shape[1], keys.shape[2]
    scale = D**-0.5 if scale is None else scale
    A = window_attention(queries, keys, scale)  # [b, Hq, w, n]
    dt = A.dtype
    V = values.to(dt).repeat_interleave(Hq // H, dim=1)  # [b, Hq, n, D]: head h reads kv head h // G
    W = o_weight.to(dt)
    if norm == "sum":
        a = A.sum(dim=2)  # [b, Hq, n]
        x = (a[..., None] * V).permute(0, 2, 1, 3).reshape(b, n, Hq * D)  # [b, n, Hq*D]
        return (x @ W.T).norm(dim=-1)  # [b, n]
    if norm != "frobenius":
        raise ValueError(f"unknown norm {norm!r}")
    Wt = W.view(-1, Hq, D).permute(1, 2, 0)  # [Hq, D, E]: W_O^h
    gram = torch.einsum("hde,kfe->hkdf", Wt, Wt)  # [Hq, Hq, D, D]: W_O^h W_O^h'^T
    out = []
    for s in range(0, n, chunk):  # bounds the [b, c, Hq, Hq, D] intermediate
        e = min(s + chunk, n)
        aa = torch.einsum("bhwn,bkwn->bnhk", A[..., s:e], A[..., s:e])  # attention columns, per head pair
        v = V[:, :, s:e]  # [b, Hq, c, D]
        uu = torch.einsum("bhnd,hkdf,bknf->bnhk", v, gram, v)  # projected-value dot products, per head pair
        out.append((aa * uu).sum(dim=(-1, -2)).clamp_min(0).sqrt())
    return torch.cat(out, dim=1)


def attention_scores(queries: torch.Tensor, keys: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """Attention-only score of every cached token (the ablation of the output-aware one): the window
    attention summed over query heads and window queries, sum_h sum_j A_{h,j,i}. queries [b, Hq, w, D],
    keys [b, H, n, D] -> [b, n] (fp32, fp64 for fp64 inputs)."""
    D = queries.shape[-1]
    return window_attention(queries, keys, D**-0.5 if scale is None else scale).sum(dim=(1, 2))


def candidate_scores(s: torch.Tensor, sink: int, window: int, kernel: int, how: str) -> torch.Tensor:
    """One layer's scores s [n] ready for selection: the candidates (past the `sink` oldest, before the `window`
    newest) max-pooled over `kernel` neighbouring candidates, then normalised (normalize_scores) among
    themselves. Protected entries keep their raw score (selection never compares them)."""
    n = s.numel()
    lo, hi = min(sink, n), max(n - window, min(sink, n))
    out = s.clone()
    cand = pool1d(s[None, None, lo:hi], kernel, "max")[0, 0] if hi > lo else s[lo:hi]
    out[lo:hi] = normalize_scores(cand, how)
    return out


def layer_select(scores: list[torch.Tensor], per_layer: int, sink: int, window: int) -> list[torch.Tensor] | None:
    """Uniform allocation: every layer keeps its first `sink`, last `window` and best other entries, `per_layer`
    in all (ties: older token). Returns kept indices per layer (ascending), or None when every entry fits."""
    if all(s.numel() <= per_layer for s in scores):
        return None
    keeps = []
    for s in scores:
        keep = model_wide_select([s], per_layer, sink, window, 0)  # one layer: the global top-k is the layer's
        keeps.append(torch.arange(s.numel(), device=s.device) if keep is None else keep[0])
    return keeps


def normalize_scores(s: torch.Tensor, how: str) -> torch.Tensor:
    """Per-layer normalisation of candidate scores s [m] so that layers compare: zscore, sum or none."""
    if how == "none" or s.numel() == 0:
        return s
    if how == "sum":
        return s / s.sum().clamp_min(torch.finfo(s.dtype).tiny)
    if how == "zscore":
        return (s - s.mean()) / (s.std(unbiased=False) + 1e-12)
    raise ValueError(f"unknown normalisation {how!r}")


def model_wide_select(scores: list[torch.Tensor], total: int, sink: int, window: int,
                      floor: int) -> list[torch.Tensor] | None:
    """One top-k over every layer. scores[l] [n_l] (only candidates' values matter). Each layer keeps its first
    `sink` and last `window` entries and at least `floor` entries in all (its best candidates); the rest of
    `total` goes to the best candidates of any layer (ties: lower layer, then older token). Returns kept
    indices [K_l] per layer (ascending), or None when every entry fits. Raises SkipKVError when `total`
    cannot cover the protected entries and floors."""
    lens = [int(s.numel()) for s in scores]
    if sum(lens) <= total:
        return None
    kept: list[list[int]] = []
    pool_s, pool_l, pool_i = [], [], []
    for l, s in enumerate(scores):
        n = lens[l]
        cand = torch.arange(min(sink, n), max(n - window, min(sink, n)), device=s.device)
        prot = n - cand.numel()
        order = cand[torch.sort(s[cand], descending=True, stable=True).indices]
        extra = min(max(floor - prot, 0), order.numel())
        kept.append(list(range(min(sink, n))) + order[:extra].tolist() + list(range(max(n - window, min(sink, n)), n)))
        rest = order[extra:]
        pool_s.append(s[rest].float() if s.dtype != torch.float64 else s[rest])
        pool_l.append(torch.full_like(rest, l))
        pool_i.append(rest)
    need = sum(len(k) for k in kept)
    if need > total:
        raise SkipKVError(f"the budget ({total} entries over {len(scores)} layers) is smaller than the protected "
                          f"tokens and per-layer floors ({need}); raise the budget or lower prefill_window/sink/"
                          "min_layer_tokens")
    ps, pl, pi = torch.cat(pool_s), torch.cat(pool_l), torch.cat(pool_i)
    # Lexicographic (score desc, layer asc, index asc): sort by the tie-breakers first, then stably by score.
    o = torch.sort(pi, stable=True).indices
    o = o[torch.sort(pl[o], stable=True).indices]
    o = o[torch.sort(ps[o], descending=True, stable=True).indices][: total - need]
    for l, i in zip(pl[o].tolist(), pi[o].tolist()):
        kept[l].append(i)
    return [torch.tensor(sorted(k), dtype=torch.long, device=scores[0].device) for k in kept]


@dataclass(frozen=True)
class _PromptState:
    prompt_len: int


@POLICIES.register("laprox")
@dataclass(frozen=True)
class LaProx(Policy):
    paper = "LaProx (arXiv 2605.07234)"
    keeps = ("per layer, each token's norm of attention × value × `o_proj` over the window (heads summed first), "
             "normalised per layer, then one top-k over all layers (`budget` × layers, or `--budget-ratio` of "
             "the prompt); prefill only. Ablation knobs (defaults = the seed's method): `--scoring output|attention`, "
             "`--allocation model|layer`, `--kernel 1|7` (7 = a LaProx–SnapKV hybrid), `--granularity layer|head` "
             "(head: one top-k over every (layer, kv head), heads keep different counts)")
    contract_knobs = {"prefill_window": 8}

    budget_ratio: float | None = knob(None, "model-wide budget as a fraction of the prompt (per layer on "
                                      "average); overrides budget", gt=0.0, le=1.0, kind=float)
    prefill_window: int = knob(32, "prompt queries that score the prompt (the newest, kept in every layer)", gt=0)
    norm: str = knob("sum", "norm of the window-summed output (sum) or per-query exact (frobenius)", choices=NORMS)
    normalize: str = knob("zscore", "per-layer normalisation before the model-wide top-k", choices=NORMALIZATIONS)
    min_layer_tokens: int = knob(0, "entries every layer keeps at least (protected ones included)", ge=0)
    kernel: int = knob(1, "max-pool width over each layer's candidate scores (1 = off, the seed; 7 = the "
                       "LaProx-SnapKV hybrid)", gt=0, odd=True)
    scoring: str = knob("output", "token score: output (attention x value x o_proj, the seed) or attention "
                        "(window attention only; ablation)", choices=SCORINGS)
    allocation: str = knob("model", "budget split: model (one model-wide top-k, the seed) or layer (the same "
                           "share in every layer; ablation)", choices=ALLOCATIONS)
    granularity: str = knob("layer", "selection unit: layer (every kv head of a layer keeps the same tokens) or "
                            "head (one top-k over every (layer, kv head), heads keep different counts)",
                            choices=GRANULARITIES)
    phase: str = knob("prefill", "when compression runs (LaProx compresses the prompt)", choices=("prefill",))

    needs: ClassVar[frozenset[str]] = frozenset({"queries"})
    model_wide: ClassVar[bool] = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.budget_ratio is None:
            self._check_layer_budget(self.budget, "budget")

    def _check_layer_budget(self, per_layer: int, what: str) -> None:
        need = max(self.prefill_window + self.sink, self.min_layer_tokens)
        if per_layer < need:
            raise SkipKVError(f"laprox {what} leaves {per_layer} entries per layer, fewer than the protected "
                              f"prefill_window + sink ({self.prefill_window} + {self.sink}) or min_layer_tokens "
                              f"({self.min_layer_tokens})")

    @property
    def query_window(self) -> int:
        return self.prefill_window

    def layer_budget(self, prompt_len: int) -> int:
        """Entries per layer on average: the model keeps this times the number of layers."""
        if self.budget_ratio is None:
            return self.budget
        return max(1, round(self.budget_ratio * prompt_len))

    def init_state(self, prompt_ids: list[int], tokenizer) -> _PromptState:
        # The ratio refers to the whole prompt, also between prefill chunks; checked here, before any forward.
        n = len(prompt_ids)
        if self.budget_ratio is not None:
            if n < self.prefill_window:
                raise SkipKVError(f"laprox prefill_window ({self.prefill_window}) is larger than the prompt "
                                  f"({n} tokens)")
            self._check_layer_budget(self.layer_budget(n), f"budget ratio {self.budget_ratio} of a {n}-token prompt")
        return _PromptState(n)

    def request_budget(self, prompt_len: int) -> int:
        return self.layer_budget(prompt_len)

    def for_request(self, prompt_len: int, budget: int | None) -> LaProx:
        # A request's own budget is a token count per layer: it replaces the ratio for this request.
        policy = super().for_request(prompt_len, budget)
        assert isinstance(policy, LaProx)
        return replace(policy, budget_ratio=None) if budget is not None else policy

    def prefill_keep(self, num_layers: int, prompt_len: int, prefix_len: int) -> list[int]:
        # Every layer keeps at least min(its entries, protected + floor) and every layer holds at least
        # min(prefix, that) (induction over chunks), so one layer keeps at most the model-wide total less
        # the other layers' minimum. Also bounds a layer the selection leaves whole (all entries fit).
        if self.allocation == "layer":  # every layer keeps its share (layers stay equal while they fit)
            return [self.layer_budget(prompt_len)] * num_layers
        floor = min(prefix_len, max(self.prefill_window + self.sink, self.min_layer_tokens))
        return [self.layer_budget(prompt_len) * num_layers - (num_layers - 1) * floor] * num_layers

    @property
    def head_split(self) -> bool:
        return self.granularity == "head"

    # At granularity head every (layer, kv head) is one unit of the selection, so the per-layer bounds hold per unit.
    def head_capacity(self, num_layers: int, num_kv_heads: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        return self.layer_capacity(num_layers * num_kv_heads, prompt_len, max_new_tokens)

    def head_prefill_keep(self, num_layers: int, num_kv_heads: int, prompt_len: int, prefix_len: int) -> list[int]:
        return self.prefill_keep(num_layers * num_kv_heads, prompt_len, prefix_len)

    def layer_capacity(self, num_layers: int, prompt_len: int, max_new_tokens: int) -> list[int]:
        # A layer may keep up to its whole prompt; the runner sizes each layer by what it kept.
        return [min(prompt_len, self.prefill_keep(num_layers, prompt_len, prompt_len)[0]) + max_new_tokens] * num_layers

    def should_compress(self, length: int, is_prefill: bool, state: object | None = None) -> bool:
        if not is_prefill:
            return False
        # With a ratio the budget depends on the prompt, so every prefill (chunk) asks; the selection
        # returns None (nothing evicted, not counted) when all entries fit.
        return self.budget_ratio is not None or length > self.budget

    def layer_scores(self, obs: Observation) -> torch.Tensor:
        """Raw scores [b, n] of one layer, or of one kv head with its query heads (head-split observations);
        `scoring`: output-aware, or attention only."""
        assert obs.queries is not None
        w = min(obs.queries.shape[2], obs.keys.shape[2])
        scale = getattr(obs.module, "scaling", None)
        if self.scoring == "attention":
            return attention_scores(obs.queries[:, :, -w:], obs.keys, scale)
        o_weight = obs.module.o_proj.weight  # [E, Hq*D]
        if obs.kv_head is not None:  # the o_proj columns of this kv head's query heads (h = kv_head * G + g)
            G, D = obs.queries.shape[1], obs.queries.shape[3]
            o_weight = o_weight[:, obs.kv_head * G * D:(obs.kv_head + 1) * G * D]
        return output_scores(obs.queries[:, :, -w:], obs.keys, obs.values, o_weight, self.norm, scale)

    def select_model_wide(self, obs: list[Observation]) -> list[torch.Tensor] | None:
        state = obs[0].states[0] if obs[0].states else None
        prompt_len = state.prompt_len if isinstance(state, _PromptState) else max(o.keys.shape[2] for o in obs)
        total = self.layer_budget(prompt_len) * len(obs)
        if sum(o.keys.shape[2] for o in obs) <= total:
            return None
        scores = [candidate_scores(self.layer_scores(o)[0], self.sink, self.prefill_window, self.kernel,
                                   self.normalize) for o in obs]
        if self.allocation == "layer":
            keeps = layer_select(scores, self.layer_budget(prompt_len), self.sink, self.prefill_window)
        else:
            keeps = model_wide_select(scores, total, self.sink, self.prefill_window, self.min_layer_tokens)
        if keeps is None:
            return None
        H = obs[0].keys.shape[1]
        return [k[None, None, :].expand(1, H, -1).contiguous() for k in keeps]
