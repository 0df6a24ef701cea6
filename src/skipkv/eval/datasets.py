"""Evaluation datasets, registered by name: gsm8k, math500, aime24, humaneval (+ the long-context sets in longctx.py).

    skipkv eval --model M --dataset gsm8k --policy rkv --budget 256 --out runs/g   # packaged copy
    skipkv eval ... --dataset math500 --data my_math.jsonl                 # same schema, own file
    skipkv eval ... --dataset aime24 --source hub                          # needs `pip install datasets`

The packaged files (skipkv/data/*.jsonl, copied from shared/data; sources and licences in data/README.md)
make a fresh install work offline. A `--data` file must use the same schema (one JSON object a line:
`id`, `problem`, `answer` for math; `id`, `prompt`, `entry_point`, `test` for code). `--source hub`
reads the public hub copies through `datasets` and converts them to that schema.
"""

from __future__ import annotations

import hashlib
import json
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, ClassVar, Mapping

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
    values = {k: tuple(v) if isinstance(v, list) else v for k, v in options.items() if v is not None}
    offset = values.get("offset", 0)
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise SkipKVError(f"dataset option offset must be an integer >= 0, got {offset!r}")
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


def read_jsonl(path: Path) -> list[dict]:
    rows = []
    with open(path, encoding="utf-8") as f:
        for num, line in enumerate(f, 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    raise SkipKVError(f"{path}:{num} is not valid JSON") from None
    return rows


def _require(row: dict, keys: tuple[str, ...], where: str) -> None:
    missing = [k for k in keys if k not in row]
    if missing:
        raise SkipKVError(f"{where}: row {row.get('id', '?')!r} lacks field(s) {', '.join(missing)}")


def hub_rows(repo: str, config: str | None, split: str) -> list[dict]:
    """Rows of a hub dataset through `datasets` (imported here so that it stays optional)."""
    try:
        import datasets  # noqa: PLC0415 - optional dependency
    except ImportError:
        raise SkipKVError("--source hub needs the `datasets` package: pip install 'skipkv[hub]'") from None
    try:
        return [dict(r) for r in datasets.load_dataset(repo, config, split=split)]
    except Exception as exc:  # network, auth, renamed repo: one line for the user
        first = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise SkipKVError(f"cannot load {repo} from the hub: {first}") from None


class FileDataset(Dataset):
    """A benchmark read from a JSONL in the packaged schema, from --data, or converted from the hub."""

    filename: ClassVar[str]
    fields: ClassVar[tuple[str, ...]]
    hub: ClassVar[tuple[str, str | None, str]]  # (repo, config, split)

    @staticmethod
    @abstractmethod
    def from_hub(row: dict, index: int) -> dict:
        """A hub row converted to the packaged schema."""

    @abstractmethod
    def example(self, row: dict) -> Example:
        """A schema row as an Example."""

    def _file(self, request: DataRequest) -> Path:
        if request.data:
            path = Path(request.data)
            if not path.is_file():
                raise SkipKVError(f"--data file not found: {path}")
            return path
        return packaged(self.filename)

    def rows(self, request: DataRequest) -> list[dict]:
        if request.source not in SOURCES:
            raise SkipKVError(f"unknown data source {request.source!r}; choose one of: {', '.join(SOURCES)}")
        if request.source == "hub":
            if request.data:
                raise SkipKVError("give either --data PATH or --source hub, not both")
            rows = [self.from_hub(r, i) for i, r in enumerate(hub_rows(*self.hub))]
            where = f"hub {self.hub[0]}"
        else:
            path = self._file(request)
            rows, where = read_jsonl(path), str(path)
        seen: set[str] = set()
        for row in rows:
            _require(row, self.fields, where)
            if str(row["id"]) in seen:
                raise SkipKVError(f"{where}: id {row['id']!r} appears twice")
            seen.add(str(row["id"]))
        return rows

    def load(self, request: DataRequest) -> list[Example]:
        return [self.example(r) for r in self.rows(request)]

    def identity(self, request: DataRequest) -> dict[str, Any]:
        if request.source == "hub":
            # No revision pinning through `datasets` here: record what was asked for.
            return {"source": "hub", "repo": self.hub[0], "config": self.hub[1], "split": self.hub[2]}
        path = self._file(request)
        # The content hash identifies the data; the file name is for people (a moved file still resumes).
        return {"source": "local", "file": path.name, "sha256": sha256_file(path)}


class MathDataset(FileDataset):
    fields = ("id", "problem", "answer")
    grader = "math"

    def example(self, row: dict) -> Example:
        meta = {k: row[k] for k in ("subject", "level") if k in row}
        return Example(str(row["id"]), "math", {"question": row["problem"]}, str(row["answer"]), meta)


def gsm8k_final(answer_text: str) -> str:
    """GSM8K's final answer: the text after '####', thousands separators removed."""
    return answer_text.split("####")[-1].strip().replace(",", "")


@DATASETS.register("gsm8k")
class GSM8K(MathDataset):
    name = "gsm8k"
    grader = "gsm8k"
    filename = "gsm8k_test.jsonl"
    max_new_tokens = 8192
    hub = ("openai/gsm8k", "main", "test")

    @staticmethod
    def from_hub(row: dict, index: int) -> dict:
        # Same ids as the packaged file: the 0-based line number of the test split.
        return {"id": f"gsm8k-test-{index:04d}", "problem": row["question"], "solution": row["answer"],
                "answer": gsm8k_final(row["answer"])}


@DATASETS.register("math500")
class MATH500(MathDataset):
    name = "math500"
    filename = "math500_test.jsonl"
    max_new_tokens = 16384
    hub = ("HuggingFaceH4/MATH-500", None, "test")

    @staticmethod
    def from_hub(row: dict, index: int) -> dict:
        return {"id": row["unique_id"], "problem": row["problem"], "solution": row.get("solution"),
                "answer": row["answer"], "subject": row.get("subject"), "level": row.get("level")}


@DATASETS.register("aime24")
class AIME24(MathDataset):
    name = "aime24"
    filename = "aime24.jsonl"
    max_new_tokens = 16384
    hub = ("HuggingFaceH4/aime_2024", None, "train")

    @staticmethod
    def from_hub(row: dict, index: int) -> dict:
        # The hub copy's ids differ from the packaged AIME ids; answers lose leading zeros like ours.
        return {"id": f"aime2024-{row.get('id', index)}", "problem": row["problem"],
                "solution": row.get("solution"), "answer": str(int(str(row["answer"]).strip()))}


@DATASETS.register("humaneval")
class HumanEval(FileDataset):
    name = "humaneval"
    grader = "code"
    filename = "humaneval.jsonl"
    fields = ("id", "prompt", "entry_point", "test")
    max_new_tokens = 2048
    hub = ("openai/openai_humaneval", None, "test")
    # The usual HumanEval completion stops: the next top-level statement ends the function.
    raw_stop = ("\ndef ", "\nclass ", "\nif __name__", "\nprint(", "\n#", "\nassert ")

    @staticmethod
    def from_hub(row: dict, index: int) -> dict:
        return {"id": row["task_id"], "task_id": row["task_id"], "prompt": row["prompt"],
                "entry_point": row["entry_point"], "canonical_solution": row.get("canonical_solution"),
                "test": row["test"]}

    def example(self, row: dict) -> Example:
        return Example(str(row["id"]), "code", {"prompt": row["prompt"]}, row["test"],
                       {"entry_point": row["entry_point"]})


def get_dataset(name: str) -> Dataset:
    """An instance of the dataset registered as `name` (registers the long-context sets first)."""
    import skipkv.eval.longctx  # noqa: F401, PLC0415 - its classes register themselves in DATASETS

    return DATASETS.get(name)()


def dataset_names() -> list[str]:
    import skipkv.eval.longctx  # noqa: F401, PLC0415

    return DATASETS.names()
