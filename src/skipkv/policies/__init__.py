"""Registered KV-cache policies. Adding one is one file that registers itself here via `POLICIES.register`.

    skipkv policies          # lists them with their knobs
"""

from __future__ import annotations

import importlib

from skipkv.policies.base import Observation, Policy
from skipkv.registry import Registry

POLICIES: Registry[type[Policy]] = Registry("policy")

# One module per policy; importing it registers the class.
_MODULES = ("full", "streaming_llm", "h2o", "snapkv", "rkv", "skipkv", "seal", "laprox", "pyramidkv")
for _m in _MODULES:
    importlib.import_module(f"skipkv.policies.{_m}")


def make_policy(name: str, **knobs) -> Policy:
    """Instantiate a registered policy; knobs left as None take the policy's defaults."""
    from skipkv.errors import SkipKVError

    cls = POLICIES.get(name)
    allowed = {k[0] for k in cls.knobs()}
    unknown = sorted(k for k, v in knobs.items() if v is not None and k not in allowed)
    if unknown:
        raise SkipKVError(f"policy {name!r} has no knob {unknown[0]!r}; knobs: {', '.join(sorted(allowed))}")
    return cls(**{k: v for k, v in knobs.items() if v is not None})


__all__ = ["POLICIES", "Observation", "Policy", "make_policy"]
