"""Sentences of a request: streaming segmentation, labels, mean hidden states, redundancy (SkipKV §4.1).

    from skipkv.sentences import SentenceTracker, TokenTables, flag_earlier, span_penalty
"""

from skipkv.sentences.redundancy import flag_earlier, span_penalty
from skipkv.sentences.tracker import REFERENCE_DELIMITERS, SentenceTracker, TokenTables, classify_step, parse_delimiters

__all__ = ["REFERENCE_DELIMITERS", "SentenceTracker", "TokenTables", "classify_step", "flag_earlier",
           "parse_delimiters", "span_penalty"]
