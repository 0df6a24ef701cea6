"""An independent reference decoder for KV-cache policies, used by tests/test_reference_decoder.py.

It shares no code with skipkv's engine, store or scoring: one request at a time, plain transformers with a
`DynamicCache` that keeps every entry (so a cache index is a true position), a per-layer boolean mask
[H, N] of evicted entries, and eager attention (fp64, keys repeated per query head) with that mask. The
scores are rewritten from the reference repos' formulas (research notes §2 R-KV, §5 baselines; SnapKV's own
code for `variant="paper"`; H2O's accumulated attention with the paper's recent/heavy split). Two policies
leave the kv heads of a layer at different counts: `adakv` (SnapKV's scores, one top-k per layer over its
heads, a per-head floor) and `given` (the kept positions spec["kept"][l][h] handed in, to check the engine's
head-ragged attention for any selection); their events carry kept positions as [L][H] lists.

    from refdecoder import ref_generate
    tokens, events = ref_generate(bundle, prompt_ids, max_new_tokens=40, spec=dict(name="rkv", budget=24, ...))
"""

from __future__ import annotations

import math

import torch
from transformers import AttentionInterface, DynamicCache

REF_BACKEND = "skipkv_reference_eager"
NO_MASKS = {"full_attention": None, "sliding_attention": None}  # our attention builds its own mask


class RefState:
    """Everything the reference keeps: queries, accumulated attention and evictions, per layer."""

    def __init__(self, L: int, Hq: int, H: int, D: int, N: int) -> None:
        self.q = torch.zeros(L, Hq, N, D, dtype=torch.float64)  # every post-RoPE query, by position
        self.k: list[torch.Tensor | None] = [None] * L  # [H, n, D] keys as cached (post-RoPE)
        self.attn = torch.zeros(L, H, N, dtype=torch.float64)  # attention each entry received, summed
        self.evicted = torch.zeros(L, H, N, dtype=torch.bool)
        self.G = Hq // H


def ref_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention of one request (batch 1) with per-kv-head evictions. query [1, Hq, T, D], key [1, H, K, D]."""
    st: RefState = kwargs["ref_state"]
    layer = module.layer_idx
    _, Hq, T, D = query.shape
    K = key.shape[2]
    G = st.G
    first = K - T  # the cache keeps everything, so the T new tokens sit at positions K-T..K-1
    st.q[layer, :, first:K] = query[0].double()
    st.k[layer] = key[0]
    k = key[0].double().repeat_interleave(G, dim=0)  # [Hq, K, D]: query head h uses kv head h // G
    v = value[0].double().repeat_interleave(G, dim=0)
    scale = scaling if scaling is not None else 1 / math.sqrt(D)
    logits = query[0].double() @ k.transpose(1, 2) * scale  # [Hq, T, K]
    causal = torch.arange(K)[None, :] <= (first + torch.arange(T))[:, None]  # [T, K]
    alive = ~st.evicted[layer, :, :K].repeat_interleave(G, dim=0)  # [Hq, K]
    visible = causal[None] & alive[:, None, :]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    st.attn[layer, :, :K] += probs.view(-1, G, T, K).sum(dim=(1, 2))
    out = (probs @ v).to(value.dtype)  # [Hq, T, D]
    return out.transpose(0, 1)[None].contiguous(), None


AttentionInterface.register(REF_BACKEND, ref_attention)


# --------------------------------------------------------------------------------------------- scores
def _logits(st: RefState, layer: int, h: int, qpos: list[int], kpos: list[int], reduce: str) -> list[list[float]]:
    """logits[i][j] = reduce over the group's query heads of q_i . k_j / sqrt(D)."""
    keys = st.k[layer][h].double()[kpos]  # [n, D]
    D = keys.shape[-1]
    per_head = [st.q[layer, h * st.G + g][qpos] @ keys.T / math.sqrt(D) for g in range(st.G)]  # G x [w, n]
    stacked = torch.stack(per_head)
    return (stacked.max(dim=0).values if reduce == "max" else stacked.mean(dim=0)).tolist()


def _softmax(row: list[float]) -> list[float]:
    m = max(row)
    e = [math.exp(x - m) for x in row]
    s = sum(e)
    return [x / s for x in e]


def _pool(x: list[float], kernel: int, how: str, count_pad: bool = False) -> list[float]:
    r = kernel // 2
    out = []
    for j in range(len(x)):
        win = x[max(0, j - r): j + r + 1]
        if how == "max":
            out.append(max(win))
        else:
            out.append(sum(win) / (kernel if count_pad else len(win)))
    return out


