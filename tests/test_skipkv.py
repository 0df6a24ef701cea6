"""SkipKV: the sentence tracker, redundancy flags and span penalty against naive loops; the policy end to end."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch

from conftest import PROMPTS
from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine import make_requests
from skipkv.engine.runner import ModelRunner
from skipkv.models import load_model
from skipkv.models.patches import routed
from skipkv.models.random import byte_tokenizer
from skipkv.policies.base import Observation
from skipkv.sentences import SentenceTracker, TokenTables, flag_earlier, span_penalty
from skipkv.sentences.tracker import REFERENCE_CHECK_WORDS, SEAL_REFLECTION, SEAL_TRANSITION


@pytest.fixture(scope="module")
def sharp():
    return load_model("random:qwen2:sharp", dtype="fp64")


# ------------------------------------------------------------------------------------------- tracker
def naive_sentences(tok, ids: list[int], hidden: torch.Tensor, delim_of, words, ignore_case: bool):
    """Per-token loop: closed sentences (start, end, is_check, normalised mean) and the open one's start."""
    out, start, acc = [], 0, []
    for p, t in enumerate(ids):
        acc.append(p)
        if delim_of(t):
            text = tok.decode(ids[start:p + 1])
            flags = re.IGNORECASE if ignore_case else 0
            check = any(re.search(r"(?<![A-Za-z])" + re.escape(w) + (r"(?![A-Za-z])" if w[-1].isalpha() else ""),
                                  text, flags) for w in words)
            m = hidden[start:p + 1].mean(dim=0)
            out.append((start, p, check, m / (m.norm() + 1e-8)))
            start, acc = p + 1, []
    return out, start


def random_stream(tok, n: int, rng: random.Random, words) -> list[int]:
    pieces = ["\n", ".", " ", "ab", "x", "\n\n", "Waiting", "again.", "gain"] + list(words) + [" " + w for w in words]
    ids: list[int] = []
    while len(ids) < n:
        ids += tok.encode(rng.choice(pieces), add_special_tokens=False)
    return ids[:n]


@pytest.mark.parametrize("mode,delims,check_words", [
    ("ids", r"\n .\n )\n \n\n .\n\n )\n\n ?\n\n", "reference"),
    ("ids", r"\n . \x20", "seal"),
    ("text", r"\n", "reference"),
])
def test_tracker_matches_naive_loop(mode, delims, check_words):
    tok = byte_tokenizer()
    tables = TokenTables.build(tok, delims, mode, check_words)
    words = REFERENCE_CHECK_WORDS if check_words == "reference" else SEAL_TRANSITION + SEAL_REFLECTION
    rng = random.Random(0)
    torch.manual_seed(0)
    if mode == "ids":
        from skipkv.sentences import parse_delimiters

        dset = {tok.encode(s, add_special_tokens=False)[-1] for s in parse_delimiters(delims)}
        delim_of = dset.__contains__
    else:
        delim_of = lambda t: tok.decode([t]).endswith("\n")  # noqa: E731
    for _ in range(4):
        ids = random_stream(tok, 300, rng, words)
        hidden = torch.randn(len(ids), 16, dtype=torch.float64)
        tr = SentenceTracker(tables)
        # A "prefill" of random length, chunks, then single "decode" tokens: sentences span chunk borders.
        cuts = sorted(rng.sample(range(1, 200), 5)) + list(range(200, len(ids)))
        prev = 0
        for c in cuts + [len(ids)]:
            tr.observe(torch.tensor(ids[prev:c]), hidden[prev:c])
            prev = c
        want, open_start = naive_sentences(tok, ids, hidden, delim_of, words, check_words == "seal")
        assert len(want) > 5
        assert tr.starts == [w[0] for w in want]
        assert tr.ends == [w[1] for w in want]
        assert tr.is_check == [w[2] for w in want]
        assert any(tr.is_check) and not all(tr.is_check)
        torch.testing.assert_close(tr.representations(), torch.stack([w[3] for w in want]))
        assert tr.open_start == open_start and tr.next_pos == len(ids)
        # The open sentence's running sum is exactly what its tokens contributed.
        torch.testing.assert_close(tr.open_sum, hidden[open_start:].sum(dim=0))


