"""Every change skipkv makes to a transformers model, applied and removed here, and nowhere else.

- **linears**: nn.Linears replaced by prepacked (q/k/v and gate/up fused), upcast or transposed ones
  (models/packed.py), as the model's plan says (plan.py). Applied by `apply_linears` (load_model), removed by
  `restore_linears`.
- **attention**: the model's attention function set to the skipkv backend (attention.py). Applied by
  `routed(model)` (a block) or `ModelPatches.route_attention`, removed on leaving the block or by `close()`.
- **unpadded MLPs**: each dense decoder MLP runs on the real positions of a right-padded prefill only
  (models/unpad.py). Applied by `ModelPatches.unpad_mlps`, removed by `close()`.
- **steering**: a forward pre-hook adding a vector to one decoder layer's residual input (steering/hook.py).
  Registered by `steering_hook` (ResidualAdd), owned by `ModelPatches.steer`, removed by `ResidualAdd.remove` or
  `close()`.

An Engine holds one `ModelPatches` for its model: the attention routed, the MLPs unpadded, its steering hook;
`Engine.close()` removes them in reverse order and leaves the model as transformers built it, but for its linears,
which stay as load_model left them for the bundle's life (`restore_linears` gives back plain nn.Linears with the
same weights, e.g. to hand the model to code that reads `.weight` of every linear).

    patches = ModelPatches(model); patches.route_attention(); patches.unpad_mlps(); ...; patches.close()
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from collections.abc import Callable, Iterator
from typing import Any

import torch

from skipkv.errors import SkipKVError
from skipkv.models.packed import (
    FUSED,
    FusedLinear,
    PackedLinear,
    TransposedLinear,
    UpcastLinear,
    pack_linears,
    transpose_linears,
    upcast_linears,
)
from skipkv.models.unpad import unpadded_forward
from skipkv.plan import LINEARS, Choice, KernelPlan

BACKEND = "skipkv"  # the attention implementation's name in transformers' AttentionInterface
_UNPADDED = "_skipkv_unpadded"


# ---------------------------------------------------------------------------------------------- linears
def apply_linears(model: Any, plan: KernelPlan) -> KernelPlan:
    """Replace `model`'s linears as `plan.linears` says, in place; returns the plan with what was done (counts)
    in its reason, which is what runs."""
    kind, why = plan.linears.value, plan.linears.reason
    if kind not in LINEARS:
        raise SkipKVError(f"linears must be one of {', '.join(LINEARS)}, got {kind!r}")
    if kind == "packed":
        fused, count = pack_linears(model)
        why = f"{count} linears prepacked, {fused} fused q/k/v and gate/up products: {why}"
    elif kind == "upcast":
        why = f"{upcast_linears(model)} linears upcast to fp32: {why}"
    elif kind == "transposed":
        why = f"{transpose_linears(model)} linears stored (in, out): {why}"
    return dataclasses.replace(plan, linears=Choice(kind, why))


def linears_of(model: Any) -> Choice:
    """What `model`'s linears are now, as a plan's `linears` choice (a model loaded elsewhere, or restored)."""
    kinds = {type(m) for m in model.modules()}
    for kind, cls in (("packed", PackedLinear), ("upcast", UpcastLinear),
                      ("transposed", TransposedLinear)):
        if any(issubclass(k, cls) for k in kinds):
            return Choice(kind, "the model's linears as given (replaced by skipkv before)")
    return Choice("torch", "the model's linears as given")


def restore_linears(model: Any) -> int:
    """Undo `apply_linears`: every replaced linear of `model` becomes an nn.Linear with the same weight and bias in
    the model's dtype (a tied output layer tied again); returns how many. The plan's linears are then "torch"."""
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = embed is not None and head is not None and getattr(head, "weight", None) is embed.weight
    count = 0
    for layer in model.model.layers:
        for parent_name, fused_name, names in FUSED:
            parent = getattr(layer, parent_name, None)
            fused = getattr(parent, fused_name, None)
            if not isinstance(fused, FusedLinear):
                continue
            weight = fused.packed.to_dense()
            bias = fused.bias
            at = 0
            for name, width, had_bias in zip(names, fused.splits, fused.had_bias):
                b = None if bias is None or not had_bias else bias[at:at + width]
                setattr(parent, name, _linear(weight[at:at + width], b))
                at += width
                count += 1
            delattr(parent, fused_name)
    sites = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
             if isinstance(child, (PackedLinear, TransposedLinear))]
    for parent, name, child in sites:
        if isinstance(child, PackedLinear):
            weight = child.weight if hasattr(child, "weight") else child.packed.to_dense()
        else:  # TransposedLinear, UpcastLinear: the fp32 copy holds the dense weight's values exactly
            weight = child.weight if hasattr(child, "weight") else child.weight32_t.t().to(child.weight_dtype)
        setattr(parent, name, _linear(weight, child.bias))
        count += 1
    if tied:
        head = model.get_output_embeddings()
        embed.weight = head.weight
    return count


def _linear(weight: torch.Tensor, bias: torch.Tensor | None) -> torch.nn.Linear:
    """An nn.Linear holding `weight` (out, in; made contiguous) and `bias` as they are."""
    lin = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    lin.weight = torch.nn.Parameter(weight.contiguous(), requires_grad=False)
    if bias is not None:
        lin.bias = torch.nn.Parameter(bias.detach().contiguous(), requires_grad=False)
    return lin


# ---------------------------------------------------------------------------------------------- attention
@contextlib.contextmanager
def routed(model: Any) -> Iterator[None]:
    """Route `model`'s attention through the skipkv backend (attention.py, which registers it with transformers'
    AttentionInterface when imported: every forward through it passes an attention.StepContext) for the duration
    of the block."""
    from transformers import AttentionInterface

    if BACKEND not in AttentionInterface().valid_keys():
        raise SkipKVError("the skipkv attention backend is not registered: import skipkv.attention first")
    previous = model.config._attn_implementation
    model.set_attn_implementation(BACKEND)
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


def is_routed(model: Any) -> bool:
    """Whether `model`'s attention runs the skipkv backend now (an Engine or a press is open on it)."""
    return getattr(model.config, "_attn_implementation", None) == BACKEND


