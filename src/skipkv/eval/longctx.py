"""Long-context datasets generated from the essay haystack: niah, niah_multikey, variable_tracking, common_words.

    skipkv eval --model qwen2.5-coder-0.5b-instruct --dataset niah --lengths 2048,4096 --depths 0,0.5,1 \\
        --policy snapkv --budget-ratio 0.2 --max-tokens 32 --out runs/niah
    make_niah(tokenizer, "chat", lengths=(1024,), depths=(0.5,), per_cell=1, seed=0)   # -> [Example]

These follow the RULER recipes (Hsieh et al. 2024, NVIDIA/RULER): a needle "One of the special magic
numbers for <key> is: <7 digits>." hidden at a depth of the essays (niah: a length x depth grid;
niah_multikey: the target plus distractor needles with other keys at random depths), a chain of
`VAR X = ...` assignments spread through the essays (variable_tracking), and a numbered word list in
which a few words are much more frequent (common_words; the vocabulary is the essays' own words, since
RULER's word list is not available offline).

A length is the number of prompt tokens in the model's tokenizer, the chat template and question
included: the haystack (or the word list) is cut so that the rendered prompt has at most that many
tokens, and as close to it as the tokenizer allows. Everything is a pure function of the seed, the
length, the cell and the example number (string-seeded `random.Random`), so the same command builds
the same prompts in any process. The haystack's starting essay rotates with the seed.
"""

from __future__ import annotations

import random
import re
import string
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, ClassVar

from skipkv.config import bounded, short
from skipkv.errors import SkipKVError
from skipkv.eval import prompts
from skipkv.eval.data import (
    DATASETS,
    DataRequest,
    Dataset,
    Example,
    packaged,
    read_jsonl,
    sha256_file,
)

HAYSTACK = "niah_paul_graham_essays.txt"
HAYSTACK_INDEX = "niah_paul_graham_essays_index.jsonl"
DEFAULT_LENGTHS = (1024, 2048, 4096, 8192, 16384, 32768)
MAX_LENGTH = 32768
MAX_PER_LENGTH = 10_000
MAX_EXAMPLES = 100_000


def load_essays(path: str | None = None) -> list[str]:
    """The packaged essays (split by their index), or one document read from `path`."""
    from skipkv.files import read_text

    if path:
        file = Path(path)
        if not file.is_file():
            raise SkipKVError(f"--data haystack file not found: {file}")
        return [read_text(file, "haystack")]
    text = read_text(packaged(HAYSTACK), "haystack")
    return [text[row["char_start"]:row["char_end"]] for row in read_jsonl(packaged(HAYSTACK_INDEX))]


def vocabulary(documents: Sequence[str]) -> list[str]:
    """Distinct lower-case words of 4-10 letters in the documents, sorted (a stable order to sample from)."""
    return sorted({w for doc in documents for w in re.findall(r"\b[a-z]{4,10}\b", doc)})


class Haystack:
    """Documents as token ids (tokenized lazily, one document at a time) and text windows of N tokens."""

    def __init__(self, documents: Sequence[str], tokenizer) -> None:
        if not any(d.strip() for d in documents):
            raise SkipKVError("the haystack is empty")
        self.documents = list(documents)
        self.tokenizer = tokenizer
        self._ids: dict[int, list[int]] = {}
        self._sep = self._encode("\n\n")

    def _encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def text(self, start: int, num_tokens: int) -> str:
        """`num_tokens` tokens of the documents, from document `start` on (wrapping), decoded."""
        ids: list[int] = []
        i = start
        while len(ids) < num_tokens:
            doc = i % len(self.documents)
            if doc not in self._ids:
                self._ids[doc] = self._encode(self.documents[doc])
            ids += self._ids[doc] + self._sep
            i += 1
        text = self.tokenizer.decode(ids[:num_tokens])
        if len(ids) > num_tokens:
            # The cut may split a word (or a multi-byte character, decoded as U+FFFD): end at the last whole word.
            cut = max(text.rfind(" "), text.rfind("\n"))
            text = text[:cut] if cut > 0 else text.rstrip("\ufffd")
        return text.strip()


