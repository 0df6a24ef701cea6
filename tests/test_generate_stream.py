"""`skipkv generate` streams one prompt's text to a terminal as tokens come, and the incremental detokeniser
under it adds up to exactly the non-streamed text.

    python -m pytest tests/test_generate_stream.py -q

The terminal tests run the CLI in a subprocess whose stdout is a pseudo-terminal (raw mode, so the bytes read
back are the bytes written) and time when its text arrives.
"""

from __future__ import annotations

import json
import os
import pty
import select
import subprocess
import sys
import time
import tty

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models
from transformers import PreTrainedTokenizerFast

from skipkv.engine.detokenize import BYTE_PIECE, TextStream
from skipkv.models.random import byte_tokenizer

# --------------------------------------------------------------------------------- the detokeniser


def sentencepiece_tokenizer() -> PreTrainedTokenizerFast:
    """A Llama-style tokenizer built in process: '▁' marks a space, bytes fall back to <0xNN> pieces, and the
    decoder strips the leading space of the text, so a token's text depends on whether a token precedes it."""
    pieces = ["<unk>", "<s>", "</s>", "▁", "▁hello", "▁world", "hello", "lo", ",", ".", "▁中", "文", "▁\u00e9t\u00e9"]
    pieces += [f"<0x{b:02X}>" for b in (0xE4, 0xB8, 0xAD, 0xF0, 0x9F, 0x98, 0x80, 0xC3, 0xA9, 0xFF, 0x41)]
    tok = Tokenizer(models.WordLevel({p: i for i, p in enumerate(pieces)}, unk_token="<unk>"))
    # Llama 2's decoder, as its tokenizer.json spells it.
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


TOKENIZERS = {"bytes": byte_tokenizer(), "sentencepiece": sentencepiece_tokenizer()}


def final_text(tok, ids: list[int], stop: tuple[str, ...]) -> str:
    """The non-streamed text, as engine.make_result makes it: decode all, cut at the first stop string."""
    text = tok.decode(ids, skip_special_tokens=True)
    cut = [text.find(s) for s in stop if s in text]
    return text[: min(cut)] if cut else text


@settings(max_examples=300, deadline=None)
@given(name=st.sampled_from(sorted(TOKENIZERS)), data=st.data(),
       stop=st.sampled_from([(), ("lo",), ("\u00e9",), ("A,", "o w")]))
def test_deltas_are_always_a_prefix_of_the_final_text(name, data, stop):
    """Printed so far is a prefix of the final text after every token (so no partial character is ever
    printed: an incomplete UTF-8 sequence decodes to U+FFFD, which the final text does not have there), and the
    deltas plus `finish` equal it exactly."""
    tok = TOKENIZERS[name]
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), max_size=40))
    final = final_text(tok, ids, stop)
    ts = TextStream(tok, stop)
    printed = ""
    for i, t in enumerate(ids):
        printed += ts.add([t])
        assert final.startswith(printed), (ids[: i + 1], printed, final)
        sofar = tok.decode(ids[: i + 1], skip_special_tokens=True)
        # The newest piece that is not a (skipped) special token: while it is a byte piece, a later byte piece
        # can still change the text of the run.
        last = next((tok.convert_ids_to_tokens(x) for x in reversed(ids[: i + 1]) if x not in tok.all_special_ids), "")
        if not stop and not sofar.endswith("\ufffd") and not BYTE_PIECE.fullmatch(last):
            assert printed == sofar  # nothing held back once the text so far cannot change
    printed += ts.finish(final)
    assert printed == final


@pytest.mark.parametrize("name", sorted(TOKENIZERS))
def test_multibyte_and_context_dependent_tokens(name):
    tok = TOKENIZERS[name]
    if name == "bytes":
        ids = tok("a中😀é", add_special_tokens=False)["input_ids"]  # one token per byte: 1 + 3 + 4 + 2
        want = ["a", "", "", "中", "", "", "", "😀", "", "é"]
    else:
        v = tok.get_vocab()
        ids = [v[p] for p in ["▁hello", "▁world", "<0xE4>", "<0xB8>", "<0xAD>", "▁", "<0xC3>", "<0xA9>", "."]]
        # The first "▁hello" prints without its space (the decoder strips the text's first), the second
        # with it; 中 comes from three byte pieces and prints once, whole, when a piece that is not a byte
        # closes the run (another byte piece could still turn the run into U+FFFDs).
        want = ["hello", " world", "", "", "", "中 ", "", "", "é."]
    ts = TextStream(tok, ())
    assert [ts.add([t]) for t in ids] == want
    assert "".join(want) == tok.decode(ids, skip_special_tokens=True)


