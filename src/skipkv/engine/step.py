"""The fixed-shape decode step: one token for each of rows [0, B) of a uniform slot store, as one function of
tensors, so that it can run eagerly (checked against the HF-module step) or compiled with
`torch.compile(fullgraph=True)`.

    SKIPKV_DECODE_STEP=compiled skipkv generate --model random:qwen2:0.5b --batch-size 16 --prompts FILE.jsonl

What makes it fixed: the rows' lengths go in as a tensor [L, B] (a copy of the store's host lengths), the new
entry of every row and layer is written by index at that length, attention reads the first `extent` entries of
each layer with the mask built inside the step from the lengths, and policies' decode-time observations are index
writes into their own buffers (the query ring of `QueryBuffer`, H2O's accumulators). Steering is an add of
`scale[b] * vector` at one layer's input. Compression, prefill, sampling and the hidden-state observation run
outside, between steps, and rewrite the same store tensors in place; nothing here keeps state between calls.

The arithmetic is the HF module's, op for op (RMSNorm in fp32, rotary as `apply_rotary_pos_emb`, q.k and the
softmax in fp32, p.V through `attention._probs_times_values`; compiled, one matmul in the same dtypes), and the
linears are the model's own modules (packed, transposed or dense; a packed layer's fused q/k/v and gate/up products,
models/packed.py, called directly). A layer's extent is its longest row's entries plus
the new one, as in the HF step, so on a CPU whose decode attention is the grouped one the two give the same bits
(tests/test_fixed_step.py checks tokens and every cache entry after every step). With `bucket_keys` the extent is
rounded up to `kernels.key_bucket` (a few shapes, for a captured graph); a batched fp32 softmax over another
extent sums in another order (~1e-8).

Where it applies (`FixedStep.supports`): a uniform store (not head-split: a head-split store's kv heads hold
different counts and stay on the HF step) whose layers share one capacity (LaProx and PyramidKV leave layers at
different lengths and capacities: HF step), Qwen2, Qwen3 and Llama decoder layers. Compiled, one decoder layer is
the graph (all layers share it; weights are its inputs), with the batch and the key extent as dynamic dimensions:
one graph for B >= 2 and one for B = 1 (torch specialises size 1), so a batch that shrinks as requests finish, or a
cache that grows, does not recompile (tests/test_fixed_step.py, marked slow: ~30 s of compiling).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from skipkv import attention
from skipkv.cache.store import to_device
from skipkv.kernels import key_bucket
from skipkv.plan import KernelPlan


def _rms(module: Any, x: torch.Tensor) -> torch.Tensor:
    """transformers' Qwen2/Llama/Qwen3 RMSNorm, op for op."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * xf.to(x.dtype)


