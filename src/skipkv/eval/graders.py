"""Graders, registered by name: math, gsm8k, code, contains, exact.

    python -c "from skipkv.eval.graders import MathGrader; print(MathGrader().check('so \\\\boxed{\\\\frac12}', '0.5'))"
    skipkv eval --model M --dataset humaneval --policy full --out runs/he     # uses the `code` grader

- math: the content of the *last* `\\boxed{}` (or `\\fbox{}`) of the output, compared with the reference by
  `math-verify` (symbolic and numeric equality: fractions vs decimals, `\\frac` vs `\\dfrac`, sets, intervals,
  percentages, `\\text{}` units). No boxed answer means wrong. A bare number followed by plain words
  ("18 dollars") is reduced to the number first. math-verify itself collects every boxed answer
  in the text, which would turn "\\boxed{2} ... \\boxed{3}" into the set {2, 3}; taking the last one first
  is the R-KV/Qwen-Math harness rule (research/algorithms.md §6.3).
- gsm8k: math, falling back to the last number in the output when nothing is boxed.
- code: the program (HumanEval prompt + completion, or the model's own full function) runs with the task's
  tests in the sandbox (sandbox.py) inside a harness (harness.py); passing means the harness reported that the
  check call returned, not merely exit status 0 (a program can exit 0 before its asserts run).
- contains: every reference string must appear in the output (case-insensitive; RULER's string_match_all);
  the record's score is the fraction that do.
- exact: the normalised output equals the reference.
"""

from __future__ import annotations

import re
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from skipkv.config import check_fields, knob
from skipkv.eval.datasets import Example, HumanEval
from skipkv.eval.sandbox import ISOLATION_LEVELS, Sandbox, SandboxLimits
from skipkv.registry import Registry

# Chat and end-of-text markers that some engines leave in decoded text; everything after them is not an answer.
STOP_MARKERS = ("<|im_end|>", "<|endoftext|>", "</s>", "<|eot_id|>", "<|end_of_text|>")


@dataclass(frozen=True)
class Verdict:
    """A grade: correct, the answer that was extracted (None: no answer found), a score in [0, 1], a note."""

    correct: bool
    extracted: str | None
    score: float
    detail: str = ""
    sandbox: str | None = None  # the isolation level that ran the code (code grader), recorded with the grade


class Grader(ABC):
    def ready(self) -> None:  # noqa: B027 - an optional hook: most graders need no check
        """Fail now, with a one-line SkipKVError, if this grader cannot work on this machine."""

    @abstractmethod
    def grade(self, output: str, example: Example) -> Verdict:
        """Grade one model output against one example. Never raises on bad output."""


GRADERS: Registry[type[Grader]] = Registry("grader")


def strip_stop(text: str) -> str:
    cut = min((i for i in (text.find(m) for m in STOP_MARKERS) if i >= 0), default=len(text))
    return text[:cut]


def last_boxed(text: str) -> str | None:
    """Content of the last \\boxed{...} / \\fbox{...} (braces matched), or of `\\boxed 5`; None if there is none."""
    starts = [m for m in re.finditer(r"\\(?:boxed|fbox)\s*(\{)?", text)]
    for m in reversed(starts):
        if m.group(1) is None:  # "\boxed 5": the answer runs to the next space or $
            token = re.match(r"[^\s$]+", text[m.end():])
            if token:
                return token.group(0)
            continue
        depth, i = 1, m.end()
        while i < len(text) and depth:
            depth += {"{": 1, "}": -1}.get(text[i], 0)
            i += 1
        if depth == 0:
            return text[m.end():i - 1].strip()
    return None


_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def last_number(text: str) -> str | None:
    """The last number in the text, thousands separators removed ('1,234.5' -> '1234.5')."""
    found = _NUMBER.findall(text)
    if not found:
        return None
    number = found[-1].replace(",", "").rstrip(".")
    return number or None


# "18 dollars", "5 cm", "$1,000 per month": a number followed by plain words only.
_NUMBER_WITH_WORDS = re.compile(r"^\s*\\?\$?\s*(-?[\d,]*\.?\d+)\s*(?:[A-Za-z][A-Za-z.]*\s*)+$")


def _norm(text: str) -> str:
    return re.sub(r"\s+|\$|\\[,;! ]|\\left|\\right", "", text).strip(".").lower()


@GRADERS.register("math")
@dataclass(frozen=True)
class MathGrader(Grader):
    fallback_last_number: bool = False
    verify_timeout_s: int = 5  # math-verify's own parse/verify timeout (signal based: main thread only)

    def _parse(self, latex: str) -> list:
        from math_verify import LatexExtractionConfig, parse  # noqa: PLC0415 - heavy import, only when grading

        words = _NUMBER_WITH_WORDS.match(latex)
        if words:
            latex = words.group(1)
        # A boxed wrapper makes math-verify read exactly this expression and nothing around it.
        return parse("\\boxed{" + latex + "}", extraction_config=[LatexExtractionConfig(boxed_match_priority=0)],
                     parsing_timeout=self._timeout())

    def _timeout(self) -> int | None:
        # math-verify's timeouts use SIGALRM, which exists only in the main thread.
        return self.verify_timeout_s if threading.current_thread() is threading.main_thread() else None

    def check(self, output: str, reference: str) -> Verdict:
        """Grade `output` (model text) against a reference answer in LaTeX or plain text."""
        from math_verify import verify  # noqa: PLC0415

        text = strip_stop(output)
        answer = last_boxed(text)
        how = "boxed"
        if answer is None and self.fallback_last_number:
            answer, how = last_number(text), "last number"
        if answer is None or not answer.strip():
            return Verdict(False, None, 0.0, "no answer")
        try:
            gold, pred = self._parse(str(reference)), self._parse(answer)
            same = bool(gold and pred and verify(gold, pred, timeout_seconds=self._timeout()))
        except Exception as exc:  # math-verify can raise on pathological LaTeX; that output is just wrong
            gold, pred, same = [], [], False
            how += f", verify error {type(exc).__name__}"
        if not same and (not gold or not pred):
            # Unparseable on either side (e.g. "\text{(C)}" choices): fall back to normalised text equality.
            same = _norm(answer) == _norm(str(reference))
        return Verdict(same, answer, float(same), how)

    def grade(self, output: str, example: Example) -> Verdict:
        return self.check(output, str(example.reference))


