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


def parse_policy_spec(spec: str, **defaults) -> tuple[str, Policy]:
    """`name[:knob=value,...]` (e.g. `laprox:kernel=7,normalize=sum`) -> (the spec as its label, the policy).
    Values take the knob's type; `defaults` (e.g. budget) apply unless the spec sets them."""
    from skipkv.errors import SkipKVError

    name, _, rest = spec.strip().partition(":")
    cls = POLICIES.get(name)
    types = {k[0]: k[1] for k in cls.knobs()}
    knobs = dict(defaults)
    for item in filter(None, rest.split(",")):
        key, eq, raw = item.partition("=")
        key = key.strip().replace("-", "_")
        if not eq or not raw.strip():
            raise SkipKVError(f"policy spec {spec!r}: expected knob=value, got {item!r}")
        if key not in types:
            raise SkipKVError(f"policy {name!r} has no knob {key!r}; knobs: {', '.join(sorted(types))}")
        kind, raw = types[key], raw.strip()
        try:
            if kind is bool:
                if raw.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                value = raw.lower() in ("true", "1")
            else:
                value = kind(raw)
        except ValueError:
            raise SkipKVError(f"policy spec {spec!r}: {key} must be {kind.__name__}, got {raw!r}") from None
        knobs[key] = value
    return spec.strip(), make_policy(name, **knobs)


__all__ = ["POLICIES", "Observation", "Policy", "make_policy", "parse_policy_spec"]
