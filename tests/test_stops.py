"""Stop strings stop generation however many tokens they span (CJK and astral characters are 3-4 byte-level
tokens each), in the engine, `generate`, the streamed text and the server, streamed or not.

The model's tokens are scripted (the sampler is replaced), so the output holds the stop string for sure."""

from __future__ import annotations

import pytest

from skipkv import SamplingParams, generate, make_policy
from skipkv.config import EngineConfig
from skipkv.engine.detokenize import TextStream

# (text before the stop, stop string, text after it): stops of 10-16 characters that span 30-64 tokens.
VARIANTS = [
    ("答案是", "因此最终的答案就是四十二", "。后面还有很多字"),
    ("x ", "😀😁😂🤣😃😄😅😆😉😊😋😎", " tail text"),
    ("", "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝔰𝔱𝔬𝔭!", "and more"),
    ("한국어 ", "여기서멈춰야합니다정말로", " 계속"),
    ("mixed: ", "stop→停止→🛑→Ende→終わり", "...rest"),
]


def scripted(monkeypatch, tokenizer, text: str) -> list[int]:
    """Make the runner sample `text`'s tokens in order, then spaces (for every request alike)."""
    import skipkv.engine.runner as runner

    script = tokenizer.encode(text, add_special_tokens=False)
    filler = tokenizer.encode(" ", add_special_tokens=False)[0]
    monkeypatch.setattr(runner, "sample", lambda logits, requests: [
        script[len(r.output_ids)] if len(r.output_ids) < len(script) else filler for r in requests])
    return script


@pytest.mark.parametrize("before,stop,after", VARIANTS)
def test_long_stop_strings_stop_the_engine(tiny, monkeypatch, before, stop, after):
    script = scripted(monkeypatch, tiny.tokenizer, before + stop + after)
    span = len(tiny.tokenizer.encode(before + stop, add_special_tokens=False))
    assert len(tiny.tokenizer.encode(stop, add_special_tokens=False)) > len(stop) + 8  # past the old window
    sp = SamplingParams(max_new_tokens=len(script) + 40, ignore_eos=True, stop=("never here", stop))
    res = generate(tiny, ["a prompt"], sp, make_policy("rkv", budget=32, window=4, interval=8),
                   EngineConfig(batch_size=2))[0]
    assert res.finish_reason == "stop"
    assert res.generated_tokens == span  # stopped at the token that completed it, not later
    assert res.text == before
    # The streamed deltas add up to the same text.
    ts = TextStream(tiny.tokenizer, sp.stop)
    streamed = "".join(ts.add([t]) for t in res.token_ids) + ts.finish(res.text)
    assert streamed == before


def test_the_earliest_of_several_long_stops_wins(tiny, monkeypatch):
    a, b = VARIANTS[0][1], VARIANTS[1][1]
    scripted(monkeypatch, tiny.tokenizer, "pre " + b + " mid " + a + " end")
    sp = SamplingParams(max_new_tokens=200, ignore_eos=True, stop=(a, b))
    res = generate(tiny, ["p"], sp, make_policy("full"), EngineConfig(batch_size=1))[0]
    assert res.finish_reason == "stop" and res.text == "pre "


def test_long_stops_stop_the_server(tiny, monkeypatch):
    pytest.importorskip("fastapi")
    httpx = pytest.importorskip("httpx")
    from skipkv.models import load_model
    from skipkv.serve.app import create_app
    from skipkv.serve.protocol import ServerSettings
    from test_serve import serving

    before, stop, after = VARIANTS[1]
    bundle = load_model("random:qwen2", dtype="fp64")
    script = scripted(monkeypatch, bundle.tokenizer, before + stop + after)
    app = create_app(bundle, make_policy("full"), EngineConfig(batch_size=2),
                     ServerSettings(model_name="m", max_tokens_cap=256))
    body = {"model": "m", "prompt": "hello", "max_tokens": len(script) + 40, "ignore_eos": True, "stop": [stop]}
    with serving(app) as url:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60).json()
        assert r["choices"][0]["finish_reason"] == "stop" and r["choices"][0]["text"] == before
        assert r["usage"]["completion_tokens"] < len(script)
        text, n = "", 0
        with httpx.stream("POST", url + "/v1/completions", json=dict(body, stream=True), timeout=60) as s:
            for line in s.iter_lines():
                if line.startswith("data: {"):
                    import json

                    ch = json.loads(line[6:])["choices"]
                    if ch:
                        text += ch[0]["text"]
                        n += 1
                        last = ch[0]["finish_reason"]
        assert text == before and last == "stop" and n < len(script)
