"""Offline model recipes: real pretrained models shipped on PyPI as GGUF parts (placeholder list; see `pull`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Recipe:
    name: str

    def folder(self) -> Path:
        from skipkv.models import home

        return home() / "models" / self.name


RECIPES: dict[str, Recipe] = {}
