"""SkipKV: sentence-level eviction + adaptive steering (Tian et al., MLSys 2026, arXiv 2512.07993).

    skipkv generate --model random:qwen2 --policy skipkv --budget 64 --interval 16 --max-tokens 300 \\
        --ignore-eos --json "Hi."
    skipkv generate --model M --policy skipkv --budget 96 --steering v.safetensors "..."   # + steering

Score of each older token = the R-KV score (λ·importance − (1−λ)·redundancy, see rkv.py) minus
`sentence_weight` × the similarity of the flagged sentence holding it (research/algorithms.md §3.5–§3.7):
- a per-request tracker (skipkv/sentences) splits the stream, prompt included, into sentences that end with a
  delimiter token, and keeps each closed sentence's mean last-layer hidden state (normalised);
- at each decode-time compression, once per request (`before_compress`), the sentences closed since the
  previous compression are compared (cosine) with every earlier closed sentence; a pair above `tau` flags the
  EARLIER sentence with that similarity. Flags accumulate over the request; a sentence flagged again keeps the
  larger similarity (the reference overwrites it with the later one);
- every cached entry whose true position lies in a flagged sentence loses `sentence_weight · sim`, except in a
  head that holds fewer than `min_span_entries` (2) entries of that sentence: the reference subtracts over a
  sentence's local span only when start < end, so a one-token sentence, or one of which a single entry
  survived in that head, is never penalised. R-KV scores are ~1e-3, so with weight 1 a flagged sentence is
  evicted whole unless it is in the window.
- a compression at prefill is plain R-KV: no sentence is compared or flagged there (the reference has no
  flagged range before its first decode interval). The prompt's sentences are compared at the first decode
  compression like any other.
Kept indices are sorted (shared `protect_and_select`). Membership is decided from each entry's stored true
position, so there is no generation-space → cache-space span map to keep in sync (the reference's Φ).

Check labels (`check_words`, skipkv/sentences/tracker.py): `reference_ids` (default) is the reference's
token-id rule: the last token id of "Alternatively", "Wait", "again", the first one per forward chunk;
`reference` and `seal` match keywords on the sentence's text.

Steering (optional, `steering` = a file from `skipkv steer build`): α·v is added to the residual input of
`steering_layer` at "\\n\\n" tokens (see skipkv/steering/gate.py), α = alpha0 − gamma · (check sentences so far).
`alpha_update` says when α is recomputed:
- `interval` (default, the reference): every `interval` generated tokens (Δt), whether or not the request is
  over budget and compresses, so with a budget above the chain SkipKV + steering still adapts α (it is not
  SEAL). The first recomputation is after `interval` generated tokens; before it α = alpha0. Where the
  reference's step counter starts is not documented; counting generated tokens is our choice.
- `compression`: at each decode compression only (the behaviour before reference parity);
- `sentence`: at every token (the count is live, so α changes as soon as a check sentence closes).

`protect_prompt` (every policy's knob, policies/base.py): prompt entries are never evicted and `budget` counts
generated tokens only. Prompt sentences are still tracked, compared and can be flagged (flags on them have no
effect: the prompt is the request's sink).

Departures from the reference code (TTTTTTris/SkipKV, skipkv/compression/skipkv.py): no pads exist in our
slots, so there is no pad score of 100; the comparison runs once per request per compression (not per layer);
a sentence flagged twice keeps its largest similarity.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import ClassVar

import torch

from skipkv.config import knob
from skipkv.errors import SkipKVError
from skipkv.policies import POLICIES
from skipkv.policies.base import Observation, Policy
from skipkv.policies.rkv import RKV
from skipkv.sentences import REFERENCE_DELIMITERS, SentenceTracker, flag_earlier, parse_delimiters, span_penalty
from skipkv.sentences.tracker import CHECK_WORD_SETS, TablesByTokenizer
from skipkv.steering.gate import SteerState
from skipkv.steering.knobs import SteeringKnobs


@dataclass
class SkipKVState:
    """One request's sentence bookkeeping: the tracker, flags per closed sentence, steering state."""

    prompt_len: int
    tracker: SentenceTracker
    steer: SteerState | None
    processed: int = 0  # closed sentences already compared (at the last compression)
    flags: list[float] = field(default_factory=list)  # per closed sentence compared: similarity flagged with, or 0
    # Flagged spans as tensors for the per-layer lookup, rebuilt when flags change: starts, ends [F] int64, sims [F].
    flagged: tuple[torch.Tensor, torch.Tensor, torch.Tensor] = (torch.zeros(0, dtype=torch.long),
                                                                torch.zeros(0, dtype=torch.long), torch.zeros(0))