def insert_sentences(context: str, items: Sequence[tuple[float, str]]) -> str:
    """Insert each (depth in [0, 1], sentence) at the sentence boundary at or before that fraction of the text."""
    cuts = []
    for order, (depth, sentence) in enumerate(items):
        pos = int(len(context) * depth)
        if 0 < pos < len(context):
            # Move back to just after the previous sentence end, so no sentence of the haystack is split.
            pos = max(context.rfind(". ", 0, pos) + 1, context.rfind("\n", 0, pos) + 1, 0)
        cuts.append((pos, order, sentence))
    # Insert from the back so that earlier positions stay valid. At a shared position the later item goes in
    # first, so the items read in the given order.
    for pos, _, sentence in sorted(cuts, reverse=True):
        left, right = context[:pos].rstrip(" "), context[pos:].lstrip(" ")
        before = " " if left and not left.endswith("\n") else ""
        after = " " if right and not right.startswith("\n") else ""
        context = left + before + sentence + after + right
    return context


def fit(build: Callable[[int], Example], count: Callable[[Example], int], target: int, start: int,
        per_unit: float = 1.0) -> Example:
    """The example from build(n) whose token count is largest without exceeding `target`.

    build(n) must grow with n (haystack tokens or list words); per_unit is the rough token cost of one n.
    Newton-style steps from `start`, then a bisection between the best fit and the first overshoot.
    """
    tried: dict[int, int] = {}

    def measure(n: int) -> int:
        if n not in tried:
            tried[n] = count(build(n))
        return tried[n]

    n = max(0, start)
    for _ in range(6):  # a few proportional steps get within a handful of tokens
        c = measure(n)
        if c == target:
            return build(n)
        nxt = max(0, n + int((target - c) / per_unit))
        if nxt == n or nxt in tried:
            break
        n = nxt
    under = [k for k, c in tried.items() if c <= target]
    over = [k for k, c in tried.items() if c > target]
    if not under:
        if measure(0) > target:
            raise SkipKVError(f"length {target} is too short: the prompt without filler already has "
                              f"{measure(0)} tokens")
        under = [0]
    lo = max(under)
    hi = min([k for k in over if k > lo], default=None)
    if hi is None:
        hi = lo + 1
        while measure(hi) <= target:  # grow until it overshoots (rare: only when the estimate was far off)
            lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if measure(mid) <= target else (lo, mid)
    return build(lo)


def _counter(tokenizer, style: str) -> Callable[[Example], int]:
    return lambda ex: len(prompts.encode(tokenizer, prompts.render(tokenizer, ex, style), style))


def _rng(*parts: Any) -> random.Random:
    # str seeds are hashed with SHA-512 by random.seed, so this is stable across processes and machines.
    return random.Random("|".join(map(str, parts)))


def _key(rng: random.Random, words: Sequence[str], taken: set[str]) -> str:
    while True:
        key = f"{rng.choice(words)}-{rng.choice(words)}"
        if key not in taken:
            taken.add(key)
            return key


def _value(rng: random.Random, taken: set[str]) -> str:
    while True:
        value = str(rng.randint(1_000_000, 9_999_999))
        if value not in taken:
            taken.add(value)
            return value


