"""Long-context generators: deterministic by seed (also across processes), lengths in the model's tokens, and
each task's answer actually present in (or derivable from) its prompt."""

from __future__ import annotations

import collections
import hashlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

import skipkv
from skipkv.errors import SkipKVError
from skipkv.eval import prompts
from skipkv.eval.datasets import DataRequest, get_dataset
from skipkv.eval.graders import ContainsGrader
from skipkv.eval.longctx import (
    insert_sentences,
    load_essays,
    make_common_words,
    make_niah,
    make_variable_tracking,
    needle,
)
from skipkv.models.random import CHATML, SPECIALS, byte_tokenizer


@pytest.fixture(scope="module")
def bpe():
    """A real multi-character BPE tokenizer (~2.7 characters a token), trained in-process on essay text."""
    text = load_essays()[0:8]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1000, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(text, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def tokens(tok, ex, style: str) -> int:
    return len(prompts.encode(tok, prompts.render(tok, ex, style), style))


def fingerprint(examples) -> str:
    rows = [(e.id, e.task, sorted(e.inputs.items()), e.reference, sorted(e.meta.items())) for e in examples]
    return hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest()


def all_tasks(tok, seed: int, lengths=(600, 1200)):
    return (make_niah(tok, "chat", lengths, (0.0, 0.5, 1.0), 1, seed)
            + make_niah(tok, "chat", lengths, (), 2, seed, num_distractors=3, name="niah_multikey")
            + make_variable_tracking(tok, "chat", lengths, 2, seed)
            + make_common_words(tok, "chat", (1200,), 2, seed))


def test_deterministic_by_seed() -> None:
    tok = byte_tokenizer()
    a, b, c = all_tasks(tok, 0), all_tasks(tok, 0), all_tasks(tok, 1)
    assert fingerprint(a) == fingerprint(b)
    assert [e.id for e in a] == [e.id for e in c]
    different = sum(x.inputs != y.inputs for x, y in zip(a, c))
    assert different == len(a)  # every example changes with the seed


def test_deterministic_across_processes() -> None:
    # A fresh interpreter with another hash seed must build the same prompts (no set-order or id() dependence).
    script = (
        "import hashlib, json, sys\n"
        "from skipkv.models.random import byte_tokenizer\n"
        "from skipkv.eval.longctx import make_niah, make_variable_tracking, make_common_words\n"
        "tok = byte_tokenizer()\n"
        "ex = (make_niah(tok, 'chat', (600, 1200), (0.0, 0.5, 1.0), 1, 0)\n"
        "      + make_niah(tok, 'chat', (600, 1200), (), 2, 0, num_distractors=3, name='niah_multikey')\n"
        "      + make_variable_tracking(tok, 'chat', (600, 1200), 2, 0)\n"
        "      + make_common_words(tok, 'chat', (1200,), 2, 0))\n"
        "rows = [(e.id, e.task, sorted(e.inputs.items()), e.reference, sorted(e.meta.items())) for e in ex]\n"
        "print(hashlib.sha256(json.dumps(rows, default=str).encode()).hexdigest())\n")
    src = str(Path(skipkv.__file__).parent.parent)
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == fingerprint(all_tasks(byte_tokenizer(), 0))


@pytest.mark.parametrize("style", ["chat", "raw"])
def test_lengths_are_model_tokens(bpe, style: str) -> None:
    for tok in (byte_tokenizer(), bpe):
        for length in (600, 1500, 4000):
            examples = (make_niah(tok, style, (length,), (0.0, 0.5, 1.0), 1, 0)
                        + make_variable_tracking(tok, style, (length,), 1, 0)
                        + make_niah(tok, style, (length,), (), 1, 0, num_distractors=3, name="niah_multikey"))
            for ex in examples:
                n = tokens(tok, ex, style)
                # cut to fit: never over, and within a couple of words of the target
                assert length - 12 <= n <= length, (ex.id, n)
                assert ex.meta["length"] == length
            if length < 1000 and tok is not bpe:
                # at a byte a token, the ten common words alone need more than 600 tokens
                with pytest.raises(SkipKVError, match="too short"):
                    make_common_words(tok, style, (length,), 1, 0)
                continue
            for ex in make_common_words(tok, style, (length,), 1, 0):
                n = tokens(tok, ex, style)
                # the list grows one word (times its frequency, with its numbers) at a time
                assert length - 17 * ex.meta["freq_uncommon"] <= n <= length, (ex.id, n)


def test_niah_needle_sits_at_its_depth() -> None:
    tok = byte_tokenizer()
    for ex in make_niah(tok, "raw", (2000,), (0.0, 0.25, 0.5, 0.75, 1.0), 1, 0):
        context = ex.inputs["context"]
        sentence = needle(ex.inputs["query"], ex.reference)
        assert context.count(sentence) == 1
        assert re.fullmatch(r"\d{7}", ex.reference)
        where = context.index(sentence) / max(1, len(context) - len(sentence))
        assert abs(where - ex.meta["depth"]) < 0.1, (ex.id, where)
        assert ContainsGrader().grade(f" {ex.reference}.", ex).correct


def test_multikey_has_distractors() -> None:
    tok = byte_tokenizer()
    for ex in make_niah(tok, "chat", (1500,), (), 3, 0, num_distractors=3, name="niah_multikey"):
        found = re.findall(r"One of the special magic numbers for (\S+) is: (\d{7})\.", ex.inputs["context"])
        assert len(found) == 4 and len({k for k, _ in found}) == 4 and len({v for _, v in found}) == 4
        assert dict(found)[ex.inputs["query"]] == ex.reference
        distractor = next(v for k, v in found if k != ex.inputs["query"])
        assert not ContainsGrader().grade(distractor, ex).correct


def test_variable_tracking_chain() -> None:
    tok = byte_tokenizer()
    for ex in make_variable_tracking(tok, "chat", (1500,), 3, 0):
        text = ex.inputs["context"]
        names, value = ex.reference, ex.inputs["query"]
        assert len(names) == 5 and ex.inputs["num_vars"] == 5
        positions = [text.index(f"VAR {names[0]} = {value}.")]
        positions += [text.index(f"VAR {b} = VAR {a}.") for a, b in zip(names, names[1:])]
        assert positions == sorted(positions)  # the chain reads in order
        assert ContainsGrader().grade(" ".join(names), ex).correct
        assert ContainsGrader().grade(" ".join(names[:3]), ex).score == pytest.approx(0.6)


def test_common_words_frequencies() -> None:
    tok = byte_tokenizer()
    for ex in make_common_words(tok, "chat", (1500, 4000), 2, 0):
        words = re.findall(r"\d+\. (\w+)", ex.inputs["context"])
        counts = collections.Counter(words)
        top = {w for w, _ in counts.most_common(10)}
        assert top == set(ex.reference)
        assert {counts[w] for w in ex.reference} == {ex.meta["freq_common"]}
        assert {c for w, c in counts.items() if w not in ex.reference} <= {ex.meta["freq_uncommon"]}
        assert ex.meta["freq_common"] >= ex.meta["freq_uncommon"] + 2


def test_insert_sentences_keeps_sentences_whole() -> None:
    text = "One two. Three four. Five six."
    assert insert_sentences(text, [(0.5, "X.")]) == "One two. X. Three four. Five six."
    assert insert_sentences(text, [(0.0, "X.")]) == "X. One two. Three four. Five six."
    assert insert_sentences(text, [(1.0, "X.")]) == "One two. Three four. Five six. X."


def test_dataset_classes_and_errors() -> None:
    tok = byte_tokenizer()
    niah = get_dataset("niah")
    req = DataRequest(lengths=(500,), depths=(0.5,), tokenizer=tok)
    assert [e.id for e in niah.load(req)] == ["niah-500-d050-0"]
    ident = niah.identity(req)
    assert ident["lengths"] == [500] and ident["depths"] == [0.5] and len(ident["haystack_sha256"]) == 64
    assert len(get_dataset("variable_tracking").load(DataRequest(lengths=(500,), per_length=3, tokenizer=tok))) == 3
    with pytest.raises(SkipKVError, match="too short"):
        make_niah(tok, "chat", (40,), (0.5,), 1, 0)
    with pytest.raises(SkipKVError, match="lengths must be"):
        niah.load(DataRequest(lengths=(40000,), tokenizer=tok))
    with pytest.raises(SkipKVError, match="depths"):
        niah.load(DataRequest(lengths=(500,), depths=(1.5,), tokenizer=tok))
    with pytest.raises(SkipKVError, match="tokenizer"):
        niah.load(DataRequest(lengths=(500,)))
    with pytest.raises(SkipKVError, match="niah only"):
        get_dataset("variable_tracking").load(DataRequest(lengths=(500,), depths=(0.5,), tokenizer=tok))
    with pytest.raises(SkipKVError, match="hub"):
        niah.load(DataRequest(lengths=(500,), source="hub", tokenizer=tok))


def test_custom_haystack(tmp_path: Path) -> None:
    hay = tmp_path / "hay.txt"
    hay.write_text("The cat sat on the mat. " * 200)
    ex = get_dataset("niah").load(DataRequest(data=str(hay), lengths=(600,), depths=(0.5,), tokenizer=byte_tokenizer()))
    assert "The cat sat on the mat." in ex[0].inputs["context"]
    assert "Paul" not in ex[0].inputs["context"]