@dataclass(frozen=True)
class SentenceEviction(SteeringKnobs, Policy):
    """SkipKV's sentence machinery (tracker, flags, span penalty, steering) over any token score: the first base of
    a policy whose `base_score` it penalises (SkipKV: R-KV's; skipkv_tri.py: TriAttention's). Not registered."""

    tau: float = knob(0.95, "cosine above which the earlier of two sentences is flagged redundant", gt=0.0, le=1.0)
    sentence_weight: float = knob(1.0, "scale of the flagged-sentence penalty (1 = reference)", ge=0.0)
    delimiters: str = knob(REFERENCE_DELIMITERS, "sentence delimiter strings (space-separated, Python escapes); "
                           "mode ids uses the last token id of each")
    sentence_mode: str = knob("ids", "ids: delimiter token ids; text: any token whose text ends in a newline",
                              choices=("ids", "text"))
    check_words: str = knob("reference_ids", "check labels: reference_ids (token ids of Alternatively, Wait, again, "
                            "first per forward; the reference), reference (those words in the text) or seal",
                            choices=CHECK_WORD_SETS)
    min_span_entries: int = knob(2, "a flagged sentence is penalised in a head only if the head holds at least "
                                 "this many of its entries (2 = reference: spans with start >= end are skipped)",
                                 ge=1)
    gamma: float = knob(0.02, "gamma: steering coefficient change per check sentence", ge=0.0)
    alpha_update: str = knob("interval", "recompute alpha every interval generated tokens (reference), at each "
                             "compression, or at every token", choices=("interval", "compression", "sentence"))

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            delims = parse_delimiters(self.delimiters)
        except UnicodeDecodeError:
            raise SkipKVError(f"skipkv delimiters {self.delimiters!r} has a bad escape") from None
        if self.sentence_mode == "ids" and not all(delims):
            raise SkipKVError("skipkv delimiters must list at least one non-empty string")
        self._check_steering_file()

    @cached_property
    def _tables(self) -> TablesByTokenizer:
        """Lookup tables per tokenizer, built once per instance and shared by its requests."""
        return TablesByTokenizer(delimiters=self.delimiters, mode=self.sentence_mode, check_words=self.check_words,
                                 gate=bool(self.steering))

    # ------------------------------------------------------------------------------------ per request
    def init_state(self, prompt_ids: list[int], tokenizer) -> SkipKVState:
        tables = self._tables.get(tokenizer)
        return SkipKVState(len(prompt_ids), SentenceTracker(tables), self._steer_state(tables, prompt_ids))

    def observe(self, state: SkipKVState, token_ids: torch.Tensor, hidden: torch.Tensor) -> None:
        tr = state.tracker
        tr.observe(token_ids, hidden)
        generated = tr.next_pos - state.prompt_len  # generated tokens fed so far (decode feeds one per step)
        if (state.steer is not None and self.alpha_update == "interval" and generated > 0
                and generated % self.interval == 0):
            state.steer.alpha = self.alpha0 - self.gamma * tr.num_check

    def before_compress(self, states: list, is_prefill: bool) -> None:
        if is_prefill:  # plain R-KV at prefill (the reference flags nothing before its first interval)
            return
        for st in states:
            tr = st.tracker
            S = tr.num_closed
            if S > st.processed:
                new = flag_earlier(tr.representations(), st.processed, self.tau).tolist()
                st.flags = [max(a, b) for a, b in zip(st.flags + [0.0] * (S - len(st.flags)), new)]
                st.processed = S
                hit = [i for i, f in enumerate(st.flags) if f > 0]
                st.flagged = (torch.tensor([tr.starts[i] for i in hit], dtype=torch.long),
                              torch.tensor([tr.ends[i] for i in hit], dtype=torch.long),
                              torch.tensor([st.flags[i] for i in hit], dtype=torch.float32))
            if st.steer is not None and self.alpha_update == "compression":
                st.steer.alpha = self.alpha0 - self.gamma * tr.num_check

    def coefficient(self, state: SkipKVState) -> float:
        if self.alpha_update == "sentence":
            return self.alpha0 - self.gamma * state.tracker.num_check
        assert state.steer is not None  # the coefficient is only asked for when steering
        return state.steer.alpha

    # ------------------------------------------------------------------------------------ scoring
    def base_score(self, obs: Observation) -> torch.Tensor:
        """The token score the sentence penalty is taken from [b, H, n]."""
        raise NotImplementedError

    def score(self, obs: Observation) -> torch.Tensor:
        s = self.base_score(obs)  # [b, H, n]
        if self.sentence_weight == 0 or obs.states is None:
            return s
        for b, st in enumerate(obs.states):  # per request: each has its own flagged spans
            starts, ends, sims = st.flagged
            if starts.numel():
                pen = span_penalty(obs.positions[b], starts, ends, sims, self.min_span_entries)  # [H, n]
                s[b] -= self.sentence_weight * pen.to(s.dtype)
        return s

    # ------------------------------------------------------------------------------------ reporting
    def stats(self, state: SkipKVState) -> dict:
        tr = state.tracker
        # Chain redundancy independent of compression: generated sentences that a later sentence repeats at
        # cosine > tau, over the whole request (what flags a budget above the chain would never apply).
        late = flag_earlier(tr.representations(), 0, self.tau) if tr.num_closed > 1 else torch.zeros(0)
        out = {"sentences": tr.num_closed, "check_sentences": tr.num_check,
               "flagged_sentences": sum(1 for f in state.flags if f > 0),
               "redundant_sentences": sum(1 for i, f in enumerate(late.tolist())
                                          if f > 0 and tr.starts[i] >= state.prompt_len)}
        if state.steer is not None:
            out["steered_tokens"] = state.steer.steered
        return out

    def trace_state(self, state: SkipKVState) -> dict:
        """Sentences [[start, end, "check"|"other"], ...] and flagged ones [[start, end, sim], ...], true positions."""
        tr = state.tracker
        return {"sentences": [[s, e, "check" if c else "other"] for s, e, c in zip(tr.starts, tr.ends, tr.is_check)],
                "flagged": [[tr.starts[i], tr.ends[i], f] for i, f in enumerate(state.flags) if f > 0]}


@POLICIES.register("skipkv")
@dataclass(frozen=True)
class SkipKV(SentenceEviction, RKV):
    paper = "SkipKV (arXiv 2512.07993)"
    keeps = ("R-KV's score minus the similarity of redundant sentences (the earlier of two sentences whose mean "
             "last-layer hidden states have cosine > `tau`, 0.95): flagged sentences go first, whole; optional "
             "adaptive steering (`--steering FILE`)")

    needs: ClassVar[frozenset[str]] = frozenset({"queries", "hidden"})

    def base_score(self, obs: Observation) -> torch.Tensor:
        return RKV.score(self, obs)