def test_tracker_ignores_ids_past_the_tokenizer():
    tok = byte_tokenizer()
    tr = SentenceTracker(TokenTables.build(tok))
    nl = tok.encode("\n")[-1]
    tr.observe(torch.tensor([500, 3, nl, 400, nl]), torch.randn(5, 4, dtype=torch.float64))
    assert list(zip(tr.starts, tr.ends)) == [(0, 2), (3, 4)]


# ------------------------------------------------------------------------------------------- redundancy
def naive_flags(reps: torch.Tensor, first_new: int, tau: float) -> torch.Tensor:
    out = torch.zeros(reps.shape[0], dtype=reps.dtype)
    for i in range(first_new, reps.shape[0]):
        for j in range(i):
            s = float(reps[i] @ reps[j])
            if s > tau:
                out[j] = max(out[j], s)  # the EARLIER sentence is flagged
    return out


def test_flag_earlier_matches_naive_loop():
    torch.manual_seed(1)
    for S, first_new in ((12, 0), (12, 7), (30, 29), (5, 5)):
        base = torch.randn(4, 8, dtype=torch.float64)
        reps = base[torch.randint(0, 4, (S,))] + 0.2 * torch.randn(S, 8, dtype=torch.float64)  # planted near-duplicates
        reps = reps / reps.norm(dim=-1, keepdim=True)
        got = flag_earlier(reps, first_new, 0.9)
        want = naive_flags(reps, first_new, 0.9)
        torch.testing.assert_close(got, want)
        if S - first_new > 1:
            assert (want > 0).any()


def naive_penalty(positions: torch.Tensor, spans: list[tuple[int, int, float]], min_entries: int = 1) -> torch.Tensor:
    """Per entry the sim of its span, counted only in rows (last dim) holding >= min_entries of the span."""
    out = torch.zeros(positions.shape, dtype=torch.float32)
    rows = positions.reshape(-1, positions.shape[-1])
    flat = out.view(-1, positions.shape[-1])
    for r in range(rows.shape[0]):
        for s, e, v in spans:
            members = [j for j in range(rows.shape[1]) if s <= int(rows[r, j]) <= e]
            if len(members) >= min_entries:
                for j in members:
                    flat[r, j] = v
    return out


def test_span_penalty_matches_naive_loop():
    torch.manual_seed(2)
    spans = [(0, 3, 0.97), (10, 10, 0.99), (15, 30, 0.96), (44, 50, 1.0)]
    starts, ends, sims = (torch.tensor([s[i] for s in spans]) for i in range(3))
    # Per head a different sorted subset of positions (what compaction leaves).
    positions = torch.stack([torch.randperm(60)[:25].sort().values for _ in range(3)]).to(torch.int32)  # [H, n]
    torch.testing.assert_close(span_penalty(positions, starts, ends, sims.float()), naive_penalty(positions, spans))
    for m in (2, 3):
        torch.testing.assert_close(span_penalty(positions, starts, ends, sims.float(), m),
                                   naive_penalty(positions, spans, m))


def _state(policy, tok, spans):
    st = policy.init_state([1, 2, 3], tok)
    st.flagged = (torch.tensor([s for s, _, _ in spans]), torch.tensor([e for _, e, _ in spans]),
                  torch.tensor([v for _, _, v in spans]))
    return st


def test_skipkv_score_is_rkv_minus_weighted_penalty():
    torch.manual_seed(3)
    tok = byte_tokenizer()
    b, Hq, H, n, D, w = 2, 4, 2, 40, 8, 4
    positions = torch.stack([torch.stack([torch.randperm(90)[:n].sort().values for _ in range(H)]) for _ in range(b)])
    obs = dict(layer=0, keys=torch.randn(b, H, n, D), values=torch.randn(b, H, n, D),
               positions=positions.to(torch.int32),
               queries=torch.randn(b, Hq, w, D), attn=None, module=None, is_prefill=False)
    spans = [[(0, 9, 0.97), (20, 40, 0.99)], [(5, 5, 0.96), (50, 80, 1.0)]]
    policy = make_policy("skipkv", budget=24, window=w, sentence_weight=0.5)
    rkv = make_policy("rkv", budget=24, window=w)
    states = [_state(policy, tok, s) for s in spans]
    got = policy.score(Observation(**obs, states=states))
    want = rkv.score(Observation(**obs))
    for i in range(b):
        want[i] -= 0.5 * naive_penalty(positions[i], spans[i], min_entries=2)  # the reference skips start >= end
    torch.testing.assert_close(got, want)


