"""Graders: a verdict table for math answers, GSM8K's last-number fallback, containment, code extraction, and the
reference answers of the packaged benchmarks graded against themselves."""

from __future__ import annotations

import json

import pytest

from skipkv.eval.datasets import Example, packaged
from skipkv.eval.graders import (
    GRADERS,
    ContainsGrader,
    ExactGrader,
    GSM8KGrader,
    MathGrader,
    build_program,
    extract_code,
    last_boxed,
    last_number,
)

# (output, reference, correct?) for the math grader: last \boxed{} + math-verify.
MATH_TABLE = [
    # fractions and decimals
    ("The answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}", True),
    ("\\boxed{0.5}", "\\frac{1}{2}", True),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac12", True),
    ("\\boxed{1/2}", "\\frac{1}{2}", True),
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", True),
    ("\\boxed{0.33}", "\\frac{1}{3}", False),
    ("$\\boxed{3.0}$", "3", True),
    # thousands separators
    ("\\boxed{1,000}", "1000", True),
    ("\\boxed{1{,}000}", "1000", True),
    # units, currency, degrees, percent
    ("\\boxed{5\\text{ cm}}", "5", True),
    ("\\boxed{18 dollars}", "18", True),
    ("\\boxed{\\$18}", "18", True),
    ("\\boxed{90^\\circ}", "90", True),
    ("\\boxed{50\\%}", "50", True),
    # which boxed counts, nesting, other box spellings
    ("first \\boxed{2}, then corrected: \\boxed{3}", "3", True),
    ("first \\boxed{3}, then corrected: \\boxed{2}", "3", False),
    ("\\boxed{\\boxed{10}}", "10", True),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", True),
    ("\\boxed 7", "7", True),
    ("\\fbox{7}", "7", True),
    ("\\boxed{6}<|im_end|>\\boxed{7}", "6", True),
    # symbolic forms
    ("\\boxed{x^2+1}", "1+x^2", True),
    ("\\boxed{2\\sqrt{2}}", "\\sqrt{8}", True),
    ("\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)", True),
    ("\\boxed{\\{1,2\\}}", "\\{2,1\\}", True),
    ("\\boxed{[0,1)}", "[0,1)", True),
    ("\\boxed{(0,1]}", "[0,1)", False),
    ("\\boxed{x = 5}", "5", True),
    ("\\boxed{\\text{(C)}}", "\\text{(C)}", True),
    ("\\boxed{C}", "\\text{(C)}", True),
    ("\\boxed{-5}", "5", False),
    ("\\boxed{\\frac{1}{0}}", "1", False),
    # no answer
    ("The answer is 42.", "42", False),
    ("", "42", False),
    ("\\boxed{}", "42", False),
    ("\\boxed{42", "42", False),
]

GSM8K_TABLE = [
    ("She pays 18 dollars.", "18", True),
    ("Total: 1,250 apples", "1250", True),
    ("so 3 + 4 = 7. The answer is 7.", "7", True),
    ("I am not sure.", "7", False),
    ("\\boxed{12} and later 13", "12", True),
    ("-3 degrees", "-3", True),
    ("2.50 dollars", "2.5", True),
    ("It is 8, no wait, 9", "8", False),
]


@pytest.mark.parametrize("output,reference,expected", MATH_TABLE)
def test_math_table(output: str, reference: str, expected: bool) -> None:
    verdict = MathGrader().check(output, reference)
    assert verdict.correct is expected
    assert verdict.score == float(expected)


@pytest.mark.parametrize("output,reference,expected", GSM8K_TABLE)
def test_gsm8k_table(output: str, reference: str, expected: bool) -> None:
    assert GSM8KGrader().check(output, reference).correct is expected


def test_table_size() -> None:
    assert len(MATH_TABLE) + len(GSM8K_TABLE) >= 30
    # both verdicts are represented, so a grader that always says yes (or no) fails the table
    verdicts = {v for _, _, v in MATH_TABLE + GSM8K_TABLE}
    assert verdicts == {True, False}


def test_extraction_helpers() -> None:
    assert last_boxed("a \\boxed{\\frac{1}{2}} b \\boxed{x^{2}}") == "x^{2}"
    assert last_boxed("no box") is None
    assert last_boxed("\\boxed{\\text{a {b} c}}") == "\\text{a {b} c}"
    assert last_number("paid $1,234.50 then 7.") == "7"
    assert last_number("paid $1,234.50") == "1234.50"
    assert last_number("none") is None
    assert MathGrader().check("\\boxed{\\frac{1}{2}}", "0.5").extracted == "\\frac{1}{2}"
    assert MathGrader().check("nothing", "1").extracted is None


def test_math500_reference_solutions_grade_correct() -> None:
    # Every MATH-500 reference solution ends in its boxed answer; the grader must accept all 500, and must
    # reject each solution against the next problem's answer where the two answers differ.
    rows = [json.loads(line) for line in packaged("math500_test.jsonl").open()]
    grader = MathGrader()
    assert all(grader.check(r["solution"], r["answer"]).correct for r in rows)
    shifted = [(r, n) for r, n in zip(rows[::10], rows[1::10]) if r["answer"].strip() != n["answer"].strip()]
    wrong = [grader.check(r["solution"], n["answer"]).correct for r, n in shifted]
    assert len(wrong) > 40 and not any(wrong)


def test_contains_and_exact() -> None:
    ex = Example("x", "variable_tracking", {}, ["ABCDE", "FGHIJ"])
    full = ContainsGrader().grade("they are: abcde, FGHIJ", ex)
    half = ContainsGrader().grade("they are: ABCDE", ex)
    assert (full.correct, full.score) == (True, 1.0)
    assert (half.correct, half.score) == (False, 0.5)
    needle = Example("n", "niah", {}, "4821937")
    assert ContainsGrader().grade(" is 4821937.", needle).correct
    assert not ContainsGrader().grade(" is 4821973.", needle).correct
    assert ExactGrader().grade(" Paris. ", Example("e", "x", {}, "paris")).correct
    assert not ExactGrader().grade("Paris, France", Example("e", "x", {}, "paris")).correct


def test_registry() -> None:
    assert {"math", "gsm8k", "code", "contains", "exact"} <= set(GRADERS.names())


def test_extract_code_and_program() -> None:
    reply = ("Here you go:\n```python\nimport math\n\ndef helper(x):\n    return x\n```\nand\n"
             "```python\ndef add(a, b):\n    return a + b\n```\nDone.")
    assert extract_code(reply, "add").startswith("def add(a, b):")
    assert extract_code("    return a + b\n", "add") == "    return a + b\n"
    prompt = "import os\n\n\ndef add(a: int, b: int) -> int:\n    \"\"\"Add.\"\"\"\n"
    test = "def check(c):\n    assert c(1, 2) == 3\n"
    program, call = build_program(prompt, "def add(a, b):\n    return a + b\n", test, "add")
    assert program.count("def add") == 1 and program.startswith("import os") and call.strip() == "check(add)"
    program, call = build_program(prompt, "    return a + b\n", "def check(c):\n    assert c(1, 2) == 3\n", "add")
    assert program.startswith(prompt) and "check(add)" not in program and call.strip() == "check(add)"