# ---------------------------------------------------------------------------------------------- steering
def steering_hook(layer: torch.nn.Module, hook: Callable[..., Any]) -> Any:
    """Register `hook` as a forward pre-hook (with kwargs) of the decoder `layer`; returns its removable handle."""
    return layer.register_forward_pre_hook(hook, with_kwargs=True)


# ---------------------------------------------------------------------------------------------- the engine's set
class ModelPatches:
    """The changes one Engine (or press) holds on a model, removed together, newest first, by `close()`."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self._undo: list[Callable[[], object]] = []

    def route_attention(self) -> None:
        """Route the attention through the skipkv backend until close(). Refused where it already is (another
        Engine or press is open on this model)."""
        if is_routed(self.model):
            raise SkipKVError("another Engine is open on this model; close it first")
        block = routed(self.model)
        block.__enter__()
        self._undo.append(lambda: block.__exit__(None, None, None))

    def unpad_mlps(self) -> int:
        """Make each dense decoder MLP (class name ending in "MLP"; a mixture of experts is left as it is) run on
        the real positions only inside `unpad.real_positions`, until close(); returns how many are (idempotent:
        MLPs already unpadded by another holder are counted, not wrapped again nor unwrapped here)."""
        count = 0
        for layer in self.model.model.layers:
            mlp = getattr(layer, "mlp", None)
            if mlp is None or not type(mlp).__name__.endswith("MLP"):
                continue
            count += 1
            if getattr(mlp, _UNPADDED, False):
                continue
            mlp.forward = types.MethodType(unpadded_forward, mlp)
            setattr(mlp, _UNPADDED, True)
            self._undo.append(functools.partial(_unwrap, mlp))
        return count

    def steer(self, hook: Any) -> None:
        """Own a steering hook (a ResidualAdd, registered with `steering_hook`): removed by close()."""
        self._undo.append(hook.remove)

    def close(self) -> None:
        """Remove every change made through this object, newest first (idempotent)."""
        while self._undo:
            self._undo.pop()()


def _unwrap(mlp: torch.nn.Module) -> None:
    del mlp.forward
    delattr(mlp, _UNPADDED)