def needle(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def make_niah(tokenizer, style: str, lengths: Sequence[int], depths: Sequence[float], per_cell: int, seed: int,
              documents: Sequence[str] | None = None, num_distractors: int = 0, name: str = "niah") -> list[Example]:
    """Needle examples. Without distractors: one per (length, depth, i) cell, the needle at that depth.
    With distractors (niah_multikey): one per (length, i), every needle at a random depth; `depths` is ignored."""
    documents = documents if documents is not None else load_essays()
    # Keys are words of the packaged essays whatever the haystack, so a small custom haystack still works.
    hay, words, count = Haystack(documents, tokenizer), vocabulary(load_essays()), _counter(tokenizer, style)
    cells: list[tuple[float | None, int]] = [(d, i) for d in depths for i in range(per_cell)]
    if num_distractors:
        cells = [(None, i) for i in range(per_cell)]
    examples = []
    for length in lengths:
        for depth, i in cells:
            rng = _rng(name, seed, length, depth, i)
            start = rng.randrange(len(documents))
            keys: set[str] = set()
            values: set[str] = set()
            pairs = [(_key(rng, words, keys), _value(rng, values)) for _ in range(1 + num_distractors)]
            spots = [depth] if depth is not None else [rng.random() for _ in pairs]
            query, answer = pairs[0]
            meta = {"length": length, "depth": round(float(spots[0]), 4), "num_needles": len(pairs)}
            ident = f"{name}-{length}-d{round(depth * 100):03d}-{i}" if depth is not None else f"{name}-{length}-{i}"

            def build(n: int, start=start, pairs=pairs, spots=spots, query=query, answer=answer, meta=meta,
                      ident=ident) -> Example:
                context = insert_sentences(hay.text(start, n), [(s, needle(k, v)) for s, (k, v) in zip(spots, pairs)])
                return Example(ident, "niah", {"context": context, "query": query}, answer, meta)

            examples.append(fit(build, count, length, length - count(build(0))))
    return examples


def make_variable_tracking(tokenizer, style: str, lengths: Sequence[int], per_length: int, seed: int,
                           documents: Sequence[str] | None = None, num_hops: int = 4) -> list[Example]:
    """A chain `VAR A = 12345. VAR B = VAR A. ...` of num_hops + 1 variables spread in order through the essays;
    the answer is every variable name in the chain."""
    documents = documents if documents is not None else load_essays()
    hay, count = Haystack(documents, tokenizer), _counter(tokenizer, style)
    examples = []
    for length in lengths:
        for i in range(per_length):
            rng = _rng("variable_tracking", seed, length, i)
            start = rng.randrange(len(documents))
            names: list[str] = []
            while len(names) < num_hops + 1:
                var = "".join(rng.choices(string.ascii_uppercase, k=5))
                if var not in names:
                    names.append(var)
            value = str(rng.randint(10_000, 99_999))
            statements = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in zip(names, names[1:])]
            spots = sorted(rng.random() for _ in statements)
            inputs = {"query": value, "num_vars": len(names)}
            meta = {"length": length, "num_hops": num_hops}

            def build(n: int, start=start, statements=statements, spots=spots, inputs=inputs, names=names,
                      meta=meta, ident=f"variable_tracking-{length}-{i}") -> Example:
                context = insert_sentences(hay.text(start, n), list(zip(spots, statements)))
                return Example(ident, "variable_tracking", {"context": context, **inputs}, list(names), meta)

            examples.append(fit(build, count, length, length - count(build(0))))
    return examples


def make_common_words(tokenizer, style: str, lengths: Sequence[int], per_length: int, seed: int,
                      documents: Sequence[str] | None = None, num_common: int = 10, freq_common: int = 30,
                      freq_uncommon: int = 3) -> list[Example]:
    """A numbered list where `num_common` words appear `freq_common` times and as many other words as fit appear
    `freq_uncommon` times; the answer is the common words. For short lengths the common frequency drops (never
    below freq_uncommon + 2, so the answer stays unambiguous)."""
    documents = documents if documents is not None else load_essays()
    words, count = vocabulary(documents), _counter(tokenizer, style)
    if len(words) < num_common + 1:
        raise SkipKVError("the haystack has too few distinct words for common_words")
    examples = []
    for length in lengths:
        for i in range(per_length):
            rng = _rng("common_words", seed, length, i)
            pool = rng.sample(words, len(words))
            common, others = pool[:num_common], pool[num_common:]
            order_rng_state = rng.getstate()

            def build(n: int, freq: int, common=common, others=others, state=order_rng_state, length=length,
                      ident=f"common_words-{length}-{i}") -> Example:
                items = common * freq + others[:n] * freq_uncommon
                shuffler = random.Random()
                shuffler.setstate(state)  # the same shuffle stream for every n: build(n) is a pure function
                shuffler.shuffle(items)
                context = " ".join(f"{k + 1}. {w}" for k, w in enumerate(items))
                meta = {"length": length, "freq_common": freq, "freq_uncommon": freq_uncommon,
                        "num_uncommon": min(n, len(others))}
                return Example(ident, "common_words", {"context": context, "num_common": num_common},
                               list(common), meta)

            freq = freq_common
            # Shrink the common frequency until the common words alone take at most half the length.
            while freq > freq_uncommon + 2 and count(build(0, freq)) > length // 2:
                freq -= 1
            per_word = max(1.0, (count(build(num_common, freq)) - count(build(0, freq))) / num_common)
            ex = fit(partial(build, freq=freq), count, length, int((length - count(build(0, freq))) / per_word),
                     per_unit=per_word)
            if ex.meta["num_uncommon"] >= len(others):
                raise SkipKVError(f"common_words: the vocabulary ({len(words)} words) is too small for length {length}")
            examples.append(ex)
    return examples