# ------------------------------------------------------------------------------------------- reference parity
def test_one_token_and_single_survivor_sentences_are_not_penalised():
    """The reference subtracts a flagged sentence's similarity over its local span only when start < end: a
    one-token sentence, or a sentence with one surviving entry in a head, keeps its R-KV score there."""
    tok = byte_tokenizer()
    H, D = 2, 8
    positions = torch.tensor([[[0, 1, 2, 5, 6, 7, 9, 10]], [[0, 2, 5, 6, 7, 8, 9, 11]]]).reshape(1, H, 8)
    obs = dict(layer=0, keys=torch.randn(1, H, 8, D), values=torch.randn(1, H, 8, D),
               positions=positions.to(torch.int32), queries=torch.randn(1, 2 * H, 4, D), attn=None, module=None,
               is_prefill=False)
    spans = [(1, 2, 0.97), (5, 5, 0.99), (9, 11, 0.96)]  # (5, 5): one token; (1, 2): one entry left in head 1
    policy = make_policy("skipkv", budget=4, window=2)
    rkv = make_policy("rkv", budget=4, window=2).score(Observation(**obs))
    diff = (rkv - policy.score(Observation(**obs, states=[_state(policy, tok, spans)])))[0]
    want = torch.tensor([[0, 0.97, 0.97, 0, 0, 0, 0.96, 0.96], [0, 0, 0, 0, 0, 0, 0.96, 0.96]])
    torch.testing.assert_close(diff, want.to(diff.dtype))
    old = make_policy("skipkv", budget=4, window=2, min_span_entries=1)  # every member penalised
    diff1 = (rkv - old.score(Observation(**obs, states=[_state(old, tok, spans)])))[0]
    assert float(diff1[0, 3]) == pytest.approx(0.99) and float(diff1[1, 1]) == pytest.approx(0.97)


def test_prefill_compression_is_plain_rkv(sharp):
    """A prompt compressed at prefill is scored by R-KV alone (no sentence is compared or flagged there), so
    with compression at prefill only SkipKV is R-KV token for token, though its sentences would be flagged."""
    sp = SamplingParams(max_new_tokens=12, ignore_eos=True)
    long_prompts = [p * 4 for p in PROMPTS]
    rkv = generate(sharp, long_prompts, sp, make_policy("rkv", budget=12, window=4, phase="prefill"))
    skv = generate(sharp, long_prompts, sp, make_policy("skipkv", budget=12, window=4, phase="prefill", **SENT))
    assert all(r.compressions == 1 for r in skv)
    assert [r.token_ids for r in skv] == [r.token_ids for r in rkv]
    assert sum(r.extra["redundant_sentences"] for r in skv) + sum(r.extra["sentences"] for r in skv) > 0
    policy = make_policy("skipkv", budget=12, window=4, **SENT)
    st = policy.init_state([1], byte_tokenizer())
    nl = byte_tokenizer().encode("\n")[-1]
    st.tracker.observe(torch.tensor([5, nl, 5, nl]), torch.ones(4, 8, dtype=torch.float64))
    policy.before_compress([st], is_prefill=True)
    assert st.flags == [] and st.processed == 0  # compared at the first decode compression instead
    policy.before_compress([st], is_prefill=False)
    assert st.flags[0] == pytest.approx(1.0)


def naive_reference_checks(ids: list[int], chunks: list[int], check_ids: set[int], delim: set[int]) -> list[bool]:
    """The reference's labels: per forward chunk the first check token's position; a closed sentence is
    'Check' if a recorded position lies in it."""
    recorded, pos = [], 0
    for n in chunks:
        hit = next((pos + i for i, t in enumerate(ids[pos:pos + n]) if t in check_ids), None)
        if hit is not None:
            recorded.append(hit)
        pos += n
    labels, start = [], 0
    for p, t in enumerate(ids):
        if t in delim:
            labels.append(any(start <= q <= p for q in recorded))
            start = p + 1
    return labels


