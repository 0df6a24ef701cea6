"""Registered KV-cache policies. Adding one is one file in this folder that registers itself via
`POLICIES.register`: every module here (but `base`) is imported below, the CLI, the runner and the contract
test read the registry, and the README's table is generated from it (`skipkv policies --markdown`).

    skipkv policies              # lists them with their knobs
    skipkv policies --markdown   # the README's policy table
"""

from __future__ import annotations

import importlib
import pkgutil

from skipkv.policies.base import Observation, Policy
from skipkv.registry import Registry

POLICIES: Registry[type[Policy]] = Registry("policy")

# Discovered, not listed: importing a policy module registers its class.
for _info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
    if _info.name != "base" and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")


def markdown_table() -> str:
    """The README's policy table, one row per registered policy (name, paper, what it keeps)."""
    rows = ["| name | paper | what it keeps |", "|---|---|---|"]
    for name in POLICIES.names():
        cls = POLICIES.get(name)
        rows.append(f"| `{name}` | {cls.paper} | {cls.keeps} |")
    return "\n".join(rows) + "\n"


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


__all__ = ["POLICIES", "Observation", "Policy", "make_policy", "markdown_table", "parse_policy_spec"]