def _keep_pad(real: torch.Tensor | None, new: torch.Tensor | float, old: torch.Tensor) -> torch.Tensor | float:
    """What a row-indexed write stores: `new`, except in padding rows (`real` False), which store `old`, the value
    already there, so a padding row writes nothing real (engine/graphs.py). `real` None: every row is real."""
    if real is None:
        return new
    return torch.where(real.view(-1, *[1] * (old.dim() - 1)), new, old)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class FixedStep:
    """The decode step over a uniform store (module docstring). Call `supports` first; `compiled` wraps it."""

    def __init__(self, model: Any, plan: KernelPlan, compile: bool = False,
                 bucket_keys: bool = False) -> None:
        """`plan`: the model's kernel plan (plan.py); its `pv` says whether a 16-bit p.V takes the probabilities
        rounded to the model's dtype ("model") or the values converted to fp32. `compile`: run through
        torch.compile(fullgraph=True).
        `bucket_keys`: attend over `kernels.key_bucket` of the longest row's keys (a few extents, for a captured
        graph) instead of exactly its keys (the same extent as the HF step, hence its bits on a CPU)."""
        self.model: Any = model  # a transformers causal LM of a supported family
        cfg = model.config
        self.num_heads: int = int(cfg.num_attention_heads)
        self.num_kv_heads: int = int(cfg.num_key_value_heads)
        self.head_dim: int = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
        self.plan = plan
        self.pv_fp32 = plan.pv_fp32  # a plain bool for the compiled graph to guard on
        self.bucket_keys = bucket_keys
        self.compiled = compile
        self._layer_fn: Callable[..., torch.Tensor] = self._layer
        if compile:
            self._layer_fn = torch.compile(self._layer, fullgraph=True, dynamic=True)

    @staticmethod
    def supports(model: Any, store: Any) -> tuple[bool, str]:
        """Whether this step can run over `store` now; the reason when not."""
        if store.head_split:
            return False, "head-split store"
        if len(set(store.capacities)) != 1:
            return False, "layers of different capacities"
        if model.config.model_type not in ("qwen2", "qwen3", "llama"):
            return False, f"model type {model.config.model_type}"
        return True, "uniform store"

    def __call__(self, store: Any, tokens: torch.Tensor, positions: torch.Tensor,
                 queries: Any = None, accumulate: bool = False,
                 steer: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Decode one token for rows [0, B): tokens, positions [B] (device, long). Writes every layer's new entry
        into the store (lengths are advanced by the caller, `KVStore.advance`). `queries`: the QueryBuffer to
        record this step's queries in; `accumulate`: add the attention each entry receives into store.aux["attn"];
        `steer`: (layer, vector [E], scale [B]) added at that layer's input. Returns the final hidden [B, E]."""
        B = tokens.shape[0]
        extents, attn, zero_aux = self.layout(store, B, accumulate)
        lengths = to_device(store.lengths[:, :B], tokens.device)  # no host sync on CUDA (pinned); on a CPU the same
        q_ring = q_pos = None
        if queries is not None:
            q_ring, q_pos = queries.q, queries.qpos
        args = (tokens, positions, lengths, extents, store.k, store.v, store.pos, attn, zero_aux, q_ring, q_pos, steer)
        if not self.compiled:
            return self._step(*args)
        # No duck shaping: a batch that happens to equal a model dimension (the kv heads) when the graph is traced
        # must not become a guard that the next batch size fails.
        with torch.fx.experimental._config.patch(use_duck_shape=False):  # type: ignore[attr-defined]
            return self._step(*args)

    def layout(self, store: Any, B: int, accumulate: bool) -> tuple[list[int], list | None, list]:
        """For rows [0, B): each layer's key extent (as the HF step reads it: the longest row's entries plus the
        new one; layers may hold different counts, e.g. PyramidKV's, in a store of one capacity; `bucket_keys`
        rounds it up), H2O's accumulators (when `accumulate`) and the other aux buffers the step zeroes."""
        extents = [int(n) + 1 for n in store.lengths[:, :B].amax(dim=1).tolist()]
        if max(extents) > store.capacities[0]:  # as KVStore.append: never an index past the slot
            raise RuntimeError(f"KV slot overflow: need {max(extents)} entries, capacity {store.capacities[0]}")
        if self.bucket_keys:
            extents = [min(store.capacities[0], key_bucket(e)) for e in extents]
        attn = store.aux["attn"] if accumulate else None
        zero_aux = [store.aux[n] for n in store.aux_names if not (accumulate and n == "attn")]
        return extents, attn, zero_aux

    def _step(self, tokens, positions, lengths, extents: list[int], k_store: list, v_store: list, pos_store: list,
              attn: list | None, zero_aux: list, q_ring: torch.Tensor | None, q_pos: Any,
              steer: tuple | None, real: torch.Tensor | None = None) -> torch.Tensor:
        """The step of rows [0, B) (B = tokens' length). `real` [B] bool (engine/graphs.py): rows that are False are
        padding, whose writes store what is already there and whose attention adds nothing to H2O's sums."""
        inner = self.model.model
        B = tokens.shape[0]
        x = inner.embed_tokens(tokens[:, None])  # [B, 1, E]
        cos, sin = inner.rotary_emb(x, positions[:, None])  # [B, 1, D]
        cos, sin = cos[:, None], sin[:, None]  # [B, 1, 1, D] against [B, heads, 1, D]
        rows = torch.arange(B, device=tokens.device)
        pos32 = positions.to(torch.int32)[:, None].expand(B, self.num_kv_heads)
        ring = None
        if q_ring is not None:
            ring = positions % q_ring.shape[3]
            q_pos[rows, ring] = _keep_pad(real, positions, q_pos[rows, ring])
        for l, layer in enumerate(inner.layers):
            if steer is not None and steer[0] == l:
                x = x + steer[2][:, None, None] * steer[1]
            x = self._layer_fn(layer, x, cos, sin, rows, lengths[l], extents[l], pos32, k_store[l], v_store[l],
                               pos_store[l], None if attn is None else attn[l], [a[l] for a in zero_aux],
                               None if q_ring is None else q_ring[l], ring, real)
        return _rms(inner.norm, x)[:, 0]

    def _layer(self, layer: Any, x, cos, sin, rows, at_len, extent: int, pos32, k_store, v_store, pos_store, attn,
               zero_aux: list, q_ring, ring, real=None) -> torch.Tensor:
        """One decoder layer for one new token per row. at_len [B]: entries before it; `extent`: keys read."""
        B = x.shape[0]
        Hq, H, D = self.num_heads, self.num_kv_heads, self.head_dim
        G = Hq // H
        at = layer.self_attn
        h = _rms(layer.input_layernorm, x)
        fused = getattr(at, "qkv_proj", None)  # models/packed.py: one product for q, k and v where packed
        if fused is not None:
            q, k, v = fused(h).split(fused.splits, dim=-1)
        else:
            q, k, v = at.q_proj(h), at.k_proj(h), at.v_proj(h)
        q = q.view(B, 1, Hq, D)
        k = k.view(B, 1, H, D)
        v = v.view(B, 1, H, D).transpose(1, 2)
        if hasattr(at, "q_norm"):  # Qwen3: per-head norms before the rotary
            q, k = at.q_norm(q), at.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        k_store[rows, :, at_len] = _keep_pad(real, k[:, :, 0], k_store[rows, :, at_len])
        v_store[rows, :, at_len] = _keep_pad(real, v[:, :, 0], v_store[rows, :, at_len])
        pos_store[rows, :, at_len] = _keep_pad(real, pos32, pos_store[rows, :, at_len])
        for aux in zero_aux:
            aux[rows, :, at_len] = _keep_pad(real, 0.0, aux[rows, :, at_len])
        if attn is not None:
            attn[rows, :, at_len] = _keep_pad(real, 0.0, attn[rows, :, at_len])
        if q_ring is not None:
            q_ring[rows, :, ring] = _keep_pad(real, q[:, :, 0], q_ring[rows, :, ring])
        kc = k_store[:B, :, :extent]  # [B, H, K, D]
        vc = v_store[:B, :, :extent]
        acc = torch.promote_types(q.dtype, torch.float32)  # as attention._grouped_attention
        logits = torch.matmul(q.reshape(B, H, G, D).to(acc), kc.to(acc).transpose(-1, -2)) * at.scaling
        visible = torch.arange(extent, device=x.device)[None, :] <= at_len[:, None]  # [B, K]
        logits = logits.masked_fill(~visible[:, None, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)  # [B, H, G, K]
        if attn is not None:
            received = probs.sum(dim=2)  # [B, H, K]
            attn[:B, :, :extent] += received if real is None else received * real[:, None, None]
        if not self.compiled:  # the HF step's own product (key buckets for a 16-bit p.V on a CPU included)
            o = attention._probs_times_values(probs.view(B, H, G, extent), vc, self.plan, v_store[:B])
        elif vc.dtype in (torch.float32, torch.float64) or self.pv_fp32:
            o = torch.matmul(probs, vc.to(probs.dtype)).to(vc.dtype)
        else:
            o = torch.matmul(probs.to(vc.dtype), vc)
        x = x + at.o_proj(o.reshape(B, 1, Hq * D))
        h = _rms(layer.post_attention_layernorm, x)
        mlp = layer.mlp
        fused = getattr(mlp, "gate_up_proj", None)
        gate, up = fused(h).split(fused.splits, dim=-1) if fused is not None else (mlp.gate_proj(h), mlp.up_proj(h))
        return x + mlp.down_proj(mlp.act_fn(gate) * up)