def test_reference_ids_labels_match_the_reference_rule():
    tok = byte_tokenizer()
    tables = TokenTables.build(tok, r"\n", "ids", "reference_ids")
    check_ids = {tok.encode(w, add_special_tokens=False)[-1] for w in REFERENCE_CHECK_WORDS}
    delim = {tok.encode("\n", add_special_tokens=False)[-1]}
    rng = random.Random(5)
    ids = random_stream(tok, 300, rng, REFERENCE_CHECK_WORDS)
    # A prefill chunk with two check sentences: only the first is labelled (first check token per forward).
    head = tok.encode("Wait a\nWait b\n", add_special_tokens=False)
    ids = head + ids
    chunks = [len(head)] + [1] * (len(ids) - len(head))  # prefill, then decode one token per forward
    tr = SentenceTracker(tables)
    at = 0
    for n in chunks:
        tr.observe(torch.tensor(ids[at:at + n]), torch.randn(n, 4, dtype=torch.float64))
        at += n
    want = naive_reference_checks(ids, chunks, check_ids, delim)
    assert tr.is_check == want
    assert tr.is_check[:2] == [True, False] and sum(want) > 3
    assert make_policy("skipkv", budget=24).check_words == "reference_ids"  # the default


def test_alpha_follows_the_interval_schedule_without_compressing(tiny, tmp_path):
    """alpha = alpha0 - gamma * checks is recomputed every `interval` generated tokens although nothing is
    evicted (budget above the chain); alpha_update=compression never moves it then."""
    from test_steering import write_vector

    vec = write_vector(tmp_path / "v.safetensors")
    tok = tiny.tokenizer
    text = "Wait a\nb\nWait c\nd\n" * 3
    ids = tok.encode(text, add_special_tokens=False)
    for mode in ("interval", "compression"):
        policy = make_policy("skipkv", budget=512, window=4, interval=8, steering=vec, alpha0=-1.0, gamma=0.25,
                             alpha_update=mode, check_words="reference")
        st = policy.init_state([1, 2, 3], tok)
        policy.observe(st, torch.tensor([1, 2, 3]), torch.randn(3, 8, dtype=torch.float64))
        seen = []
        for k, t in enumerate(ids, start=1):
            policy.observe(st, torch.tensor([t]), torch.randn(1, 8, dtype=torch.float64))
            seen.append(policy.coefficient(st.steer and st))
            if mode == "interval":
                checks = sum(1 for s in tok.decode(ids[:k - k % 8]).split("\n")[:-1] if "Wait" in s)
                assert seen[-1] == pytest.approx(-1.0 - 0.25 * (checks if k >= 8 else 0))
        if mode == "compression":
            assert set(seen) == {-1.0}
        else:
            assert min(seen) < -1.0


def test_before_compress_compares_new_sentences_once_and_keeps_the_max():
    tok = byte_tokenizer()
    policy = make_policy("skipkv", budget=24, window=4, tau=0.9)
    st = policy.init_state([1], tok)
    nl = tok.encode("\n")[-1]
    a, c = torch.zeros(8, dtype=torch.float64), torch.zeros(8, dtype=torch.float64)
    a[0], c[1] = 1.0, 1.0
    a2 = a.clone()
    a2[1] = 0.3  # cos(a, a2) ~ 0.958
    # Sentences: [a a \n] [c \n] [a \n]: the third repeats the first, so the first is flagged (earlier one).
    ids = [5, 5, nl, 6, nl, 5, nl]
    hid = torch.stack([a, a, a, c, c, a, a])
    st.tracker.observe(torch.tensor(ids), hid)
    policy.before_compress([st], is_prefill=False)
    assert st.flags == [pytest.approx(1.0), 0.0, 0.0]
    assert st.flagged[0].tolist() == [0] and st.flagged[1].tolist() == [2]
    # Nothing new: a second call changes nothing.
    policy.before_compress([st], is_prefill=False)
    assert st.processed == 3 and st.flags[0] == pytest.approx(1.0)
    # A new sentence close to the first at 0.958 flags it again; the first keeps its max (1.0), the third gets 0.958.
    st.tracker.observe(torch.tensor([5, nl]), torch.stack([a2, a2]))
    policy.before_compress([st], is_prefill=False)
    assert st.flags[0] == pytest.approx(1.0) and st.flags[2] == pytest.approx(float(a @ a2 / a2.norm()))
    assert st.flags[1] == 0.0 and st.flags[3] == 0.0
    assert policy.stats(st) == {"sentences": 4, "check_sentences": 0, "flagged_sentences": 2,
                                "redundant_sentences": 1}  # sentence 0 starts inside the 1-token prompt
    assert policy.trace_state(st)["flagged"][0][:2] == [0, 2]


