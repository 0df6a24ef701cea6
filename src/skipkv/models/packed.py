"""Linear layers with their weights prepacked once for oneDNN (CPU, bf16), instead of at every call; or, on a CPU
whose oneDNN has no bf16 matmul, multiplied in fp32 on weights upcast once (UpcastLinear); or, for an fp32 model on
a CPU where MKL's sgemm is faster that way, stored transposed (TransposedLinear, kernels.transposed_linears).

    python -c "from skipkv.models import load_model; print(load_model('random:qwen2', dtype='bf16').plan.linears)"

`torch.nn.functional.linear` in bf16 on a CPU hands the weight to oneDNN, which reorders it into its blocked layout
on every call; `torch.ops.mkldnn._reorder_linear_weight` does that once, and `_linear_pointwise` multiplies with
the packed copy. The kernel is the same, so the outputs are bit-identical (tests/test_packed.py); what changes is
the time: on a 2-core EPYC (AVX512-BF16, no AMX), Qwen2.5-0.5B, full cache, 16 GSM8K prompts x 128 tokens,
2 threads, the median gap between tokens fell from 187 to 132 ms and the first token came at 6.2 instead of
7.5 s (`SKIPKV_PACKED_LINEARS=1|0 python benchmarks/vllm_anchor/skipkv_run.py`, docs/benchmarks.md). Whether it
runs is decided by `kernels.packed_linears` (CPU, bf16, oneDNN with bf16 support; `SKIPKV_PACKED_LINEARS=1|0`
overrides). With `SKIPKV_PACKED_LINEARS=1` an fp32 model is packed the same way (opt-in; oneDNN's fp32 kernel
sums in another order than MKL's, so its outputs agree to rounding, not bit for bit; docs/benchmarks.md has the
figures).

Fused projections (FusedLinear): where the linears are packed, a decoder layer's q/k/v projections become one
packed product and its gate/up projections another, as vLLM's CPU engine runs them: one call instead of three (or
two) per layer and step, each over a wider output. The HF modules keep calling `q_proj`, `k_proj`, `v_proj` (and
`gate_proj`, `up_proj`): each is now a LinearPart, a slice of its FusedLinear's output, computed once for the
input they share. On a 2-core AMD EPYC (AVX2, fp32, two threads, batch 16) a layer's q/k/v took 0.30 instead of
0.41 ms and gate/up 3.07 instead of 3.41 ms (a `/tmp` probe of packed random weights, not committed; alternating
pairs gave gate/up 1.02-1.04x at 16 and 1,920 rows, docs/benchmarks.md). In fp32 there the fused product gives
the separate ones' bits where the linears have no bias, and agrees to the last bit where they have one
(tests/test_packed.py).

Memory: the packed copy replaces the dense weight, except where the project reads the dense one (`o_proj`:
LaProx's output-aware score and the fidelity benchmark) and where it is shared (`lm_head` tied to the input
embedding): there both exist (for Qwen2.5-0.5B in bf16, 38 MB of o_proj and the 272 MB tied embedding copied
once; twice that in fp32).
"""

from __future__ import annotations

from typing import Any

import torch

from skipkv.hardware import release_free_memory

# Children whose dense weight the project reads (o_proj) or that share it (a tied lm_head): kept beside the pack.
KEEP_DENSE = frozenset({"o_proj", "lm_head"})


