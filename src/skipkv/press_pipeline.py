"""kvpress's context/question pipeline on a skipkv `KVPress`: the context is compressed, the question is not.

    from skipkv.press import KVPress
    from skipkv.press_pipeline import KVPressPipeline
    pipe = KVPressPipeline(model=model, tokenizer=tokenizer)
    pipe(context, question="What is the secret number?", press=KVPress("snapkv", compression_ratio=0.5),
         max_new_tokens=32)["answer"]

As kvpress's "kv-press-text-generation" pipeline does: the chat template (if the tokenizer has one) wraps
context + question as one user turn; the part before the question is prefilled and compressed by the press,
the question and the rest of the template are prefilled after it inside `press.hold()` (never evicted by that
compression), then tokens are decoded greedily (decode-time compression follows the policy's phase and
interval, as in the engine). Several questions (`questions=[...]`) each get the context prefilled anew.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import Pipeline

from skipkv.errors import SkipKVError
from skipkv.press import KVPress

_MARK = "\x00skipkv-question\x00"  # where the question goes in the templated text


class KVPressPipeline(Pipeline):
    """A transformers Pipeline: `pipe(context, question=..., press=..., max_new_tokens=...)` -> {"answer": str}
    (or {"answers": [...]} for `questions=[...]`)."""

    def _sanitize_parameters(self, question: str | None = None, questions: list[str] | None = None,
                             press: KVPress | None = None, max_new_tokens: int | None = None, **kwargs):
        # Called at construction (no arguments) and per call; only what is given is returned.
        if kwargs:
            raise SkipKVError(f"KVPressPipeline has no parameter {next(iter(kwargs))!r} (question, questions, press, "
                              "max_new_tokens)")
        if question is not None and questions is not None:
            raise SkipKVError("KVPressPipeline: give question or questions, not both")
        if press is not None and not isinstance(press, KVPress):
            raise SkipKVError(f"KVPressPipeline press must be a KVPress, got {type(press).__name__}")
        if max_new_tokens is not None and (isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int)
                                           or max_new_tokens <= 0):
            raise SkipKVError(f"KVPressPipeline max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        pre: dict = {"questions": [question or ""] if questions is None else list(questions)}
        fwd: dict = {"press": press} | ({"max_new_tokens": max_new_tokens} if max_new_tokens is not None else {})
        return pre, fwd, {"single": questions is None}

    def split(self, context: str, question: str) -> tuple[list[int], list[int]]:
        """(context ids, question ids): the templated turn cut where the question starts."""
        tok: Any = self.tokenizer
        text = context + _MARK
        if getattr(tok, "chat_template", None):
            text = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                           tokenize=False)
        before, after = text.split(_MARK)
        ctx_ids = tok(before, add_special_tokens=not getattr(tok, "chat_template", None))["input_ids"]
        q_ids = tok(question + after, add_special_tokens=False)["input_ids"]
        if not ctx_ids:
            raise SkipKVError("KVPressPipeline: the context is empty")
        return list(ctx_ids), list(q_ids)

    def preprocess(self, input_: Any, **params: Any) -> dict[str, Any]:
        if not isinstance(input_, str):
            raise SkipKVError(f"KVPressPipeline takes a context string, got {type(input_).__name__}")
        return {"parts": [self.split(input_, q) for q in params["questions"]]}

    def _forward(self, input_tensors: dict[str, Any], **params: Any) -> Any:
        press: KVPress | None = params.get("press")
        max_new_tokens: int = params.get("max_new_tokens", 50)
        if press is None:
            raise SkipKVError("KVPressPipeline: press=KVPress(...) is required")
        model: Any = self.model
        tok: Any = self.tokenizer
        eos = tok.eos_token_id
        answers = []
        with press(model, self.tokenizer):
            for ctx_ids, q_ids in input_tensors["parts"]:
                device = model.device
                logits = model(input_ids=torch.tensor([ctx_ids], device=device), logits_to_keep=1,
                               position_ids=torch.arange(len(ctx_ids), device=device)[None]).logits
                if q_ids:
                    at = len(ctx_ids)
                    with press.hold():
                        logits = model(input_ids=torch.tensor([q_ids], device=device), logits_to_keep=1,
                                       position_ids=torch.arange(at, at + len(q_ids), device=device)[None]).logits
                out: list[int] = []
                pos = len(ctx_ids) + len(q_ids)
                while True:
                    token = int(logits[0, -1].argmax())
                    if token == eos:
                        break
                    out.append(token)
                    if len(out) >= max_new_tokens:
                        break
                    logits = model(input_ids=torch.tensor([[token]], device=device), logits_to_keep=1,
                                   position_ids=torch.tensor([[pos]], device=device)).logits
                    pos += 1
                answers.append(tok.decode(out, skip_special_tokens=True))
        return {"answers": answers}

    def postprocess(self, model_outputs: Any, **params: Any) -> Any:
        answers = model_outputs["answers"]
        return {"answer": answers[0]} if params["single"] else {"answers": answers}