@GRADERS.register("gsm8k")
@dataclass(frozen=True)
class GSM8KGrader(MathGrader):
    fallback_last_number: bool = True


def extract_code(output: str, entry_point: str | None = None) -> str:
    """The code in a model reply: the fenced block that defines `entry_point` (else the last fenced block),
    or the whole text when there is no fence (a raw completion)."""
    text = strip_stop(output)
    blocks = re.findall(r"```[ \t]*(?:python|py|Python)?[^\n]*\n(.*?)(?:```|$)", text, flags=re.DOTALL)
    if not blocks:
        return text
    if entry_point:
        defining = [b for b in blocks if re.search(rf"^\s*def\s+{re.escape(entry_point)}\s*\(", b, re.MULTILINE)]
        if defining:
            return defining[-1]
    return blocks[-1]


def build_program(prompt: str, code: str, test: str, entry_point: str) -> tuple[str, str]:
    """(the program, the check statement) the sandbox's harness runs: the program is the solution and the test
    code; the check call (`check(entry_point)`) is run by the harness after it, which reports success only once
    that call returned. If the code defines the function itself, it replaces the prompt's stub (the prompt's
    preamble — imports, helper functions — is kept); otherwise it continues the prompt."""
    if re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", code, re.MULTILINE):
        stub = re.search(rf"^def\s+{re.escape(entry_point)}\s*\(", prompt, re.MULTILINE)
        preamble = prompt[:stub.start()] if stub else ""
        body = preamble + "\n" + code
    else:
        body = prompt + code
    return f"{body}\n\n{test}\n", f"check({entry_point})\n"


def truncate_completion(code: str, stops: Sequence[str]) -> str:
    cut = min((i for i in (code.find(s) for s in stops) if i >= 0), default=len(code))
    return code[:cut]


_LIMITS = SandboxLimits()


@GRADERS.register("code")
@dataclass(frozen=True)
class CodeGrader(Grader):
    timeout_s: float = _LIMITS.timeout_s
    memory_bytes: int = _LIMITS.memory_bytes
    isolation: str = knob("namespaces", "sandbox level; unsafe-basic only when asked for", choices=ISOLATION_LEVELS)
    stops: tuple[str, ...] = HumanEval.raw_stop  # where a raw completion of the stub ends
    _sandbox: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        check_fields(self, "code grader")
        self.limits()  # timeout_s and memory_bytes are checked by SandboxLimits, which owns their constraints

    def limits(self) -> SandboxLimits:
        return SandboxLimits(timeout_s=self.timeout_s, memory_bytes=self.memory_bytes)

    def ready(self) -> None:  # noqa: B027 - an optional hook: most graders need no check
        self.sandbox()

    def sandbox(self) -> Sandbox:
        if self._sandbox is None:
            box = Sandbox(self.limits(), self.isolation)
            _ = box.isolation  # probe now: an unavailable level stops the run before any grading
            object.__setattr__(self, "_sandbox", box)  # frozen dataclass: cache the probed sandbox once
        return self._sandbox

    def grade(self, output: str, example: Example) -> Verdict:
        entry = str(example.meta["entry_point"])
        prompt = str(example.inputs["prompt"])
        code = extract_code(output, entry)
        if not re.search(rf"^def\s+{re.escape(entry)}\s*\(", code, re.MULTILINE):
            # A continuation of the stub: it ends where the next top-level statement would start.
            code = truncate_completion(code, self.stops)
        program, check = build_program(prompt, code, str(example.reference), entry)
        result = self.sandbox().run(program, check)
        return Verdict(result.passed, code, float(result.passed), f"{result.summary()} [{result.isolation}]",
                       sandbox=result.isolation)


def _references(example: Example) -> list[str]:
    ref = example.reference
    return [str(r) for r in ref] if isinstance(ref, (list, tuple)) else [str(ref)]


@GRADERS.register("contains")
@dataclass(frozen=True)
class ContainsGrader(Grader):
    def grade(self, output: str, example: Example) -> Verdict:
        text = strip_stop(output).lower()
        refs = _references(example)
        found = [r for r in refs if r.lower() in text]
        return Verdict(len(found) == len(refs), ", ".join(found) or None, len(found) / len(refs),
                       f"{len(found)}/{len(refs)} found")


@GRADERS.register("exact")
@dataclass(frozen=True)
class ExactGrader(Grader):
    def grade(self, output: str, example: Example) -> Verdict:
        answer = strip_stop(output).strip()
        same = any(_norm(answer) == _norm(r) for r in _references(example))
        return Verdict(same, answer or None, float(same))
