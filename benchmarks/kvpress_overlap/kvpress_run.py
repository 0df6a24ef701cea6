"""kvpress's side of the kept-position overlap: prefill-compress token ids with kvpress's presses and write what
each (layer, kv head) keeps. Runs in kvpress's venv (setup_venv.sh) and never imports skipkv.

    ~/.cache/skipkv/kvpress-venv/bin/python benchmarks/kvpress_overlap/kvpress_run.py PLAN.json OUT.json

PLAN.json (written by overlap.py): {"model_dir", "dtype", "sequences": [[ids]], "runs": [{"method", "ratio",
"seq", "params"}]}. OUT.json: {"kvpress": version, "transformers": version, "runs": [{..., "kept": [L][H] sorted
positions}]}.

How the kept positions are read, per press (kvpress 0.5.5):
- ScorerPress subclasses (SnapKVPress, ExpectedAttentionPress) gather the kept keys into the cache: each kept key
  is matched row for row against the same layer's keys of an uncompressed prefill (a prefill's compression runs
  after the layer's attention, so every layer sees the same hidden states as without compression);
- head-wise presses (CriticalAdaKVPress, KVzipPress) keep every key and leave `masked_key_indices` (batch, head,
  position) on each attention module: kept = all positions less the masked ones.
"""

from __future__ import annotations

import json
import sys
from importlib.metadata import version

import torch
import transformers
from kvpress import CriticalAdaKVPress, ExpectedAttentionPress, KVzipPress, SnapKVPress
from transformers import AutoModelForCausalLM, DynamicCache


def make_press(method: str, ratio: float, p: dict):
    """The kvpress press for one of overlap.py's methods, its knobs from `p`."""
    if method == "snapkv":
        return SnapKVPress(compression_ratio=ratio, window_size=p["window_size"], kernel_size=p["kernel_size"])
    if method == "criticalkv_ada":
        inner = SnapKVPress(compression_ratio=ratio, window_size=p["window_size"], kernel_size=p["kernel_size"])
        return CriticalAdaKVPress(press=inner, alpha_safeguard=p["alpha_safeguard"],
                                  first_stage_ratio=p["first_stage_ratio"], epsilon=p["epsilon"])
    if method == "expected_attention":
        return ExpectedAttentionPress(compression_ratio=ratio, n_future_positions=p["n_future_positions"],
                                      n_sink=p["n_sink"], use_covariance=True, use_vnorm=True, epsilon=0.0)
    if method == "kvzip":
        return KVzipPress(compression_ratio=ratio, layerwise=p["layerwise"], n_sink=p["n_sink"])
    raise SystemExit(f"kvpress_run.py: unknown method {method!r}")


def prefill(model, ids: torch.Tensor, press=None) -> DynamicCache:
    cache = DynamicCache()
    # KVzipPress builds its causal mask with torch.full(..., finfo(model dtype).min) and no dtype, which overflows
    # the default float32 for an fp64 model: the default dtype follows the model's while a press runs.
    default = torch.get_default_dtype()
    torch.set_default_dtype(next(model.parameters()).dtype)
    try:
        with torch.inference_mode():
            if press is None:
                model(ids, past_key_values=cache)
            else:
                with press(model):
                    model(ids, past_key_values=cache)
    finally:
        torch.set_default_dtype(default)
    return cache


def matched_positions(kept_keys: torch.Tensor, full_keys: torch.Tensor) -> list[list[int]]:
    """kept_keys [H, k, D], full_keys [H, n, D] -> per head the sorted positions of the kept rows (exact match)."""
    out = []
    for h in range(full_keys.shape[0]):
        eq = (kept_keys[h][:, None, :] == full_keys[h][None, :, :]).all(dim=-1)  # [k, n]
        if not bool((eq.sum(dim=1) == 1).all()):
            raise SystemExit("kvpress_run.py: a kept key does not match exactly one prefill key")
        out.append(sorted(eq.float().argmax(dim=1).tolist()))
    return out


def masked_kept(model, n: int) -> list[list[list[int]]]:
    """Per layer and kv head the positions not in the attention module's masked_key_indices."""
    H = model.config.num_key_value_heads
    kept = []
    for layer in model.model.layers:
        mask = torch.ones(H, n, dtype=torch.bool)
        idx = getattr(layer.self_attn, "masked_key_indices", None)
        if idx is not None:
            _, heads, pos = idx
            mask[heads.cpu(), pos.cpu()] = False
        kept.append([torch.nonzero(mask[h]).flatten().tolist() for h in range(H)])
    return kept


def main() -> None:
    plan = json.loads(open(sys.argv[1]).read())
    dtype = getattr(torch, plan["dtype"])
    # sdpa: kvpress's head-wise presses refuse eager attention.
    model = AutoModelForCausalLM.from_pretrained(plan["model_dir"], dtype=dtype, attn_implementation="sdpa").eval()
    seqs = [torch.tensor([s]) for s in plan["sequences"]]
    full = [prefill(model, ids) for ids in seqs]
    out = []
    for run in plan["runs"]:
        ids = seqs[run["seq"]]
        n = ids.shape[1]
        press = make_press(run["method"], run["ratio"], run["params"])
        for layer in model.model.layers:  # left by an earlier head-wise press
            layer.self_attn.masked_key_indices = None
        cache = prefill(model, ids, press)
        if run["method"] in ("criticalkv_ada", "kvzip"):
            kept = masked_kept(model, n)
        else:
            kept = [matched_positions(cache.layers[i].keys[0], full[run["seq"]].layers[i].keys[0])
                    for i in range(len(model.model.layers))]
        out.append({**run, "kept": kept})
        print(f"kvpress {run['method']} ratio {run['ratio']} seq {run['seq']}: "
              f"{sum(len(h) for layer in kept for h in layer)} kept", file=sys.stderr)
    with open(sys.argv[2], "w") as f:
        json.dump({"kvpress": version("kvpress"), "transformers": transformers.__version__,
                   "torch": torch.__version__, "runs": out}, f)


if __name__ == "__main__":
    main()
