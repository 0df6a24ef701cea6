"""Prompt templates per task and the two prompt styles (chat template or raw text).

    skipkv eval --model random:qwen2 --dataset math500 --policy full --prompt-style chat --out runs/m
    render(tokenizer, example, "chat")   # -> the exact text the model sees
    encode(tokenizer, text, "chat")      # -> its token ids (the runner sends ids, so nothing is tokenized twice)

Style `chat` puts the task's user message through the model's chat template (add_generation_prompt);
style `raw` sends the same user message as plain text (code tasks send the bare function stub, the
classic HumanEval completion setting). A task's answer prefix, if any (RULER's "The special magic
number for X ... is"), follows the template in both styles. Every policy in a comparison gets the same
style: the style is part of the run config, and a resumed run refuses a different one.

Math uses the SkipKV/SEAL instruction (research/algorithms.md §4). Under `chat` the BOS the template
writes is kept once: the text is tokenized without adding special tokens, which is what SkipKV's
"strip the BOS from the templated string, then let the tokenizer add it" achieves.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from skipkv.errors import SkipKVError

if TYPE_CHECKING:
    from skipkv.eval.data import Example

STYLES = ("chat", "raw")

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


def render(tokenizer, example: Example, style: str) -> str:
    """The full prompt text for `example` under `style` (see module docstring)."""
    check_style(style)
    tpl = template(example.task)
    user = tpl.message(style, example.inputs)
    prefix = fill(tpl.answer_prefix, example.inputs)
    if style == "raw":
        return user + ("\n" + prefix.lstrip() if prefix else "")
    if not getattr(tokenizer, "chat_template", None):
        raise SkipKVError("the model's tokenizer has no chat template; use --prompt-style raw")
    text = tokenizer.apply_chat_template([{"role": "user", "content": user}], tokenize=False,
                                         add_generation_prompt=True)
    return text + prefix.lstrip()


def encode(tokenizer, text: str, style: str) -> list[int]:
    """Token ids of a rendered prompt: the chat template already wrote any BOS, raw text gets the tokenizer's."""
    return list(tokenizer(text, add_special_tokens=(style == "raw"))["input_ids"])
