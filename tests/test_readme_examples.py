"""The README's Python examples, run verbatim on the random model (only the model name is swapped).

    python -m pytest tests/test_readme_examples.py -q
"""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
REAL = "qwen2.5-coder-0.5b-instruct"


def python_blocks(section: str) -> list[str]:
    """The ```python blocks of the README section whose heading is `section`."""
    text = README.read_text(encoding="utf-8")
    start = text.index(f"\n## {section}\n")
    end = text.find("\n## ", start + 1)
    return re.findall(r"```python\n(.*?)```", text[start:end], flags=re.S)


def run(code: str) -> str:
    assert REAL in code
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.replace(REAL, "random:qwen2"), "README.md", "exec"), {})
    return out.getvalue()


def test_llm_example_runs_and_prints_each_answer():
    llm_block, engine_block = python_blocks("Python API")
    lines = run(llm_block).splitlines()
    # one line per conversation: text, then token count, finish reason, peak KV tokens, bytes, compressions;
    # the random model's text is arbitrary bytes, the figures after it are not
    assert len(lines) >= 2
    tails = [line.split()[-5:] for line in lines if re.search(r" \d+ (stop|length) \d+ \d+ \d+$", line)]
    assert len(tails) == 2
    for n, _reason, peak, nbytes, comp in tails:
        assert 0 < int(n) <= 64 and int(peak) > 0 and int(nbytes) > 0 and int(comp) >= 0
    run(engine_block)


def test_press_example_runs():
    (block,) = python_blocks("Inside transformers (kvpress style)")
    lines = run(block).splitlines()
    # the answer with the peak KV tokens, then the pipeline's answer (random text on the random model)
    assert len(lines) >= 2 and any(re.search(r" \d+$", line) for line in lines)
