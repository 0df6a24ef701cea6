"""Per-request streaming sentence tracker: boundaries, labels and mean last-layer hidden states.

    tables = TokenTables.build(tokenizer, delimiters=REFERENCE_DELIMITERS, mode="ids", check_words="reference_ids")
    tr = SentenceTracker(tables)
    tr.observe(token_ids, hidden)          # every forward: token_ids [T], hidden [T, E] (after the final norm)
    tr.starts, tr.ends, tr.is_check        # closed sentences, true positions [start, end] inclusive
    tr.representations()                   # [S, E] mean hidden per closed sentence, L2-normalised

Boundaries follow SkipKV's `check_punct_tokens_in_forward` (research/algorithms.md §3.2): a sentence ends
*with* its delimiter token, prompt sentences included, and the next one starts right after it. Delimiters are
the last token id of each delimiter string (mode "ids", the reference's trick), or every token whose decoded
text ends in a newline (mode "text", for tokenizers where the id trick misses merged tokens).

Memory: a closed sentence costs one normalised [E] vector plus three scalars; the open sentence keeps a
running [E] sum and its token ids (for the keyword label). No per-token hidden state is kept.

Labels (`check` / `other`), three modes (`check_words`):
- `reference_ids` (the default; SkipKV's `check_punct_tokens_in_forward`, research/algorithms.md §3.3): the
  check tokens are `tokenizer.encode(w)[-1]` for w in (Alternatively, Wait, again); in each forward only the
  FIRST check token of its chunk is recorded (so a prompt prefilled in one forward records at most one), and a
  sentence is `check` when a recorded position lies inside it. Like the reference, " Wait" after a space is a
  different token and is missed, and on a byte-level tokenizer the last byte of each word matches.
- `reference`: the same words matched as whole words, case-sensitive, on the sentence's decoded text.
- `seal`: SEAL's reflection and transition phrases on the text, case-insensitive like SEAL's recipe.

Per forward, the work is vectorised over its T tokens (one index_add for the sums); the only Python loop is
over the sentences that close in that forward (to decode their text for the label).
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass

import torch

# The reference's delimiter strings (last token id of each), written with Python escapes, space-separated.
REFERENCE_DELIMITERS = r"\n .\n )\n \n\n .\n\n )\n\n ?\n\n"
REFERENCE_CHECK_WORDS = ("Alternatively", "Wait", "again")
# SEAL's keyword recipe as replicated in EasySteer (research/algorithms.md §4); transition is checked first.
SEAL_TRANSITION = ("alternatively", "think differently", "another way", "another approach", "another method",
                   "another solution", "another strategy", "another technique")
SEAL_REFLECTION = ("wait", "verify", "make sure", "hold on", "think again", "'s correct", "'s incorrect",
                   "let me check", "seems right")
CHECK_WORD_SETS = ("reference_ids", "reference", "seal")


def parse_delimiters(spec: str) -> tuple[str, ...]:
    """'\\n .\\n' -> ('\\n', '.\\n'): space-separated strings with Python escapes (write a space as \\x20)."""
    out = tuple(codecs.decode(s, "unicode_escape") for s in spec.split())
    return out


def keyword_pattern(words: tuple[str, ...], ignore_case: bool) -> re.Pattern:
    """Whole-word match of any of `words` (a phrase starting/ending with a letter needs a non-letter beside it)."""
    alts = []
    for w in words:
        left = r"(?<![A-Za-z])" if w[:1].isalpha() else ""
        right = r"(?![A-Za-z])" if w[-1:].isalpha() else ""
        alts.append(left + re.escape(w) + right)
    return re.compile("|".join(alts), re.IGNORECASE if ignore_case else 0)


def check_pattern(check_words: str) -> re.Pattern:
    if check_words in ("reference", "reference_ids"):
        return keyword_pattern(REFERENCE_CHECK_WORDS, ignore_case=False)
    return keyword_pattern(SEAL_TRANSITION + SEAL_REFLECTION, ignore_case=True)


def classify_step(text: str) -> str:
    """SEAL's step classes: 'transition' (checked first), 'reflection', else 'execution' (case-insensitive)."""
    if keyword_pattern(SEAL_TRANSITION, True).search(text):
        return "transition"
    if keyword_pattern(SEAL_REFLECTION, True).search(text):
        return "reflection"
    return "execution"