def _redundancy(keys: torch.Tensor, thr: float) -> list[float]:
    """R-KV cal_similarity for one head: keys [n, D] -> [n]."""
    n = keys.shape[0]
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    S = (unit @ unit.T).tolist()
    for i in range(n):
        S[i][i] = 0.0
        last = 0
        for j in range(n):
            if S[i][j] > thr:
                last = j
        S[i][last] = 0.0
    return _softmax([sum(S[i][j] for i in range(n)) / n for j in range(n)])


def kept_window(spec: dict, is_prefill: bool) -> int:
    if spec["name"] == "snapkv" and is_prefill:
        return spec["prefill_window"]
    if spec["name"] == "h2o":
        return max(spec["window"], int(spec.get("recent_ratio", 0.0) * spec["budget"]))
    return spec["window"]


def ref_scores(spec: dict, st: RefState, layer: int, h: int, kept: list[int], processed: int,
               is_prefill: bool) -> list[float]:
    """Scores of the candidates kept[sink : n - window] (higher is kept)."""
    name, w, sink = spec["name"], kept_window(spec, is_prefill), spec.get("sink", 0)
    n = len(kept)
    cand = kept[:n - w]
    if name == "streaming_llm":
        return [float(p) for p in cand[sink:]]
    if name == "h2o" and spec.get("variant", "accumulated") == "accumulated":
        return [float(st.attn[layer, h, p]) for p in cand[sink:]]
    if name == "h2o":  # the repos' variant: the newest query's softmax over every kept key
        probs = _softmax(_logits(st, layer, h, [processed - 1], kept, "max")[0])
        return probs[sink:n - w]
    queries = list(range(processed - w, processed))
    reduce = spec.get("group_reduce", "max")
    if name == "snapkv" and spec.get("variant") == "paper":
        # SnapKV's code: the window queries see every key, the window keys causally; sum, avg-pool with
        # count_include_pad, drop the window.
        logits = _logits(st, layer, h, queries, kept, reduce)
        imp = [0.0] * (n - w)
        for i, row in enumerate(logits):
            row = [x if j < n - w or kept[j] <= queries[i] else float("-inf") for j, x in enumerate(row)]
            probs = _softmax(row)
            for j in range(n - w):
                imp[j] += probs[j] / w
        pooling = spec.get("pooling", "auto")
        imp = _pool(imp, spec["kernel"], "avg" if pooling == "auto" else pooling, count_pad=True)
        return imp[sink:]
    logits = _logits(st, layer, h, queries, cand, reduce)
    imp = [0.0] * len(cand)
    for row in logits:
        for j, p in enumerate(_softmax(row)):
            imp[j] += p / w
    if name == "snapkv":
        pooling = spec.get("pooling", "auto")
        return _pool(imp, spec["kernel"], "max" if pooling == "auto" else pooling)[sink:]
    assert name == "rkv", name
    imp = _pool(imp, spec["kernel"], "max")
    red = _redundancy(st.k[layer][h, kept].double(), spec["threshold"])
    lam = spec["mix_lambda"]
    return [lam * imp[j] - (1 - lam) * red[j] for j in range(len(cand))][sink:]


def ref_adakv(spec: dict, st: RefState, processed: int) -> list[list[list[int]]]:
    """Ada-KV: per layer, SnapKV's scores per head, each head keeps its sink, window and `floor` best candidates,
    the rest of budget x H goes to the best candidates of any head (ties: lower head, older token). A layer
    whose entries all fit keeps them. Returns the kept positions [L][H] (ascending)."""
    L, H = st.evicted.shape[:2]
    budget, sink, w = spec["budget"], spec.get("sink", 0), spec["prefill_window"]
    floor = w + sink + int(spec["floor_ratio"] * (budget - w - sink))
    snap = dict(spec, name="snapkv")
    out = []
    for layer in range(L):
        kept = [[p for p in range(processed) if not st.evicted[layer, h, p]] for h in range(H)]
        if sum(len(k) for k in kept) <= budget * H:
            out.append(kept)
            continue
        chosen, rest = [], []
        for h in range(H):
            n = len(kept[h])
            scores = ref_scores(snap, st, layer, h, kept[h], processed, True)
            middle = kept[h][sink:n - w]
            ranked = sorted(range(len(middle)), key=lambda j: (-scores[j], j))
            extra = max(floor - (n - len(middle)), 0)
            chosen.append(set(kept[h][:sink]) | set(kept[h][n - w:]) | {middle[j] for j in ranked[:extra]})
            rest += [(-scores[j], h, j, middle[j]) for j in ranked[extra:]]
        for _, h, _, p in sorted(rest)[: budget * H - sum(len(c) for c in chosen)]:
            chosen[h].add(p)
        out.append([sorted(c) for c in chosen])
    return out


