"""Decoder MLPs that run a right-padded prefill on its real positions only.

A prefill forward takes its rows right-padded to the longest prompt of the group ([B, T]), and the MLP's three
linears are most of its arithmetic (88% of a Qwen2.5-0.5B layer's linear multiply-adds). Sixteen GSM8K prompts of 78-163
tokens fill 2,608 positions with 1,920 tokens: a third more MLP work than the tokens need. The MLP is
position-wise (its output at a position depends on that position's input alone), so inside
`real_positions(index)` every installed MLP gathers the real positions into one [1, N, E] block, runs on it, and
scatters the result back; pad positions get zeros. Nothing else changes: attention, norms and the q/k/v/o linears
still see every position. A pad position's output is never read: rows are right-padded, so no real query attends
to one (causal attention), and its cache entries lie past its row's length.

A matmul over N rows may sum a row in another order than one over B x T rows (MKL and oneDNN pick kernels by
shape), as a different batch does: in fp64 the results agree to ~1e-16 and the tokens are the same
(tests/test_unpad.py); in 16-bit dtypes a row can round differently, so EngineConfig.unpad_prefill is part of a
16-bit eval run's identity.

    ModelPatches(model).unpad_mlps()     # models/patches.py: wraps each layer's `mlp.forward` until close()
    with real_positions(index): ...      # index: flat positions (b * T + t) of the real tokens
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar
from typing import Any

import torch

_REAL: ContextVar[torch.Tensor | None] = ContextVar("skipkv_real_positions", default=None)


@contextlib.contextmanager
def real_positions(index: torch.Tensor | None) -> Iterator[None]:
    """Within the block, installed MLPs given a [B, T, E] input run on the flat positions `index` ([N], long,
    on the model's device) only; None: every position (the default)."""
    token = _REAL.set(index)
    try:
        yield
    finally:
        _REAL.reset(token)


def padding_index(real: torch.Tensor, T: int) -> torch.Tensor | None:
    """The flat positions of the real tokens of right-padded rows holding `real` [B] (host) tokens each of T, or
    None when no row is padded (nothing to skip)."""
    if T <= 1 or bool((real >= T).all()):
        return None
    keep = torch.arange(T)[None, :] < real[:, None]
    return keep.flatten().nonzero().squeeze(1)


def unpadded_forward(self: torch.nn.Module, x: torch.Tensor) -> Any:
    """An installed MLP's forward (bound to the module): its class's own forward, on the real positions only
    inside `real_positions`. Bound with types.MethodType, so a deep copy of the model binds it to the copy."""
    forward = type(self).forward
    index = _REAL.get()
    if index is None or x.dim() != 3:
        return forward(self, x)
    B, T, E = x.shape
    flat = x.reshape(B * T, E)
    y = forward(self, flat.index_select(0, index)[None])[0]  # [N, E_out]
    out = y.new_zeros(B * T, y.shape[-1])
    out.index_copy_(0, index, y)
    return out.view(B, T, -1)