# ------------------------------------------------------------------------------------------- end to end
SENT = dict(delimiters=r"\n . \x20", tau=0.5)  # many sentences and flags on a random model


def test_batch_equals_singles_with_flags(tiny, sharp):
    sps = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (40, 45, 30, 60)]  # slots move as they finish
    for bundle in (tiny, sharp):
        policy = make_policy("skipkv", budget=24, window=4, interval=8, **SENT)
        batched = generate(bundle, PROMPTS, sps, policy, EngineConfig(batch_size=4))
        assert sum(r.extra["flagged_sentences"] for r in batched) > 0
        for prompt, sp, res in zip(PROMPTS, sps, batched):
            alone = generate(bundle, [prompt], sp, policy)[0]
            assert res.token_ids == alone.token_ids
            assert res.extra == alone.extra
            assert res.compressions == alone.compressions > 0


def test_penalty_changes_what_is_kept(sharp):
    """Weight 0 is exactly R-KV; with the penalty the sharp model keeps other tokens (and says other things)."""
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    rkv = generate(sharp, PROMPTS, sp, make_policy("rkv", budget=24, window=4, interval=8), EngineConfig(batch_size=4))
    off = generate(sharp, PROMPTS, sp,
                   make_policy("skipkv", budget=24, window=4, interval=8, sentence_weight=0.0, **SENT),
                   EngineConfig(batch_size=4))
    on = generate(sharp, PROMPTS, sp, make_policy("skipkv", budget=24, window=4, interval=8, **SENT),
                  EngineConfig(batch_size=4))
    assert [r.token_ids for r in off] == [r.token_ids for r in rkv]
    assert [r.token_ids for r in on] != [r.token_ids for r in rkv]


def test_flagged_sentences_are_evicted_first(sharp):
    """After every compression no flagged entry outside the window survives while an unflagged candidate of
    the same head was evicted (flags ~0.5..1 dwarf R-KV scores); flagged spans with a single entry in the head
    are exempt, as in the reference."""
    policy = make_policy("skipkv", budget=24, window=4, interval=8, **SENT)
    reqs = make_requests(sharp, PROMPTS[1:3], SamplingParams(max_new_tokens=40, ignore_eos=True), policy)
    runner = ModelRunner(sharp, policy, num_slots=2)
    store, checked = runner.store, 0
    with routed(sharp.model), torch.inference_mode():
        for r, t in zip(reqs, runner.prefill(reqs)):
            r.output_ids.append(t)
        for _ in range(39):
            before = {id(r): (r.compressions, torch.stack([p[s, :, :int(store.lengths[0, s])] for p in store.pos]))
                      for s, r in enumerate(runner.running)}
            for r, t in zip(list(runner.running), runner.decode()):
                r.output_ids.append(t)
            for s, r in enumerate(runner.running):
                count, old = before[id(r)]
                if r.compressions == count or not r.state.flagged[0].numel():
                    continue
                n = int(store.lengths[0, s])
                new = torch.stack([p[s, :, :n] for p in store.pos])
                starts, ends, sims = r.state.flagged
                window_from = r.next_position - policy.window
                for l in range(new.shape[0]):
                    for h in range(new.shape[1]):
                        kept = set(new[l, h].tolist())
                        cands = [p for p in old[l, h].tolist() if p < window_from]
                        held = old[l, h]  # a span is penalised in a head holding >= 2 of its entries
                        big = [(a, e) for a, e in zip(starts.tolist(), ends.tolist())
                               if int(((held >= a) & (held <= e)).sum()) >= 2]
                        flagged = {p for p in cands if any(a <= p <= e for a, e in big)}
                        evicted_clean = [p for p in cands if p not in kept and p not in flagged]
                        if evicted_clean:
                            assert not (flagged & kept), "a flagged entry outlived an unflagged one"
                        checked += 1
    assert checked > 0