class LongContextDataset(Dataset):
    """Shared plumbing: resolve lengths/depths/per_length defaults and the haystack; record them as identity."""

    long_context = True
    default_depths: ClassVar[tuple[float, ...]] = ()
    default_per_length: ClassVar[int] = 10

    def check(self, request: DataRequest) -> None:
        self.resolve(request, need_tokenizer=False)

    def resolve(self, request: DataRequest, need_tokenizer: bool = True) -> DataRequest:
        if request.source != "local":
            raise SkipKVError(f"{self.name} is generated locally from the haystack; --source hub does not apply")
        lengths = request.lengths or DEFAULT_LENGTHS
        bad = [n for n in lengths if not 0 < n <= MAX_LENGTH]
        if bad:
            raise SkipKVError(f"lengths must be in 1..{MAX_LENGTH} tokens, got {short(bad)}")
        if request.depths and not self.default_depths:
            raise SkipKVError(f"--depths applies to niah only; {self.name} places its items at random depths")
        depths = request.depths or self.default_depths
        if any(not 0.0 <= d <= 1.0 for d in depths):
            raise SkipKVError(f"depths must be fractions in [0, 1], got {list(depths)}")
        per_length = request.per_length if request.per_length is not None else self.default_per_length
        bounded(per_length, "per-length", 1, MAX_PER_LENGTH, "every example is generated and held in memory")
        cells = len(set(lengths)) * max(1, len(set(depths))) * per_length
        if cells > MAX_EXAMPLES:
            raise SkipKVError(f"lengths x depths x per-length is {cells} examples, at most {MAX_EXAMPLES} (every "
                              "example is generated and held in memory)")
        if need_tokenizer and request.tokenizer is None:
            raise SkipKVError(f"{self.name} needs the model's tokenizer (lengths are in its tokens)")
        return replace(request, lengths=tuple(lengths), depths=tuple(depths), per_length=per_length)

    def identity(self, request: DataRequest) -> dict[str, Any]:
        r = self.resolve(request)
        haystack = Path(r.data) if r.data else packaged(HAYSTACK)
        out: dict[str, Any] = {"source": "generated", "lengths": list(r.lengths), "per_length": r.per_length,
                               "seed": r.seed, "haystack": haystack.name, "haystack_sha256": sha256_file(haystack)}
        if r.depths and self.default_depths:
            out["depths"] = list(r.depths)
        return out


def _resolved(per_length: int | None) -> int:
    assert per_length is not None  # LongContextDataset.resolve fills it
    return per_length


@DATASETS.register("niah")
class NIAH(LongContextDataset):
    name = "niah"
    grader = "contains"
    max_new_tokens = 32
    default_depths = (0.0, 0.25, 0.5, 0.75, 1.0)
    default_per_length = 1  # per (length, depth) cell

    def load(self, request: DataRequest) -> list[Example]:
        r = self.resolve(request)
        return make_niah(r.tokenizer, r.prompt_style, r.lengths, r.depths, _resolved(r.per_length), r.seed,
                         load_essays(r.data))


@DATASETS.register("niah_multikey")
class NIAHMultiKey(LongContextDataset):
    name = "niah_multikey"
    grader = "contains"
    max_new_tokens = 32
    num_distractors = 3  # RULER niah_multikey_1: four keys in the essays, one asked for

    def load(self, request: DataRequest) -> list[Example]:
        r = self.resolve(request)
        return make_niah(r.tokenizer, r.prompt_style, r.lengths, (), _resolved(r.per_length), r.seed,
                         load_essays(r.data), num_distractors=self.num_distractors, name=self.name)


@DATASETS.register("variable_tracking")
class VariableTracking(LongContextDataset):
    name = "variable_tracking"
    grader = "contains"
    max_new_tokens = 48

    def load(self, request: DataRequest) -> list[Example]:
        r = self.resolve(request)
        return make_variable_tracking(r.tokenizer, r.prompt_style, r.lengths, _resolved(r.per_length), r.seed,
                                      load_essays(r.data))


@DATASETS.register("common_words")
class CommonWords(LongContextDataset):
    name = "common_words"
    grader = "contains"
    max_new_tokens = 128

    def load(self, request: DataRequest) -> list[Example]:
        r = self.resolve(request)
        return make_common_words(r.tokenizer, r.prompt_style, r.lengths, _resolved(r.per_length), r.seed,
                                 load_essays(r.data))
