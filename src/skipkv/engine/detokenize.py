"""Incremental detokenisation: a request's tokens in, text deltas out, adding up to exactly its final text.

    ts = TextStream(tokenizer, stop=("\n\n",))
    for tok in new_tokens: sys.stdout.write(ts.add([tok]))
    sys.stdout.write(ts.finish(result.text))

Shared by everything that shows text while it is generated (`skipkv generate` on a terminal, the server's
SSE stream); the final text it must add up to is `engine.make_result`'s.
"""

from __future__ import annotations

import re

# SentencePiece byte-fallback pieces (<0xE4>): tokenizers' ByteFallback decoder turns a whole run of them into
# text at once, and into one U+FFFD per piece if the run is not valid UTF-8, so a later byte piece can change
# the text of earlier ones (<0xC3><0xA9> is "é"; add <0x80> and all three are U+FFFD).
BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class StopMatcher:
    """Knuth-Morris-Pratt over a growing text for one stop string: `feed` costs O(1) amortised per character,
    so a stream's stop checks are linear in its text whatever the stop string's length (re-searching the
    whole text, or every prefix of the stop string, each token was quadratic)."""

    def __init__(self, stop: str) -> None:
        self.stop = stop
        fail = [0] * len(stop)  # fail[i]: length of the longest proper border of stop[:i + 1]
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = fail[k - 1]
            if stop[i] == stop[k]:
                k += 1
            fail[i] = k
        self.fail = fail
        self.held = 0  # the longest suffix of the text fed so far that begins `stop` (the KMP state)
        self.found: int | None = None  # where the first occurrence starts, once there is one
        self.fed = 0

    def feed(self, text: str) -> None:
        if self.found is not None:
            return
        stop, fail, k = self.stop, self.fail, self.held
        for i, ch in enumerate(text):
            while k and ch != stop[k]:
                k = fail[k - 1]
            if ch == stop[k]:
                k += 1
                if k == len(stop):
                    self.found = self.fed + i + 1 - k
                    break
        self.fed += len(text)
        self.held = k


class TextStream:
    """Turns a request's tokens into text deltas for streaming, so that the deltas add up to exactly the
    final text (`make_result`'s: special tokens skipped, cut at a stop string).

    Text is decoded from a window of recent tokens (vLLM's prefix/read offsets: O(1) tokens per step, not the
    whole output); a delta ending in an incomplete UTF-8 sequence, or in a run of byte-fallback pieces, waits for
    the next token, and text that may be the start of a stop string is held back until it is known not to be one
    (`StopMatcher`: linear in the text, whatever the stop strings' length).
    """

    def __init__(self, tokenizer, stop: tuple[str, ...], skip_special_tokens: bool = True) -> None:
        self.tokenizer, self.stop, self.skip = tokenizer, stop, skip_special_tokens
        self.matchers = [StopMatcher(s) for s in stop]
        self.ids: list[int] = []
        self.special = frozenset(tokenizer.all_special_ids if skip_special_tokens else ())  # skipped when decoding
        self.prefix_at = self.read_at = 0
        self.text = ""  # decoded so far
        self.sent = 0  # characters of `text` already sent

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip)

    def _in_byte_run(self) -> bool:
        # The newest token that decodes to anything: a skipped special token does not end a run of byte pieces.
        # One vocabulary lookup per call; a tokenizer without byte pieces never waits here.
        for t in reversed(self.ids):
            if t not in self.special:
                return bool(BYTE_PIECE.fullmatch(self.tokenizer.convert_ids_to_tokens(t) or ""))
        return False

    def add(self, tokens: list[int]) -> str:
        """Append tokens; return the text that is safe to send now."""
        self.ids.extend(tokens)
        before = self._decode(self.ids[self.prefix_at:self.read_at])
        now = self._decode(self.ids[self.prefix_at:])
        if len(now) > len(before) and not now.endswith("\ufffd") and not self._in_byte_run():
            new = now[len(before):]
            self.text += new
            self.prefix_at, self.read_at = self.read_at, len(self.ids)
            for m in self.matchers:
                m.feed(new)
        found = [m.found for m in self.matchers if m.found is not None]
        # Safe: up to the first stop string found, else all but the longest tail that may begin one.
        safe = min(found) if found else len(self.text) - max((m.held for m in self.matchers), default=0)
        if safe <= self.sent:
            return ""
        out, self.sent = self.text[self.sent:safe], safe
        return out

    def finish(self, final_text: str) -> str:
        """The rest of the final text (what was sent is a prefix of it)."""
        # The window decode and the stop hold-back guarantee that what was sent is a prefix of the final text
        # (tests compare the concatenated deltas with the non-streamed answer).
        out, self.sent = final_text[self.sent:], len(final_text)
        return out