def test_protect_prompt_keeps_the_prompt_and_grows_capacity(tiny):
    policy = make_policy("skipkv", budget=16, window=4, interval=8, protect_prompt=True)
    sp = SamplingParams(max_new_tokens=40, ignore_eos=True)
    reqs = make_requests(tiny, PROMPTS[1:2], sp, policy)
    P = reqs[0].prompt_len
    runner = ModelRunner(tiny, policy, num_slots=1)
    store = runner.store
    with routed(tiny.model), torch.inference_mode():
        for r, t in zip(reqs, runner.prefill(reqs)):
            r.output_ids.append(t)
        assert int(store.lengths[0, 0]) == P and reqs[0].compressions == 0  # nothing compressed at prefill
        for _ in range(39):
            c = reqs[0].compressions
            for r, t in zip(list(runner.running), runner.decode()):
                r.output_ids.append(t)
            n = int(store.lengths[0, 0])
            assert n <= P + 16 + 8
            if reqs[0].compressions > c:
                assert n == P + 16
                pos = torch.stack([p[0, :, :n] for p in store.pos])
                assert (pos[..., :P] == torch.arange(P, dtype=torch.int32)).all()
    assert reqs[0].compressions > 0
    res = generate(tiny, PROMPTS[1:2], sp, policy)[0]
    assert res.peak_kv_tokens == P + 16 + 8


@pytest.mark.parametrize("knobs,msg", [
    (dict(tau=0.0), "tau must be > 0"),
    (dict(tau=1.5), "tau must be <= 1"),
    (dict(protect_prompt=True, phase="prefill"), "protect_prompt"),
    (dict(sentence_mode="words"), "sentence_mode must be one of"),
    (dict(steering="/nonexistent/v.safetensors"), "steering file not found"),
])
def test_bad_knobs(knobs, msg):
    from skipkv.errors import SkipKVError

    with pytest.raises(SkipKVError, match=re.escape(msg)):
        make_policy("skipkv", budget=24, window=4, **knobs)


def test_cli_json_records_carry_sentence_stats(capsys):
    from skipkv.cli import main

    code = main(["generate", "--model", "random:qwen2", "--policy", "skipkv", "--budget", "24", "--window", "4",
                 "--interval", "8", "--max-new-tokens", "20", "--ignore-eos", "--json", "Hello there.", "Hi."])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and len(out) == 2
    for line in out:
        row = json.loads(line)
        assert {"flagged_sentences", "check_sentences", "sentences"} <= set(row) and "extra" not in row
        assert row["sentences"] >= 2  # the chat template's newlines close prompt sentences


def test_results_config_expands():
    """benchmarks/results_skipkv.yaml: per-dataset limits and per-entry budgets (analysis cells) expand as meant."""
    from pathlib import Path

    from skipkv.sweep import load_sweep

    _, cells = load_sweep(Path(__file__).parent.parent / "benchmarks" / "results_skipkv.yaml")
    limits = {(c["dataset"], c["limit"]) for c in cells}
    assert limits == {("gsm8k", 200), ("math500", 100)}
    by_label = {}
    for c in cells:
        if c["dataset"] == "gsm8k":
            by_label.setdefault(c["name"].rsplit("-b", 1)[0] if c["budget"] else c["name"], []).append(c["budget"])
    assert by_label["skipkv"] == by_label["rkv"] == [64, 80, 96, 128, 192]
    assert by_label["skipkv-protect"] == by_label["rkv-protect"] == [64, 80]
    assert by_label["skipkv-tau0.9"] == by_label["skipkv-tau0.98"] == [80]
    assert "seal-s0" in by_label and len(cells) == 66
