"""The steering hook on the model's residual stream (SEAL and SkipKV's adaptive steering; the engine installs it).

`ResidualAdd` adds coef_b · v to the residual input of one decoder layer at the newest position of every
row b whose gate is open; coefficients and gates are set per request before each decode forward.

    hook = ResidualAdd(model, layer=20, vector=v, coef=lambda state: -1.0, gate=lambda tok, state: True)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from skipkv.cache.store import to_device
from skipkv.models.patches import steering_hook


class ResidualAdd:
    def __init__(self, model, layer: int, vector: torch.Tensor, coef: Callable[[Any], float],
                 gate: Callable[[int, Any], bool] | None = None) -> None:
        layers = model.model.layers
        if not 0 <= layer < len(layers):
            raise ValueError(f"steering layer {layer} outside [0, {len(layers)})")
        p = next(model.parameters())
        self.vector = vector.to(device=p.device, dtype=p.dtype)
        self.coef, self.gate = coef, gate
        self.layer = layer
        self.scale: torch.Tensor | None = None  # [B] coefficient per row for the next forward (0 = closed)
        self.handle = steering_hook(layers[layer], self._hook)  # models/patches.py; an Engine owns its removal

    def prepare(self, tokens: torch.Tensor, states: list) -> None:
        """Set the per-row scale for the next forward from each request's current token (host tensor [B]) and state."""
        vals = [self.coef(s) if (self.gate is None or self.gate(int(t), s)) else 0.0
                for t, s in zip(tokens.tolist(), states)]
        self.scale = to_device(torch.tensor(vals, dtype=self.vector.dtype), self.vector.device)

    def _hook(self, module, args, kwargs):
        if self.scale is None:
            return None
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden = hidden.clone()
        hidden[:, -1] += self.scale[:, None] * self.vector
        self.scale = None
        if args:
            return (hidden, *args[1:]), kwargs
        kwargs["hidden_states"] = hidden
        return args, kwargs

    def remove(self) -> None:
        self.handle.remove()
