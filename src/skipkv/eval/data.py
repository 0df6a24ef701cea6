"""What a dataset is, and the registry of them: Example, DataRequest, the Dataset base class, DATASETS.

The sets themselves live in `datasets.py` (gsm8k, math500, aime24, humaneval) and `longctx.py` (niah, ...);
both import this module and register their classes here, so neither imports the other's registry.

    python -c "from skipkv.eval.datasets import dataset_names; print(dataset_names())"
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar

from skipkv.config import COUNT_WHY, MAX_COUNT, MAX_SEED, SEED_WHY, bounded
from skipkv.errors import SkipKVError
from skipkv.registry import Registry

SOURCES = ("local", "hub")


@dataclass(frozen=True)
class Example:
    """One task instance. `task` picks the prompt template and grader family; `inputs` fills the template."""

    id: str
    task: str
    inputs: Mapping[str, Any]
    reference: Any  # str, a list of str (all must appear), or for code the test program
    meta: Mapping[str, Any] = field(default_factory=dict)  # copied into each record (depth, length, entry_point ...)


@dataclass(frozen=True)
class DataRequest:
    """Everything a dataset may need to build its examples (file sets ignore the long-context fields).

    The fields other than tokenizer and prompt_style are the user's dataset options (OPTION_KEYS):
    EvalConfig.dataset_options and the CLI's --source/--data/--lengths/--depths/--per-length/--data-seed."""

    source: str = "local"
    data: str | None = None  # --data: a JSONL in the packaged schema, or a haystack .txt for long-context sets
    lengths: tuple[int, ...] = ()  # () = the dataset's default lengths
    depths: tuple[float, ...] = ()  # niah only; () = default depths
    per_length: int | None = None  # examples per length (niah: per length x depth cell); None = default
    seed: int = 0  # data seed of the synthetic generators (not the sampling seed)
    offset: int = 0  # skip this many examples (a --limit then counts from here): e.g. a calibration slice
    tokenizer: Any = None  # long-context lengths are counted in this tokenizer's tokens
    prompt_style: str = "chat"


OPTION_KEYS = ("source", "data", "lengths", "depths", "per_length", "seed", "offset")


def data_request(options: Mapping[str, Any], tokenizer: Any = None, prompt_style: str = "chat") -> DataRequest:
    """A DataRequest from user options (unknown keys are an error; lists become tuples)."""
    unknown = sorted(set(options) - set(OPTION_KEYS))
    if unknown:
        raise SkipKVError(f"unknown dataset option {unknown[0]!r}; known: {', '.join(OPTION_KEYS)}")
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if v is not None}
    bounded(values.get("offset", 0), "dataset option offset", 0, MAX_COUNT, COUNT_WHY)
    bounded(values.get("seed", 0), "dataset option seed", 0, MAX_SEED, SEED_WHY)
    return DataRequest(**values, tokenizer=tokenizer, prompt_style=prompt_style)


class Dataset(ABC):
    """A named benchmark. Class attributes say how to prompt, generate and grade it."""

    name: ClassVar[str]
    grader: ClassVar[str]  # a key of graders.GRADERS
    max_new_tokens: ClassVar[int]  # default generation length (research/algorithms.md §6.2 for the paper sets)
    long_context: ClassVar[bool] = False
    raw_stop: ClassVar[tuple[str, ...]] = ()  # stop strings for the raw style (code completion)

    @abstractmethod
    def load(self, request: DataRequest) -> list[Example]:
        """All examples, in a stable order (a --limit takes a prefix of it)."""

    def check(self, request: DataRequest) -> None:  # noqa: B027 - optional: most sets check in load
        """Refuse bad options (and a bad data file) before a model loads; `request` has no tokenizer yet."""

    @abstractmethod
    def identity(self, request: DataRequest) -> dict[str, Any]:
        """What fixes the data, for config.json: source file and its sha256, or generator parameters."""


DATASETS: Registry[type[Dataset]] = Registry("dataset")


def packaged(filename: str) -> Path:
    """Path of a data file shipped inside the package (skipkv/data/)."""
    path = Path(str(resources.files("skipkv") / "data" / filename))
    if not path.is_file():
        raise SkipKVError(f"packaged data file {filename!r} is missing from this install")
    return path


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def read_jsonl(path: Path, schema: str = "data") -> list[dict]:
    """The rows of a JSON-lines data file (skipkv.files: bounded, each row checked by `schema`)."""
    from skipkv.files import read_jsonl as read

    return [row for _num, row in read(path, "data", schema)]