def ref_compress(spec: dict, st: RefState, processed: int, is_prefill: bool):
    """Evict down to the budget in every layer and head; returns the kept positions [L, H, budget] (as [L][H]
    lists for the head-ragged policies, `adakv` and `given`)."""
    L, H = st.evicted.shape[:2]
    if spec["name"] in ("adakv", "given"):
        kept = ref_adakv(spec, st, processed) if spec["name"] == "adakv" else spec["kept"]
        for layer in range(L):
            for h in range(H):
                keep = set(kept[layer][h])
                for p in range(processed):
                    st.evicted[layer, h, p] |= p not in keep
        return kept
    budget, sink, w = spec["budget"], spec.get("sink", 0), kept_window(spec, is_prefill)
    out = torch.zeros(L, H, budget, dtype=torch.long)
    for layer in range(L):
        for h in range(H):
            kept = [p for p in range(processed) if not st.evicted[layer, h, p]]
            n = len(kept)
            scores = ref_scores(spec, st, layer, h, kept, processed, is_prefill)
            middle = kept[sink:n - w]
            assert len(scores) == len(middle)
            # Highest score first; ties go to the older token.
            ranked = sorted(range(len(middle)), key=lambda j: (-scores[j], j))[:budget - sink - w]
            keep = set(kept[:sink]) | set(kept[n - w:]) | {middle[j] for j in ranked}
            for p in kept:
                if p not in keep:
                    st.evicted[layer, h, p] = True
            out[layer, h] = torch.tensor(sorted(keep))
    return out


# --------------------------------------------------------------------------------------------- decoding
def ref_generate(bundle, prompt_ids: list[int], max_new_tokens: int, spec: dict, prefill_chunk: int = 0):
    """Greedy decode one request. Returns (tokens, events, state) with events = [(processed, is_prefill,
    kept [L, H, budget], attention received by the kept entries so far [L, H, budget])].

    spec: {"name", "budget", "window", "sink", "interval", "phase", + the policy's own knobs}.
    """
    model = bundle.model
    cfg = model.config
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    P = len(prompt_ids)
    st = RefState(cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads, D, P + max_new_tokens)
    cache = DynamicCache(config=cfg)
    phase, budget, interval = spec.get("phase", "both"), spec["budget"], spec["interval"]
    events = []
    tokens: list[int] = []

    def forward(ids: list[int], start: int) -> torch.Tensor:
        pos = torch.arange(start, start + len(ids))[None]
        out = model.model(input_ids=torch.tensor([ids]), position_ids=pos, attention_mask=NO_MASKS, cache=cache,
                          use_cache=True, ref_state=st)
        return model.lm_head(out.last_hidden_state[0, -1])

    def held(processed: int) -> int:  # the most any (layer, kv head) holds
        return int((~st.evicted[..., :processed]).sum(dim=-1).max())

    previous = cfg._attn_implementation
    model.set_attn_implementation(REF_BACKEND)
    try:
        with torch.inference_mode():
            chunk = prefill_chunk if 0 < prefill_chunk < P else P
            for c0 in range(0, P, chunk):
                c1 = min(c0 + chunk, P)
                logits = forward(prompt_ids[c0:c1], c0)
                if phase in ("prefill", "both") and held(c1) > budget:
                    kept = ref_compress(spec, st, c1, True)
                    ragged = not isinstance(kept, torch.Tensor)
                    events.append((c1, True, kept, None if ragged else st.attn.gather(2, kept).clone()))
            tokens.append(int(logits.argmax()))
            while len(tokens) < max_new_tokens:
                processed = P + len(tokens)
                logits = forward([tokens[-1]], processed - 1)
                if phase in ("decode", "both") and held(processed) >= budget + interval:
                    kept = ref_compress(spec, st, processed, False)
                    events.append((processed, False, kept, st.attn.gather(2, kept).clone()))
                tokens.append(int(logits.argmax()))
    finally:
        model.set_attn_implementation(previous)
    return tokens, events, st
