"""Prompt templates per task and the two prompt styles (chat template or raw text).

    skipkv eval --model random:qwen2 --dataset math500 --policy full --prompt-style chat --out runs/m
    render(tokenizer, example, "chat")   # -> the exact text the model sees
    encode(tokenizer, text, "chat")      # -> its token ids (the runner sends ids, so nothing is tokenized twice)

Style `chat` puts the task's user message through the model's chat template (add_generation_prompt);
style `raw` sends the same user message as plain text (code tasks send the bare function stub, the
classic HumanEval completion setting). Style `r1think` (math tasks only) is the reflective testbed for models
that were not distilled from a reasoning model: the chat template with R1_EXEMPLARS as earlier turns (worked
problems whose reasoning sits in <think> ... </think> and re-checks itself with "Wait, ...", "Let me
verify ...", "Alternatively, ..."), and the assistant turn opened with "<think>\n", as an R1-distill's template
does (research/algorithms.md §3.8: its steering gate fires only inside thinking). See docs/results.md,
"A reflective testbed", for why this recipe was chosen. A task's answer prefix, if any (RULER's "The special magic
number for X ... is"), follows the template in both styles. Every policy in a comparison gets the same
style: the style is part of the run config, and a resumed run refuses a different one.

Math uses the SkipKV/SEAL instruction (research/algorithms.md §4). Under `chat` the BOS the template
writes is kept once: the text is tokenized without adding special tokens, which is what SkipKV's
"strip the BOS from the templated string, then let the tokenizer add it" achieves.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Mapping

from skipkv.errors import SkipKVError

if TYPE_CHECKING:
    from skipkv.eval.datasets import Example

STYLES = ("chat", "raw", "r1think")
THINK_OPEN = "<think>\n"

MATH_INSTRUCTION = ("Answer the following questions. You should think step-by-step and put your final answer "
                    "within \\boxed{}.\nQuestion: ")


@dataclass(frozen=True)
class Template:
    """A task's user message ({field}s filled from Example.inputs), its raw-style variant, and answer prefix."""

    user: str
    raw_user: str | None = None  # None: the raw style sends `user` unchanged
    answer_prefix: str = ""

    def message(self, style: str, inputs: Mapping[str, object]) -> str:
        text = self.raw_user if style == "raw" and self.raw_user is not None else self.user
        return fill(text, inputs)


def fill(text: str, inputs: Mapping[str, object]) -> str:
    """Replace each {field} by inputs[field] in one pass. Not str.format: LaTeX braces (\\boxed{}) stay as
    they are, and braces inside the inputs are never expanded."""

    def sub(m: re.Match) -> str:
        if m.group(1) not in inputs:
            raise SkipKVError(f"prompt template field {{{m.group(1)}}} has no value")
        return str(inputs[m.group(1)])

    return re.sub(r"\{([A-Za-z_]\w*)\}", sub, text)


# The r1think exemplars: (question, thinking, answer). Written for this recipe (not taken from any evaluated set);
# each chain's steps are separated by blank lines, as SEAL's step split expects, and each re-checks itself.
R1_EXEMPLARS: tuple[tuple[str, str, str], ...] = (
    ("A baker makes 3 trays of muffins with 12 muffins on each tray. She sells 20 muffins in the morning and half "
     "of the remaining muffins in the afternoon. How many muffins are left?",
     "The baker makes 3 trays with 12 muffins each, so she has 3 * 12 = 36 muffins.\n\n"
     "In the morning she sells 20 muffins, so 36 - 20 = 16 muffins remain.\n\n"
     "In the afternoon she sells half of the remaining muffins: 16 / 2 = 8 muffins sold, so 16 - 8 = 8 are left.\n\n"
     "Wait, let me re-read the question to make sure I used the right numbers. It says 3 trays of 12 muffins, "
     "20 sold in the morning, and half of the rest in the afternoon. Yes, that is what I used.\n\n"
     "Let me verify the total another way: she sells 20 + 8 = 28 muffins, and 36 - 28 = 8. That matches.\n\n"
     "So 8 muffins are left.",
     "She has 3 * 12 = 36 muffins, sells 20 to leave 16, then sells half of them (8), so 8 are left.\n\n\\boxed{8}"),
    ("What is the sum of all values of $x$ such that $x^2 - 5x + 6 = 0$?",
     "I need the roots of x^2 - 5x + 6 = 0.\n\n"
     "To factor it I need two numbers that multiply to 6 and add to -5: these are -2 and -3. So "
     "(x - 2)(x - 3) = 0, and x = 2 or x = 3.\n\n"
     "The sum is 2 + 3 = 5.\n\n"
     "Wait, I should check the factorization: (x - 2)(x - 3) = x^2 - 3x - 2x + 6 = x^2 - 5x + 6. Yes, that is right.\n\n"
     "Let me verify by plugging in. For x = 2: 4 - 10 + 6 = 0. For x = 3: 9 - 15 + 6 = 0. Both work.\n\n"
     "Alternatively, by Vieta's formulas the sum of the roots of x^2 + bx + c = 0 is -b = 5. This agrees.\n\n"
     "So the answer is 5.",
     "The roots are 2 and 3, so their sum is $\\boxed{5}$."),
    ("Tom has 5 boxes with 8 pencils in each box. He gives 13 pencils to his friends. How many pencils does he "
     "have now?",
     "Tom has 5 boxes with 8 pencils each, so 5 * 8 = 45 pencils.\n\n"
     "Wait, that is not right. 5 * 8 = 40, not 45. Let me redo this step: Tom has 40 pencils.\n\n"
     "He gives away 13 pencils, so 40 - 13 = 27 pencils are left.\n\n"
     "Let me verify: 27 + 13 = 40, and 40 / 8 = 5 boxes. That matches the question.\n\n"
     "Alternatively, 13 = 8 + 5, so he gives away one full box and 5 more pencils: 4 * 8 - 5 = 32 - 5 = 27. "
     "The same answer.\n\n"
     "So Tom has 27 pencils.",
     "Tom has 5 * 8 = 40 pencils and gives away 13, so he has 40 - 13 = 27.\n\n\\boxed{27}"),
)