@torch.library.custom_op("skipkv::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [N, in] times a oneDNN-packed weight: `PackedLinear`'s product as one op that torch.compile keeps whole."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@packed_linear.register_fake
def _(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, out_features: int) -> torch.Tensor:
    return x.new_empty(x.shape[0], out_features)


# fp32 products over more rows than this run in blocks of this many rows. On a 2-core AMD EPYC (AVX2, two threads)
# a layer's gate/up and down products over 1,850 prefill rows took 315 ms in blocks of 256 or 512 rows against 340
# whole (six alternating rounds, every round faster; 1,024-row blocks: 335; a `/tmp` probe on random weights, not
# committed), the same bits (each row's sums do not depend on the other rows). bf16 products were not measured:
# they run whole.
FP32_ROW_BLOCK = 512


class PackedLinear(torch.nn.Module):
    """`torch.nn.Linear` with a oneDNN-packed weight. `weight` stays only where `keep_dense` (see KEEP_DENSE). An
    fp32 product over many rows runs in blocks of FP32_ROW_BLOCK rows."""

    def __init__(self, linear: torch.nn.Linear, keep_dense: bool, batch_hint: int = 16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias: torch.nn.Parameter | None = linear.bias
        if keep_dense:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if torch.compiler.is_compiling():
            # inductor lowers `_linear_pointwise` only for weights frozen into the graph; the opaque op below runs
            # the same kernel on the packed weight as an input (engine/step.py compiles the decode step).
            y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.bias, self.out_features)
        else:
            rows = x.reshape(-1, self.in_features)
            block = FP32_ROW_BLOCK if rows.dtype == torch.float32 else rows.shape[0]
            parts = [torch.ops.mkldnn._linear_pointwise(rows[s:s + block], self.packed, self.bias, "none", [], "")
                     for s in range(0, max(rows.shape[0], 1), block)]
            y = parts[0] if len(parts) == 1 else torch.cat(parts)
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


class FusedLinear(PackedLinear):
    """Linears that read the same input (a layer's q/k/v, or gate/up) as one oneDNN-packed product whose output is
    their outputs side by side (`splits` wide each). A missing bias is a zero one. `part` serves the LinearParts
    that stand in for the original linears (module docstring)."""

    def __init__(self, linears: list[torch.nn.Linear], batch_hint: int = 16) -> None:
        torch.nn.Module.__init__(self)
        self.in_features = linears[0].in_features
        self.splits = [lin.out_features for lin in linears]
        self.out_features = sum(self.splits)
        weight = torch.cat([lin.weight.detach() for lin in linears])
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, batch_hint)
        biases = [lin.bias for lin in linears]
        self.had_bias = tuple(b is not None for b in biases)  # models/patches.restore_linears gives back just these
        self.bias = None
        if any(b is not None for b in biases):
            self.bias = torch.nn.Parameter(torch.cat([weight.new_zeros(lin.out_features) if b is None else b.detach()
                                                      for lin, b in zip(linears, biases)]), requires_grad=False)
        # (input, its split output): the product the parts of one input share. Keyed by the input object itself,
        # held until the last part takes its slice or another input comes, so it can never serve a stale result.
        self._shared: tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None = None

    def part(self, x: torch.Tensor, index: int) -> torch.Tensor:
        """The output of linear `index` of the fused ones for input x, from one product for all of them."""
        if self._shared is None or self._shared[0] is not x:
            self._shared = (x, self(x).split(self.splits, dim=-1))
        out = self._shared[1][index]
        if index == len(self.splits) - 1:
            self._shared = None
        return out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, splits={self.splits}, packed=oneDNN"


class LinearPart(torch.nn.Module):
    """Stands in for one of the linears a FusedLinear holds: its output is that linear's slice of the fused product
    (FusedLinear.part). The FusedLinear is registered on its own parent (`qkv_proj`, `gate_up_proj`), not here."""

    def __init__(self, fused: FusedLinear, index: int) -> None:
        super().__init__()
        self._fused = (fused,)  # a tuple: not a child module, so the fused weight is registered once
        self.index = index
        self.in_features, self.out_features = fused.in_features, fused.splits[index]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._fused[0].part(x, self.index)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, part {self.index} of a fused product"


# (parent attribute, fused attribute, the linears it fuses): the products fused in every decoder layer.
FUSED = (("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp", "gate_up_proj", ("gate_proj", "up_proj")))


def fuse_projections(model: Any) -> int:
    """Fuse each decoder layer's q/k/v and gate/up linears of `model` (a transformers causal LM) into FusedLinears,
    in place, the originals replaced by LinearParts (module docstring); returns how many were fused. A layer whose
    projections are not all plain `nn.Linear`s (or are missing, e.g. a mixture of experts) is left as it is."""
    count = 0
    for layer in model.model.layers:
        for parent_name, fused_name, names in FUSED:
            parent = getattr(layer, parent_name, None)
            linears = [getattr(parent, n, None) for n in names]
            if parent is None or not all(type(lin) is torch.nn.Linear for lin in linears):
                continue
            fused = FusedLinear(linears)  # type: ignore[arg-type]  # all nn.Linear: checked above
            setattr(parent, fused_name, fused)
            for i, name in enumerate(names):
                setattr(parent, name, LinearPart(fused, i))
            del linears
            release_free_memory()
            count += 1
    return count


