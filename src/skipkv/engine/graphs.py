"""The fixed-shape decode step replayed: on CUDA, captured once per batch bucket and key extents as a CUDA graph
and replayed, so a step costs one launch from the host instead of hundreds (a 7B step on an H200 took 29 ms of
host time where its kernels kept the GPU busy for 6, docs/benchmarks.md "On a GPU").

    SKIPKV_DECODE_STEP=graph skipkv generate --device cuda --model random:qwen2:7b --batch-size 32 ...

What makes a step replayable (engine/step.py keeps every shape fixed; this adds the buffers):
- the rows' tokens, positions and lengths are copied into buffers that the graph reads, sized to the batch
  bucket (`batch_bucket`: a power of two, at most the store's slots), so one graph serves every batch up to it;
- the rows past the batch are padding: token 0 at position 0 over their slot's first entry, `real` False, so
  every write they make stores the value already there and they add nothing to H2O's sums
  (`step._keep_pad`): a padding row writes nothing real, whichever slot (free, or a request being prefilled) it
  covers; its output is never read;
- each layer's key extent is rounded up to `kernels.key_bucket` of its longest row (`FixedStep(bucket_keys=True)`),
  so a cache that grows by one entry a step reuses a graph for up to 64 steps (more past 1,024 keys); the
  extents, the batch bucket, whether H2O accumulates, whether queries are buffered and the steered layer key
  the graphs. Steering's vector and per-row scales are buffers too;
- compression, prefill, sampling and observation run between steps and rewrite the store's tensors in place;
  where the store or the query buffer is reallocated (their data pointers change) every graph is dropped.

Capture runs the step once on a side stream first with every row padding (a warm-up that changes nothing), then
records it; replay copies the inputs into the buffers and launches the graph. On a CPU (or with `capture=False`)
the same buffers, buckets and padding run the step directly: that is what the tests check (tokens of the eager
step, padding slots left bit for bit as they were); the capture itself awaits a GPU (benchmarks/gpu.sh measures
it against the eager step). Not the default anywhere yet (`SKIPKV_DECODE_STEP=graph`): unmeasured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from skipkv.cache.store import to_device
from skipkv.engine.step import FixedStep


def batch_bucket(rows: int, slots: int) -> int:
    """`rows` rounded up to a power of two, at most `slots` (the store's rows)."""
    return min(slots, 1 << max(0, rows - 1).bit_length())


@dataclass
class _Graph:
    """One captured (or, on a CPU, directly run) step: its input buffers, its output and how to run it."""

    tokens: torch.Tensor  # [Bb] long
    positions: torch.Tensor  # [Bb] long
    lengths: torch.Tensor  # [L, Bb] long
    real: torch.Tensor  # [Bb] bool
    scale: torch.Tensor | None  # [Bb], steering's per-row scale
    vector: torch.Tensor | None  # [E], steering's vector
    out: torch.Tensor | None = None  # [Bb, E] after a run
    graph: Any = None  # torch.cuda.CUDAGraph where captured
    run: Any = field(default=None, repr=False)


class GraphStep:
    """FixedStep over static buffers per (batch bucket, extents, ...), captured as CUDA graphs on CUDA (module
    docstring). Called as FixedStep is; returns the final hidden [B, E] of rows [0, B)."""

    def __init__(self, fixed: FixedStep, capture: bool | None = None) -> None:
        if not fixed.bucket_keys or fixed.compiled:
            raise ValueError("GraphStep replays an uncompiled FixedStep with bucket_keys=True")
        self.fixed = fixed
        self.capture = capture
        self.graphs: dict[tuple, _Graph] = {}
        self._pointers: tuple = ()
        self.pool: Any = None  # the CUDA graphs' shared memory pool

    def __call__(self, store: Any, tokens: torch.Tensor, positions: torch.Tensor, queries: Any = None,
                 accumulate: bool = False, steer: tuple[int, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, device = tokens.shape[0], tokens.device
        Bb = batch_bucket(B, store.num_slots)
        extents, attn, zero_aux = self.fixed.layout(store, B, accumulate)  # extents in key buckets
        pointers = tuple(t.data_ptr() for t in (*store.k, *store.v, *store.pos, *(attn or []),
                                                 *[a for aux in zero_aux for a in aux],
                                                 *(() if queries is None else (queries.q, queries.qpos))))
        if pointers != self._pointers:  # the store or the query buffer was reallocated: no graph reads it now
            self.graphs.clear()
            self._pointers = pointers
        key = (Bb, tuple(extents), accumulate, queries is not None, None if steer is None else steer[0])
        g = self.graphs.get(key)
        if g is None:
            g = self._build(store, Bb, extents, attn, zero_aux, queries, steer, device)
            self.graphs[key] = g
        g.tokens[:B] = tokens
        g.tokens[B:] = 0
        g.positions[:B] = positions
        g.positions[B:] = 0
        g.lengths[:, :B] = to_device(store.lengths[:, :B], device)
        g.lengths[:, B:] = 0
        g.real[:B] = True
        g.real[B:] = False
        if steer is not None:
            assert g.scale is not None and g.vector is not None
            g.scale[:B] = steer[2]
            g.scale[B:] = 0
            g.vector.copy_(steer[1])
        g.run()
        assert g.out is not None
        return g.out[:B]

    def _build(self, store: Any, Bb: int, extents: list[int], attn: list | None, zero_aux: list, queries: Any,
               steer: tuple | None, device: torch.device) -> _Graph:
        L = len(store.k)
        scale = vector = None
        if steer is not None:
            scale = torch.zeros(Bb, dtype=steer[2].dtype, device=device)
            vector = torch.zeros_like(steer[1], device=device)

        def zeros(*shape: int, dtype: torch.dtype = torch.long) -> torch.Tensor:
            return torch.zeros(*shape, dtype=dtype, device=device)

        g = _Graph(zeros(Bb), zeros(Bb), zeros(L, Bb), zeros(Bb, dtype=torch.bool), scale, vector)
        q_ring = q_pos = None
        if queries is not None:
            q_ring, q_pos = queries.q, queries.qpos
        step_steer = None if steer is None else (steer[0], vector, scale)

        def step() -> torch.Tensor:
            return self.fixed._step(g.tokens, g.positions, g.lengths, extents, store.k, store.v, store.pos, attn,
                                    zero_aux, q_ring, q_pos, step_steer, g.real)

        capture = device.type == "cuda" if self.capture is None else self.capture
        if not capture:
            def run() -> None:
                g.out = step()
            g.run = run
            return g
        # Warm-up with every row padding (g.real all False): it writes only what is already there.
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            step()
        torch.cuda.current_stream(device).wait_stream(side)
        g.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g.graph, pool=self.pool):
            g.out = step()
        self.pool = g.graph.pool()
        g.run = g.graph.replay
        return g