# RULER's templates (NVIDIA/RULER synthetic.yaml), words kept, one typo ("assgined") fixed.
TEMPLATES: Mapping[str, Template] = MappingProxyType({
    "math": Template(MATH_INSTRUCTION + "{question}"),
    "code": Template(
        "Complete the following Python function. Reply with the whole function, including its imports, "
        "in one ```python code block.\n\n```python\n{prompt}```",
        raw_user="{prompt}",
    ),
    "niah": Template(
        "Some special magic numbers are hidden within the following text. Make sure to memorize it. "
        "I will quiz you about the numbers afterwards.\n{context}\n"
        "What is the special magic number for {query} mentioned in the provided text?",
        answer_prefix=" The special magic number for {query} mentioned in the provided text is",
    ),
    "variable_tracking": Template(
        "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
        "Question: Find all variables that are assigned the value {query} in the text above.",
        answer_prefix=(" Answer: According to the chain(s) of variable assignment in the text above, "
                       "{num_vars} variables are assigned the value {query}, they are: "),
    ),
    "common_words": Template(
        "Below is a numbered list of words. In these words, some appear more often than others. "
        "Memorize the ones that appear most often.\n{context}\n"
        "Question: What are the {num_common} most common words in the above list?",
        answer_prefix=" Answer: The top {num_common} words that appear most often in the list are:",
    ),
})


def template(task: str) -> Template:
    if task not in TEMPLATES:
        raise SkipKVError(f"no prompt template for task {task!r}; known: {', '.join(sorted(TEMPLATES))}")
    return TEMPLATES[task]


def check_style(style: str) -> str:
    if style not in STYLES:
        raise SkipKVError(f"unknown prompt style {style!r}; choose one of: {', '.join(STYLES)}")
    return style


def render(tokenizer, example: "Example", style: str) -> str:
    """The full prompt text for `example` under `style` (see module docstring)."""
    check_style(style)
    tpl = template(example.task)
    user = tpl.message(style, example.inputs)
    prefix = fill(tpl.answer_prefix, example.inputs)
    if style == "raw":
        return user + ("\n" + prefix.lstrip() if prefix else "")
    if not getattr(tokenizer, "chat_template", None):
        raise SkipKVError(f"the model's tokenizer has no chat template; prompt style {style} needs one "
                          "(use --prompt-style raw)")
    turns = []
    if style == "r1think":
        if example.task != "math":
            raise SkipKVError(f"prompt style r1think is for math tasks; {example.task!r} examples take chat or raw")
        for q, thinking, answer in R1_EXEMPLARS:
            turns += [{"role": "user", "content": MATH_INSTRUCTION + q},
                      {"role": "assistant", "content": f"{THINK_OPEN}{thinking}\n</think>\n\n{answer}"}]
    text = tokenizer.apply_chat_template(turns + [{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return text + (THINK_OPEN if style == "r1think" else "") + prefix.lstrip()


def encode(tokenizer, text: str, style: str) -> list[int]:
    """Token ids of a rendered prompt: the chat template already wrote any BOS, raw text gets the tokenizer's."""
    return list(tokenizer(text, add_special_tokens=(style == "raw"))["input_ids"])
