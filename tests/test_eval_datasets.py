"""File datasets (packaged, --data, hub conversion) and prompt rendering."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from skipkv.errors import SkipKVError
from skipkv.eval import prompts
from skipkv.eval.datasets import (
    AIME24,
    DATASETS,
    GSM8K,
    MATH500,
    DataRequest,
    Example,
    HumanEval,
    data_request,
    dataset_names,
    get_dataset,
    gsm8k_final,
)
from skipkv.models.random import byte_tokenizer

# Row counts and checksums from shared/data/README.md: the packaged copies are those files, unchanged.
PACKAGED = {
    "gsm8k": (1319, "61e95530639fc237c2e17f0f3fabf2325054c57c3caacc3bc9838c95089a6999"),
    "math500": (500, "faf9028997cf267d805264c585de4b34327ffb36d1e73dcc3256ac4249811357"),
    "aime24": (30, "8f41dfe557c23872bd3d62a974b5d20354a420c73f19d8d7a209c52f71995a37"),
    "humaneval": (164, "722aa6a7825b8061ec364420f065669304c31d7d9f6eb8d7f2e280582f70377e"),
}


def test_registered_names() -> None:
    assert set(dataset_names()) == {"gsm8k", "math500", "aime24", "humaneval", "niah", "niah_multikey",
                                    "variable_tracking", "common_words"}
    with pytest.raises(SkipKVError, match="unknown dataset"):
        get_dataset("mmlu")


@pytest.mark.parametrize("name", sorted(PACKAGED))
def test_packaged_datasets(name: str) -> None:
    rows, sha = PACKAGED[name]
    ds = get_dataset(name)
    examples = ds.load(DataRequest())
    assert len(examples) == rows
    assert len({e.id for e in examples}) == rows
    assert ds.identity(DataRequest())["sha256"] == sha
    first = examples[0]
    if name == "humaneval":
        assert first.task == "code" and first.meta["entry_point"] == "has_close_elements"
        assert "def check(candidate)" in first.reference
    else:
        assert first.task == "math" and first.inputs["question"] and first.reference
    if name == "gsm8k":
        assert all(e.reference.lstrip("-").isdigit() for e in examples)  # commas removed, integers
    if name == "math500":
        assert first.meta["level"] in range(1, 6)


def test_data_file_and_its_errors(tmp_path: Path) -> None:
    good = tmp_path / "mine.jsonl"
    good.write_text(json.dumps({"id": "a", "problem": "1+1?", "answer": "2"}) + "\n\n"
                    + json.dumps({"id": "b", "problem": "2+2?", "answer": "4"}) + "\n")
    ex = get_dataset("math500").load(DataRequest(data=str(good)))
    assert [e.id for e in ex] == ["a", "b"] and ex[1].reference == "4"
    ident = get_dataset("math500").identity(DataRequest(data=str(good)))
    assert ident["file"] == "mine.jsonl" and len(ident["sha256"]) == 64

    dup = tmp_path / "dup.jsonl"
    dup.write_text(json.dumps({"id": "a", "problem": "x", "answer": "1"}) + "\n"
                   + json.dumps({"id": "a", "problem": "y", "answer": "2"}) + "\n")
    with pytest.raises(SkipKVError, match="appears twice"):
        get_dataset("gsm8k").load(DataRequest(data=str(dup)))
    missing = tmp_path / "missing.jsonl"
    missing.write_text(json.dumps({"id": "a", "problem": "x"}) + "\n")
    with pytest.raises(SkipKVError, match=r"missing.jsonl:1: answer: Field required"):
        get_dataset("aime24").load(DataRequest(data=str(missing)))
    broken = tmp_path / "broken.jsonl"
    broken.write_text("{not json\n")
    with pytest.raises(SkipKVError, match="not valid JSON"):
        get_dataset("aime24").load(DataRequest(data=str(broken)))
    with pytest.raises(SkipKVError, match="not found"):
        get_dataset("aime24").load(DataRequest(data=str(tmp_path / "nope.jsonl")))


def test_hub_without_datasets_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` raise ImportError
    with pytest.raises(SkipKVError, match="pip install"):
        get_dataset("gsm8k").load(DataRequest(source="hub"))
    with pytest.raises(SkipKVError, match="unknown data source"):
        get_dataset("gsm8k").load(DataRequest(source="s3"))


def test_hub_rows_convert_to_the_packaged_schema() -> None:
    assert gsm8k_final("so 2,125 in all\n#### 2,125") == "2125"
    row = GSM8K.from_hub({"question": "Q?", "answer": "work\n#### 1,000"}, 7)
    assert row == {"id": "gsm8k-test-0007", "problem": "Q?", "solution": "work\n#### 1,000", "answer": "1000"}
    assert MATH500.from_hub({"unique_id": "test/x/1.json", "problem": "p", "solution": "s", "answer": "\\frac12",
                             "subject": "Algebra", "level": 2}, 0)["id"] == "test/x/1.json"
    assert AIME24.from_hub({"id": 60, "problem": "p", "solution": "s", "answer": "073"}, 0)["answer"] == "73"
    he = HumanEval.from_hub({"task_id": "HumanEval/3", "prompt": "def f():\n", "entry_point": "f", "test": "t",
                             "canonical_solution": "    pass\n"}, 3)
    assert get_dataset("humaneval").example(he).meta == {"entry_point": "f"}


def test_data_request_options() -> None:
    req = data_request({"lengths": [512, 1024], "seed": 3})
    assert req.lengths == (512, 1024) and req.seed == 3
    with pytest.raises(SkipKVError, match="unknown dataset option"):
        data_request({"length": [512]})


def test_math_prompt_styles() -> None:
    tok = byte_tokenizer()
    ex = Example("q", "math", {"question": "What is {x}?"}, "1")
    user = "Answer the following questions. You should think step-by-step and put your final answer within " \
           "\\boxed{}.\nQuestion: What is {x}?"
    chat = prompts.render(tok, ex, "chat")
    assert chat == f"<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    assert prompts.render(tok, ex, "raw") == user  # braces in the question are not template fields
    # the encoded chat prompt is exactly the text's tokens (no second BOS or anything else added)
    assert tok.decode(prompts.encode(tok, chat, "chat")) == chat
    with pytest.raises(SkipKVError, match="prompt style"):
        prompts.render(tok, ex, "fancy")


def test_code_and_answer_prefix_prompts() -> None:
    tok = byte_tokenizer()
    stub = "def f(x):\n    \"\"\"Return x.\"\"\"\n"
    ex = Example("c", "code", {"prompt": stub}, "", {"entry_point": "f"})
    assert prompts.render(tok, ex, "raw") == stub
    assert "```python\n" + stub + "```" in prompts.render(tok, ex, "chat")
    needle = Example("n", "niah", {"context": "hay", "query": "red-fox"}, "1")
    chat = prompts.render(tok, needle, "chat")
    assert chat.endswith("<|im_start|>assistant\n"
                         "The special magic number for red-fox mentioned in the provided text is")
    assert prompts.render(tok, needle, "raw").endswith("?\nThe special magic number for red-fox mentioned in the "
                                                       "provided text is")


def test_chat_style_needs_a_template() -> None:
    tok = byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(SkipKVError, match="prompt-style raw"):
        prompts.render(tok, Example("q", "math", {"question": "1+1"}, "2"), "chat")


def test_every_dataset_class_is_consistent() -> None:
    for name in dataset_names():
        cls = DATASETS.get(name)
        assert cls.name == name
        assert cls.max_new_tokens > 0
        assert cls.grader in {"math", "gsm8k", "code", "contains"}