def test_a_skipped_special_token_does_not_end_a_byte_run():
    tok = TOKENIZERS["sentencepiece"]
    v = tok.get_vocab()
    ids = [v[p] for p in ["<0xC3>", "<0xB8>", "<s>", "<0xE4>", "."]]
    # <0xC3><0xB8> is "ø" until <0xE4> joins the run (the <s> between them decodes to nothing): then all
    # three bytes are U+FFFD, so "ø" must never have been printed.
    assert tok.decode(ids, skip_special_tokens=True) == "\ufffd" * 3 + "."
    ts = TextStream(tok, ())
    assert [ts.add([t]) for t in ids] == ["", "", "", "", "\ufffd" * 3 + "."]


# --------------------------------------------------------------------------------- the terminal

# One thread: the same arithmetic in every run (the texts are compared), and no threads spinning on a busy machine
# (two threads on two loaded cores made the tiny model 100x slower).
GEN = ["generate", "--model", "random:qwen2", "--threads", "1", "--max-new-tokens", "1000", "--ignore-eos", "--raw", "hi"]


def run_on_pty(argv: list[str]) -> tuple[list[tuple[float, bytes]], float, str]:
    """Run `skipkv argv` with stdout on a pseudo-terminal; returns the stdout chunks with their arrival time
    (seconds since start), the time the process exited, and its stderr."""
    master, slave = pty.openpty()
    tty.setraw(slave)  # no newline translation: the bytes read back are the bytes written
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), PYTHONIOENCODING="utf-8")
    env.pop("PYTHONUNBUFFERED", None)  # stdout buffered as in a user's shell, so a missing flush shows
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "skipkv.cli", *argv], stdin=subprocess.DEVNULL, stdout=slave,
                            stderr=subprocess.PIPE, env=env)
    os.close(slave)
    chunks: list[tuple[float, bytes]] = []
    try:
        while True:
            ready, _, _ = select.select([master], [], [], 120)
            assert ready, "no output for 120 s"
            try:
                data = os.read(master, 65536)
            except OSError:  # EIO: every writer closed the terminal (Linux)
                break
            if not data:
                break
            chunks.append((time.perf_counter() - t0, data))
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
        exited = time.perf_counter() - t0
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    return chunks, exited, err


@pytest.fixture(scope="module")
def json_text():
    """The same request with --json on the terminal: one object, as before streaming existed."""
    chunks, _, _ = run_on_pty(["generate", "--json", *GEN[1:]])
    lines = b"".join(c for _, c in chunks).decode().splitlines()
    assert len(lines) == 1
    row = json.loads(lines[0])
    assert row["generated_tokens"] == 1000
    return row["text"]


def test_tokens_reach_the_terminal_before_the_process_finishes(json_text):
    chunks, _, err = run_on_pty(GEN)
    out = b"".join(c for _, c in chunks).decode()
    assert out == json_text + "\n"  # exactly the non-streamed text, then a newline
    # The text arrives in many reads spread over the generation, not in one burst at the end: half of it is
    # on the terminal well before the rest (1000 tokens take about a second on the tiny model, one thread).
    # Without the explicit flush a line-buffered terminal gets a write per newline only: a few reads.
    times = [t for t, _ in chunks]
    got, half_at = 0, None
    for t, c in chunks:
        got += len(c)
        if half_at is None and 2 * got >= len(out.encode()):
            half_at = t
    assert len(chunks) >= 50 and half_at is not None and times[-1] - half_at > 0.05, (len(chunks), half_at, times[-1])
    assert err.startswith("--- [0] 1000 tokens") and err.count("\n") == 1  # the summary goes to stderr


def test_no_stream_prints_only_at_the_end(json_text):
    chunks, _, err = run_on_pty(["generate", "--no-stream", *GEN[1:]])
    out = b"".join(c for _, c in chunks).decode()
    # The summary line (known only when the request finished) comes first, on stdout as before.
    head, text = out.split("\n", 1)
    assert head.startswith("--- [0] 1000 tokens") and text == json_text + "\n" and err == ""