class TransposedLinear(torch.nn.Module):
    """`torch.nn.Linear` with its weight stored once in fp32, transposed: (in, out) contiguous, multiplied as
    `x @ W^T` (`addmm` with the bias). On the AVX2-only AMD EPYC it was measured on, MKL's sgemm is faster on that
    layout than on `F.linear`'s (out, in) (benchmarks/probes/upcast_ab.py, docs/benchmarks.md); from 4 rows on the
    two give the same bits (both are MKL's gemm with the other operand transposed; benchmarks/probes/layout_bits.py).
    Below 4 rows MKL takes a gemv path whose order of sums depends on the layout, so those bits differ from
    `F.linear`'s, as they already differ between 3 rows and 4 with either layout.

    This class is the fp32 model's linear (kernels.transposed_linears): there the transposed copy is the only
    one, and where `keep_dense` (see KEEP_DENSE) `weight` is its (out, in) view, which reads as the nn.Linear
    weight does without a second copy. UpcastLinear is the same product for a 16-bit model."""

    def __init__(self, linear: torch.nn.Linear, keep_dense: bool) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight_dtype = linear.weight.dtype  # the dense weight's (models/patches.restore_linears)
        self.weight32_t = linear.weight.detach().float().t().contiguous()
        self.bias32 = None if linear.bias is None else linear.bias.detach().float()
        self.bias = linear.bias
        if keep_dense:
            self.weight = self._dense(linear)

    def _dense(self, linear: torch.nn.Linear) -> torch.Tensor:
        return self.weight32_t.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        out = rows @ self.weight32_t if self.bias32 is None else torch.addmm(self.bias32, rows, self.weight32_t)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, weight=(in, out)"


class UpcastLinear(TransposedLinear):
    """`torch.nn.Linear` in a 16-bit dtype computed as fp32 products of fp32 copies of its weight and bias, the
    output rounded to the input's dtype once: `linear(x.float(), W.float(), b.float()).to(x.dtype)`. Every product
    of two bf16 numbers is exact in fp32, so this is a native bf16 kernel's arithmetic (fp32 accumulation) with
    its own order of sums; on a CPU that has no such kernel it replaces torch's emulation (kernels.upcast_linears).
    `weight` (the 16-bit one) stays only where `keep_dense` (see KEEP_DENSE).

    The fp32 copy is stored transposed, (in, out) contiguous, as TransposedLinear's: on the AVX2-only AMD EPYC
    where this path runs, decode 1.12-1.31x at batch 1-48 and prefill 1.07x on the 0.5B model against the
    (out, in) `F.linear`, the same greedy tokens (`benchmarks/probes/upcast_ab.py --variants upcast-rowmajor,upcast`,
    docs/benchmarks.md), and the same bits from 4 rows on (benchmarks/probes/layout_bits.py)."""

    def _dense(self, linear: torch.nn.Linear) -> torch.Tensor:
        return linear.weight

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, upcast=fp32"


def upcast_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by an UpcastLinear, in place; returns how many."""
    return _replace_linears(model, UpcastLinear)


def transpose_linears(model: Any) -> int:
    """Replace every `nn.Linear` of an fp32 `model` by a TransposedLinear, in place; returns how many. An output
    layer tied to the input embedding keeps the tie on the one transposed copy: the embedding then reads its rows
    from the (vocab, hidden) view, so the weight is not held twice. `model`: a transformers model (it has
    get_input_embeddings and get_output_embeddings)."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and head is not None and getattr(head, "weight", None) is embed.weight
    del head  # the old output layer, the largest weight: freed as soon as it is replaced
    count = _replace_linears(model, TransposedLinear)
    if tied:
        head = model.get_output_embeddings()
        embed.weight = torch.nn.Parameter(head.weight, requires_grad=embed.weight.requires_grad)
        head.weight = embed.weight
    return count


def pack_linears(model: Any) -> tuple[int, int]:
    """Fuse each decoder layer's projections (fuse_projections), then replace every other `nn.Linear` of `model`
    by a PackedLinear, in place; returns (products fused, linears packed)."""
    fused = fuse_projections(model)
    return fused, _replace_linears(model, PackedLinear)


def _replace_linears(model: torch.nn.Module, kind: type) -> int:
    """Replace the linears one at a time, holding no reference to a replaced one, and give each old weight's pages
    back to the kernel before the next copy is made (hardware.release_free_memory): the process then needs one
    linear's worth of memory more than the model, not a second model."""
    sites = [(parent_name, name) for parent_name, parent in model.named_modules()
             for name, child in parent.named_children() if type(child) is torch.nn.Linear]
    for parent_name, name in sites:
        parent = model.get_submodule(parent_name)
        setattr(parent, name, kind(getattr(parent, name), keep_dense=name in KEEP_DENSE))
        release_free_memory()
    return len(sites)
