"""When and how strongly to steer one request: the "\\n\\n" gate, the <think> scope, the coefficient.

    st = SteerState(tables, scope="think", prompt_ids=ids, alpha=-1.0)
    st.gate(token_id)   # before each decode forward, with the token it feeds: True -> add alpha * v

SkipKV/SEAL add the vector only when the fed token contains "\\n\\n" (any vocabulary token whose text holds
it) and only inside <think>...</think> (research/algorithms.md §3.8). Departure: a token also counts when it
starts with "\\n" right after a token that ended with "\\n" (the text just completed "\\n\\n"), which is the
same thing on tokenizers that do not merge the two newlines (byte-level ones).
Scope "think": the flag is set by a <think> in the prompt or in the output and cleared by </think>;
"always": every "\\n\\n" token is steered (for models that do not think).
"""

from __future__ import annotations

from skipkv.sentences.tracker import TokenTables

SCOPES = ("auto", "think", "always")


class SteerState:
    def __init__(self, tables: TokenTables, scope: str, prompt_ids: list[int], alpha: float) -> None:
        if scope == "auto":
            scope = "think" if tables.think_open is not None else "always"
        self.tables = tables
        self.scope = scope
        self.alpha = alpha
        self.thinking = False
        for t in prompt_ids:  # the last <think> / </think> of the prompt decides
            if t == tables.think_open:
                self.thinking = True
            elif t == tables.think_close:
                self.thinking = False
        self.prev_ends_nl = bool(prompt_ids) and self._has(tables.ends_nl, prompt_ids[-1])
        self.steered = 0  # tokens steered so far (for stats)

    @staticmethod
    def _has(table, tok: int) -> bool:
        return 0 <= tok < table.shape[0] and bool(table[tok])

    def gate(self, tok: int) -> bool:
        """Called once per decode forward with the token it feeds (in order): steer this token?"""
        t = self.tables
        if tok == t.think_open:
            self.thinking = True
        elif tok == t.think_close:
            self.thinking = False
        nn = self._has(t.has_nn, tok) or (self.prev_ends_nl and self._has(t.starts_nl, tok))
        self.prev_ends_nl = self._has(t.ends_nl, tok)
        fire = nn and (self.scope == "always" or self.thinking)
        self.steered += fire
        return fire
