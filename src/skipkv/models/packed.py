"""Linear layers with their weights prepacked once for oneDNN (CPU, bf16), instead of at every call; or, on a CPU
whose oneDNN has no bf16 matmul, multiplied in fp32 on weights upcast once (UpcastLinear); or, for an fp32 model on
a CPU where MKL's sgemm is faster that way, stored transposed (TransposedLinear, kernels.transposed_linears).

    python -c "from skipkv.models import load_model; print(load_model('random:qwen2', dtype='bf16').packed_linears)"

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

Memory: the packed copy replaces the dense weight, except where the project reads the dense one (`o_proj`:
LaProx's output-aware score and the fidelity benchmark) and where it is shared (`lm_head` tied to the input
embedding): there both exist (for Qwen2.5-0.5B, 38 MB of o_proj and the 272 MB tied embedding copied once).
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


class PackedLinear(torch.nn.Module):
    """`torch.nn.Linear` with a oneDNN-packed weight. `weight` stays only where `keep_dense` (see KEEP_DENSE)."""

    def __init__(self, linear: torch.nn.Linear, keep_dense: bool, batch_hint: int = 16) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), batch_hint)
        self.bias = linear.bias
        if keep_dense:
            self.weight = linear.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lead = x.shape[:-1]
        if torch.compiler.is_compiling():
            # inductor lowers `_linear_pointwise` only for weights frozen into the graph; the opaque op below runs
            # the same kernel on the packed weight as an input (engine/step.py compiles the decode step).
            y = packed_linear(x.reshape(-1, self.in_features), self.packed, self.bias, self.out_features)
        else:
            y = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, self.in_features), self.packed, self.bias,
                                                   "none", [], "")
        return y.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed=oneDNN"


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


def pack_linears(model: torch.nn.Module) -> int:
    """Replace every `nn.Linear` of `model` by a PackedLinear, in place; returns how many."""
    return _replace_linears(model, PackedLinear)


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