def token_texts(tokenizer) -> list[str]:
    """Decoded text of every token id of `tokenizer` (one batched call)."""
    return tokenizer.batch_decode([[i] for i in range(len(tokenizer))], skip_special_tokens=False,
                                  clean_up_tokenization_spaces=False)


@dataclass(frozen=True)
class TokenTables:
    """Per-tokenizer lookup tables, built once per policy instance and shared by its requests.

    delimiter [V] bool: the token closes a sentence. Ids at or above V (a model vocabulary larger than the
    tokenizer's, as in random models) are never delimiters. check_ids [V] bool: the reference's check tokens
    (mode `reference_ids`), else None (labels come from the `check` pattern on the sentence's text). The steering gate's tables: has_nn (text contains
    "\\n\\n"), starts_nl / ends_nl (text starts / ends with "\\n"); think_open / think_close: ids of <think> and
    </think>, or None.
    """

    delimiter: torch.Tensor
    has_nn: torch.Tensor
    starts_nl: torch.Tensor
    ends_nl: torch.Tensor
    check: re.Pattern
    check_ids: torch.Tensor | None
    think_open: int | None
    think_close: int | None
    tokenizer: object

    @classmethod
    def build(cls, tokenizer, delimiters: str = REFERENCE_DELIMITERS, mode: str = "ids",
              check_words: str = "reference_ids", gate: bool = False) -> "TokenTables":
        """Decoding the whole vocabulary (seconds for 150K tokens) happens only when needed: text mode, or the
        steering gate's tables (`gate`); otherwise those tables are empty (every lookup is False)."""
        texts = token_texts(tokenizer) if (mode == "text" or gate) else []
        V = len(tokenizer)
        delim = torch.zeros(V, dtype=torch.bool)
        if mode == "ids":
            for s in parse_delimiters(delimiters):
                ids = tokenizer.encode(s, add_special_tokens=False)
                if ids:
                    delim[ids[-1]] = True
        else:
            delim = torch.tensor([t.endswith("\n") for t in texts], dtype=torch.bool)
        vocab = tokenizer.get_vocab()
        check_ids = None
        if check_words == "reference_ids":
            check_ids = torch.zeros(V, dtype=torch.bool)
            for w in REFERENCE_CHECK_WORDS:  # the reference's tokenizer.encode(w)[-1] (BOS or not, the last id)
                check_ids[tokenizer.encode(w, add_special_tokens=False)[-1]] = True
        return cls(delimiter=delim, check_ids=check_ids,
                   has_nn=torch.tensor([("\n\n" in t) for t in texts], dtype=torch.bool),
                   starts_nl=torch.tensor([t.startswith("\n") for t in texts], dtype=torch.bool),
                   ends_nl=torch.tensor([t.endswith("\n") for t in texts], dtype=torch.bool),
                   check=check_pattern(check_words), think_open=vocab.get("<think>"),
                   think_close=vocab.get("</think>"), tokenizer=tokenizer)

    def lookup(self, table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """table[token_ids] with ids outside the table mapped to False. token_ids [T] -> [T] bool."""
        ids = token_ids.to("cpu", torch.long)
        inside = ids < table.shape[0]
        return table[ids.clamp(max=table.shape[0] - 1)] & inside

    def is_check_text(self, ids: list[int]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        return self.check.search(text) is not None


class SentenceTracker:
    """Closed sentences of one request (true positions, labels, normalised mean hidden) + the open one."""

    def __init__(self, tables: TokenTables, start: int = 0) -> None:
        self.tables = tables
        self.starts: list[int] = []
        self.ends: list[int] = []
        self.is_check: list[bool] = []
        self._reps: list[torch.Tensor] = []  # chunks of [k, E] normalised means, concatenated on demand
        self.next_pos = start  # true position of the next token to observe
        self.open_start = start
        self.open_sum: torch.Tensor | None = None  # [E] running sum of the open sentence's hidden states
        self.open_count = 0
        self.open_ids: list[int] = []
        self.check_pos: list[int] = []  # reference_ids mode: recorded check-token positions not yet in a closed sentence

    @property
    def num_closed(self) -> int:
        return len(self.starts)

    @property
    def num_check(self) -> int:
        return sum(self.is_check)

    def observe(self, token_ids: torch.Tensor, hidden: torch.Tensor) -> int:
        """Feed one forward's real tokens: token_ids [T], hidden [T, E]. Returns how many sentences closed."""
        T = int(token_ids.shape[0])
        if T == 0:
            return 0
        acc = torch.promote_types(hidden.dtype, torch.float32)
        h = hidden.detach().to("cpu", acc)
        is_delim = self.tables.lookup(self.tables.delimiter, token_ids)  # [T]
        # Segment of each token: segment k holds the tokens after the k-th delimiter of this forward up to and
        # including the (k+1)-th; the delimiter closes its own segment.
        seg = torch.cumsum(is_delim.long(), 0) - is_delim.long()  # [T]
        closed = int(is_delim.sum())
        num_seg = closed + 1  # the last segment is the (possibly empty) new open sentence
        # Segment sums as one [num_seg, T] @ [T, E] product (index_add_ on CPU was ~1000x slower here).
        onehot = seg[None, :] == torch.arange(num_seg)[:, None]  # [num_seg, T]
        sums = onehot.to(acc) @ h  # [num_seg, E]
        counts = onehot.sum(dim=1)
        if self.open_sum is not None:
            sums[0] += self.open_sum
        counts[0] += self.open_count
        delim_idx = torch.nonzero(is_delim).flatten().tolist()
        ids = token_ids.tolist()
        by_ids = self.tables.check_ids is not None
        if by_ids:
            hits = torch.nonzero(self.tables.lookup(self.tables.check_ids, token_ids)).flatten()
            if hits.numel():  # the reference records only the first check token of a forward
                self.check_pos.append(self.next_pos + int(hits[0]))
        if closed:
            means = sums[:closed] / counts[:closed, None].to(acc)
            reps = means / (means.norm(dim=-1, keepdim=True) + 1e-8)
            self._reps.append(reps)
            prev = 0
            for k, d in enumerate(delim_idx):  # one iteration per closed sentence (text label)
                start = self.open_start if k == 0 else self.next_pos + prev
                sent_ids = (self.open_ids if k == 0 else []) + ids[prev:d + 1]
                self.starts.append(start)
                self.ends.append(self.next_pos + d)
                end = self.next_pos + d
                if by_ids:
                    self.is_check.append(any(start <= p <= end for p in self.check_pos))
                    self.check_pos = [p for p in self.check_pos if p > end]
                else:
                    self.is_check.append(self.tables.is_check_text(sent_ids))
                prev = d + 1
            self.open_start = self.next_pos + prev
            self.open_ids = ids[prev:]
        else:
            self.open_ids = self.open_ids + ids
        self.open_sum = sums[closed]
        self.open_count = int(counts[closed])
        self.next_pos += T
        return closed

    def representations(self) -> torch.Tensor:
        """[S, E] normalised mean hidden state of every closed sentence (S may be 0: then [0, 0])."""
        if not self._reps:
            return torch.zeros(0, 0)
        if len(self._reps) > 1:
            self._reps = [torch.cat(self._reps)]
        return self._reps[0]
