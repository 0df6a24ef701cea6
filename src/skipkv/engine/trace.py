"""Retention traces: which true positions each layer and kv head kept after every compression of a request.

    results = generate(load_model("random:qwen2"), ["Hello"], SamplingParams(max_new_tokens=64),
                       make_policy("rkv", budget=32, interval=8), trace=True)
    t = results[0].trace                       # a JSON-able dict (see RequestTrace.to_json)
    kept_positions(t, step=0, layer=1, head=0) # positions layer 1 / kv head 0 held right after compression 0

Encoding. A cached position leaves the cache once per (layer, kv head) and never comes back, so one number
per (layer, head, position) says everything: the index of the compression at which it left, or NEVER if it
was still held when the request finished (or was never fed: the last sampled token). The kept set after
compression c is then {p < seen_c : evicted[l, h, p] > c}, where seen_c is how many positions had been fed
at that moment. The array is [L, H, T] uint8 (uint16 past 254 compressions), zlib-compressed, base64 text.

Size: 24 layers x 2 heads x ~1000 positions = 48 KB raw in uint8 whatever the number of compressions
(~10 compressions would cost 10x that as per-compression bitmaps, and 10 x 48 x budget int16 as kept
position lists); evictions come in runs (a window keeps recent tokens together, a layer's heads agree often),
so zlib takes it to a few KB, ~1/3 more as base64 (measured in docs/viewer.md).

The policy's own per-request view (`Policy.trace_state`: sentences, flags) is stored as it was at each
compression and at the end. Token texts are stored too, so a viewer needs no tokenizer.
"""

from __future__ import annotations

import base64
import zlib
from typing import Any

import numpy as np
import torch

NEVER_U8, NEVER_U16 = 0xFF, 0xFFFF
TRACE_VERSION = 1


class RequestTrace:
    """What one request's compressions did, recorded in place as they happen.

    evicted: [L, H, P] int32 on the host, P = prompt_len + max_new_tokens; -1 = not (yet) evicted.
    """

    def __init__(self, num_layers: int, num_kv_heads: int, max_positions: int) -> None:
        self.evicted = torch.full((num_layers, num_kv_heads, max_positions), -1, dtype=torch.int32)
        self.steps: list[dict[str, Any]] = []  # per compression: generated, seen, state

    def record(self, pos: torch.Tensor, lengths: torch.Tensor, generated: int, state: dict | None) -> None:
        """Note one compression that just finished. pos: [L, H, C] the slot's true positions after compaction;
        lengths: [L] valid entries per layer (host; the longest head's, entries past a head's own are -1)."""
        L, H, C = pos.shape
        step = len(self.steps)
        # [L, H, C]; a head-split store's heads may hold fewer than their layer's longest (padded with -1)
        valid = (torch.arange(C, device=pos.device) < lengths.to(pos.device)[:, None, None]) & (pos >= 0)
        seen = int(pos.masked_fill(~valid, -1).amax()) + 1  # the newest fed position is always kept (window)
        alive = torch.zeros(L, H, seen + 1, dtype=torch.bool, device=pos.device)
        # Invalid entries scatter into the spare column `seen`, which is dropped.
        alive.scatter_(2, pos.long().masked_fill(~valid, seen).clamp_(0, seen), True)
        alive = alive[..., :seen].cpu()
        ev = self.evicted[..., :seen]
        ev[~alive & (ev < 0)] = step
        self.steps.append({"generated": generated, "seen": seen, "state": state})

    def to_json(self, prompt_tokens: list[str], output_tokens: list[str], final_state: dict | None) -> dict[str, Any]:
        """The JSON-able trace: token texts, per-compression (generated, seen, state), the eviction array."""
        total = len(prompt_tokens) + len(output_tokens)
        ev = self.evicted[..., :total].numpy()
        dtype, never = (np.uint8, NEVER_U8) if len(self.steps) < NEVER_U8 else (np.uint16, NEVER_U16)
        arr = np.where(ev < 0, never, ev).astype(dtype)
        data = base64.b64encode(zlib.compress(arr.tobytes(), 9)).decode("ascii")
        return {
            "version": TRACE_VERSION, "num_layers": int(arr.shape[0]), "num_kv_heads": int(arr.shape[1]),
            "prompt_len": len(prompt_tokens), "prompt_tokens": prompt_tokens, "output_tokens": output_tokens,
            "compressions": self.steps, "final_state": final_state,
            "evicted": {"dtype": np.dtype(dtype).name, "shape": list(arr.shape), "codec": "zlib+base64", "data": data},
        }


def decode_evicted(trace: dict[str, Any]) -> np.ndarray:
    """The eviction array [L, H, T] as int64: compression index at which each position left; -1 = never."""
    meta = trace["evicted"]
    dtype = np.dtype(meta["dtype"])
    size = int(np.prod(meta["shape"])) * dtype.itemsize
    # Decompress no more than the shape needs: a crafted trace cannot inflate past it (a zlib bomb).
    inflater = zlib.decompressobj()
    try:
        data = inflater.decompress(base64.b64decode(meta["data"], validate=True), size + 1)
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"evicted data is not zlib+base64 ({exc})") from None
    if len(data) != size:
        raise ValueError(f"evicted data holds {len(data)} bytes, its shape {meta['shape']} needs {size}")
    arr = np.frombuffer(data, dtype=dtype).reshape(meta["shape"]).astype(np.int64)
    arr[arr == np.iinfo(dtype).max] = -1
    return arr


def kept_positions(trace: dict[str, Any], step: int, layer: int, head: int) -> list[int]:
    """True positions held by (layer, head) right after compression `step` (ascending)."""
    ev = decode_evicted(trace)[layer, head]
    seen = trace["compressions"][step]["seen"]
    return [p for p in range(seen) if ev[p] < 0 or ev[p] > step]


def token_texts(tokenizer, ids: list[int]) -> list[str]:
    """One display text per token id; a character split over several tokens (bytes of one UTF-8 character)
    is shown on the last token of the group, the others empty, so the texts concatenate to the decoded text."""
    out: list[str] = []
    pending: list[int] = []

    def flush() -> None:
        text = tokenizer.decode(pending, skip_special_tokens=False)
        if "\ufffd" in text:  # not one character after all (random bytes): each token on its own
            out.extend(tokenizer.decode([t], skip_special_tokens=False) for t in pending)
        else:
            out.extend([""] * (len(pending) - 1) + [text])
        pending.clear()

    for tid in ids:
        pending.append(int(tid))
        # An incomplete UTF-8 sequence decodes to U+FFFD at its end: wait (up to 4 bytes) for the rest.
        if len(pending) < 4 and tokenizer.decode(pending, skip_special_tokens=False).endswith("\ufffd"):
            continue
        flush()
    if pending:
        flush()
    return out
