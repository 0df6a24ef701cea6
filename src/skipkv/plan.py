"""The kernel plan: every kernel choice a loaded model's forwards make, resolved once when it loads, then frozen.

    python -c "from skipkv.models import load_model; print(load_model('random:qwen2').plan.record())"

`load_model` resolves the plan for the model's dtype and device (`KernelPlan.resolve`, from the per-processor
decisions in skipkv.kernels, whose docstring gives the measurements behind each), applies the linears it names
(models/patches.py) and keeps it on the bundle (`bundle.plan`). From then on nothing asks skipkv.kernels again:
the attention backend reads the plan its forward was given (`StepContext.plan`), the runner builds its decode
step from `plan.step`, and eval runs record `plan.record()` as `environment.kernel_plan`: what ran, not what a
CPU in bf16 would have run. A model loaded elsewhere (a user's transformers model under `skipkv.KVPress`) gets
the plan of its dtype and device with its linears as they are (`KernelPlan.resolve(..., linears=...)`).

`EngineConfig.enforce_eager` is applied with `plan.eager()`, which keeps the rest of the plan as it is.
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from skipkv import kernels
from skipkv.errors import SkipKVError

LINEARS = ("packed", "upcast", "transposed", "torch")
STEPS = ("compiled", "graph", "eager", "hf")


@dataclass(frozen=True)
class Choice:
    """One kernel decision: what runs, and why."""

    value: Any
    reason: str


@dataclass(frozen=True)
class KernelPlan:
    """What a model's forwards run on its dtype and device (module docstring).

    linears: "packed" (oneDNN, prepacked, q/k/v and gate/up fused), "upcast" (fp32 products of upcast bf16
    weights), "transposed" (fp32 weights stored (in, out)) or "torch" (nn.Linear as loaded).
    attention: where every key is visible to a forward's queries, "sdpa" (torch's fused SDPA) or "grouped"
    (attention.py's grouped matmuls). pv: a 16-bit model's p.V dtype, "model" or "fp32" ("model" for fp32/fp64:
    their own dtype). pv_buckets: a 16-bit CPU p.V over kernels.key_bucket keys. step: how decode steps over a
    uniform store run, one of STEPS (engine/step.py, engine/graphs.py). cuda_sdpa: SDPA backends on CUDA."""

    dtype: torch.dtype
    device: torch.device
    linears: Choice
    attention: Choice
    pv: Choice
    pv_buckets: Choice
    step: Choice
    cuda_sdpa: Choice | None = None

    @classmethod
    def resolve(cls, dtype: torch.dtype, device: torch.device | str, linears: Choice | None = None) -> KernelPlan:
        """The plan for a model in `dtype` on `device`, from skipkv.kernels' per-processor decisions. `linears`:
        what the model's linears already are (a model loaded elsewhere); default: what this machine should run,
        to be applied by models.patches.apply_linears."""
        device = torch.device(device)
        if linears is None:
            linears = _linears(dtype, device)
        sixteen = dtype.itemsize == 2
        pv = Choice(*kernels.decode_pv()) if sixteen else Choice("model", f"{_name(dtype)}: p.V in its own dtype")
        if sixteen and device.type == "cpu":
            buckets = Choice(*kernels.pv_buckets(dtype))
        else:
            buckets = Choice(False, "key buckets are for a 16-bit p.V on a CPU")
        cuda_sdpa = None
        if device.type == "cuda":
            backends, why = kernels.cuda_sdpa_backends()
            cuda_sdpa = Choice(tuple(backends), why)
        return cls(dtype, device, linears, Choice(*kernels.decode_attention(dtype, device)), pv, buckets,
                   Choice(*kernels.decode_step(dtype, device, packed=linears.value == "packed")), cuda_sdpa)

    def eager(self, enforce_eager: bool = True) -> KernelPlan:
        """This plan with `EngineConfig.enforce_eager` applied: a compiled or replayed step becomes the eager one."""
        if not enforce_eager or self.step.value not in ("compiled", "graph"):
            return self
        return dataclasses.replace(self, step=Choice("eager", f"enforce_eager (else {self.step.value}: "
                                                              f"{self.step.reason})"))

    def with_step(self, step: str) -> KernelPlan:
        """This plan with the decode step `step` (one of STEPS), chosen by the caller: benchmarks and tests that
        compare the steps on one loaded model (`bundle.plan = bundle.plan.with_step("eager")`)."""
        if step not in STEPS:
            raise SkipKVError(f"decode step must be one of {', '.join(STEPS)}, got {step!r}")
        return dataclasses.replace(self, step=Choice(step, f"{step}: chosen by the caller"))

    @property
    def sdpa(self) -> bool:
        """Whether a forward whose queries see every key runs torch's fused SDPA."""
        return self.attention.value == "sdpa"

    @property
    def pv_fp32(self) -> bool:
        """Whether a 16-bit p.V converts the values to fp32 (SKIPKV_DECODE_PV=fp32)."""
        return self.pv.value == "fp32"

    def sdpa_context(self) -> contextlib.AbstractContextManager:
        """The context a forward runs in: on CUDA, SDPA limited to `cuda_sdpa` (kernels.cuda_sdpa_backends: cuDNN
        excluded); else nothing."""
        backends = self.cuda_sdpa.value if self.cuda_sdpa is not None else ()
        if not backends:
            return contextlib.nullcontext()
        from torch.nn.attention import sdpa_kernel

        return sdpa_kernel(list(backends))

    def record(self) -> dict[str, Any]:
        """The plan as JSON, for a run's environment (`environment.kernel_plan`)."""
        out: dict[str, Any] = {"dtype": _name(self.dtype), "device": str(self.device),
                               "linears": {"kernel": self.linears.value, "reason": self.linears.reason},
                               "decode_attention": {"kernel": self.attention.value, "reason": self.attention.reason},
                               "decode_pv": {"dtype": self.pv.value, "reason": self.pv.reason,
                                             "key_buckets": self.pv_buckets.value,
                                             "key_buckets_reason": self.pv_buckets.reason},
                               "decode_step": {"step": self.step.value, "reason": self.step.reason}}
        if self.cuda_sdpa is not None:
            out["sdpa_cuda"] = {"backends": [b.name for b in self.cuda_sdpa.value] or "torch's choice",
                                "reason": self.cuda_sdpa.reason}
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _linears(dtype: torch.dtype, device: torch.device) -> Choice:
    """The linears' kernel for `dtype` on `device`: packed first, then upcast, then transposed, else torch's."""
    for kind, decide in (("packed", kernels.packed_linears), ("upcast", kernels.upcast_linears),
                         ("transposed", kernels.transposed_linears)):
        chosen, why = decide(dtype, device)
        if chosen:
            return Choice(kind, why)
    return Choice("torch", f"nn.Linear as loaded ({why})")
