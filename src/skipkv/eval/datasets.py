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

from abc import abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from skipkv.errors import SkipKVError

# The long-context sets register themselves on import, so every name is known to get_dataset
# (longctx imports data.py, not this module: no circle).
from skipkv.eval import longctx  # noqa: F401

# The base types and the registry live in data.py; re-exported here, where callers have always found them.
from skipkv.eval.data import (  # noqa: F401
    DATASETS,
    OPTION_KEYS,
    SOURCES,
    DataRequest,
    Dataset,
    Example,
    data_request,
    packaged,
    read_jsonl,
    sha256_file,
)


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
    schema: ClassVar[str]  # the row schema in skipkv.files.schemas
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
            from skipkv.files.schemas import validate
            from skipkv.files.text import walk_text

            where = f"hub {self.hub[0]}"
            rows = [validate(self.schema, self.from_hub(r, i), f"{where} row {i}")
                    for i, r in enumerate(hub_rows(*self.hub))]
            for i, row in enumerate(rows):
                walk_text(row, f"{where} row {i}")  # text no tokenizer can encode stops here, not in the tokenizer
        else:
            path = self._file(request)
            rows, where = read_jsonl(path, self.schema), str(path)
        seen: set[str] = set()
        for row in rows:
            if str(row["id"]) in seen:
                raise SkipKVError(f"{where}: id {row['id']!r} appears twice")
            seen.add(str(row["id"]))
        return rows

    def load(self, request: DataRequest) -> list[Example]:
        return [self.example(r) for r in self.rows(request)]

    def check(self, request: DataRequest) -> None:
        if request.source == "local":
            self.rows(request)  # a --data file is read (bounded, schema-checked) before the model loads

    def identity(self, request: DataRequest) -> dict[str, Any]:
        if request.source == "hub":
            # No revision pinning through `datasets` here: record what was asked for.
            return {"source": "hub", "repo": self.hub[0], "config": self.hub[1], "split": self.hub[2]}
        path = self._file(request)
        # The content hash identifies the data; the file name is for people (a moved file still resumes).
        return {"source": "local", "file": path.name, "sha256": sha256_file(path)}


class MathDataset(FileDataset):
    schema = "data_math"
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
    schema = "data_code"
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
    """An instance of the dataset registered as `name` (file sets above, long-context sets in longctx.py)."""
    return DATASETS.get(name)()


def dataset_names() -> list[str]:
    return DATASETS.names()

