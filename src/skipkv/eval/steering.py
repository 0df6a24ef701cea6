"""Build a SEAL steering vector from the model's own full-cache chains (`skipkv steer build`).

    skipkv steer build --model qwen2.5-coder-0.5b-instruct --dataset math500 --offset 400 --limit 20 \\
        --layers 8,12,16 --max-tokens 256 --out benchmarks/steering/qwen2.5-coder-0.5b-math500.safetensors

Recipe (SEAL, research/algorithms.md §4): generate each example greedily with the full cache (the eval prompt
code, chat style by default), split the generation at "\\n\\n" into steps, classify each step by SEAL's
keywords (transition first, then reflection, else execution), and take as the step's feature the hidden state
entering decoder layer L at the "\\n\\n" token that precedes the step (as in the EasySteer replication: the
state where the next step is decided, which is also where steering adds its vector). The text before the
first "\\n\\n" has no such token and is skipped. Per layer, v = mean(reflection ∪ transition) − mean(execution).
Hidden states come from one plain HF forward over prompt + generation (`output_hidden_states`; entry L is
the input of layer L).

Separability (metadata, to pick a layer from data): the examples are split in two halves (by order); a
vector built from the first half projects the second half's steps; AUC (probability that a random
non-execution step projects higher than a random execution step) and Fisher ratio (Δmean² / (var₁ + var₀))
of those projections. `best_layer` = the highest held-out AUC (first listed layer when none is computable).

The ids of the examples used are recorded; `skipkv eval` refuses to evaluate a vector on them.
It lives in eval, not in `skipkv.steering`, because it drives the engine (steering itself sits below it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from skipkv.errors import SkipKVError
from skipkv.sentences.tracker import TokenTables, classify_step
from skipkv.steering.vector import SteeringFile

CLASSES = ("execution", "reflection", "transition")


@dataclass
class Step:
    example: int  # index of the chain it came from
    label: str  # one of CLASSES
    features: dict[int, torch.Tensor]  # layer -> [E] hidden state entering that layer at the preceding "\n\n"


def nn_boundaries(tables: TokenTables, ids: list[int]) -> list[int]:
    """Indices of the tokens of `ids` that complete a "\\n\\n" (same rule as the steering gate)."""
    out, prev_nl = [], False
    for i, t in enumerate(ids):
        ok = 0 <= t < tables.has_nn.shape[0]
        if ok and (bool(tables.has_nn[t]) or (prev_nl and bool(tables.starts_nl[t]))):
            out.append(i)
        prev_nl = ok and bool(tables.ends_nl[t])
    return out


@torch.inference_mode()
def chain_steps(bundle, tables: TokenTables, prompt_ids: list[int], output_ids: list[int], layers: list[int],
                example: int = 0) -> list[Step]:
    """The classified steps of one chain with their features at `layers`."""
    bounds = nn_boundaries(tables, output_ids)
    if not bounds:
        return []
    ids = torch.tensor([prompt_ids + output_ids], device=bundle.device)
    hidden = bundle.model.model(input_ids=ids, output_hidden_states=True).hidden_states  # L+1 x [1, N, E]
    P = len(prompt_ids)
    steps = []
    for k, b in enumerate(bounds):
        end = bounds[k + 1] + 1 if k + 1 < len(bounds) else len(output_ids)
        text = bundle.tokenizer.decode(output_ids[b + 1:end], skip_special_tokens=True)
        if not text.strip():
            continue
        steps.append(Step(example, classify_step(text), {L: hidden[L][0, P + b].float().cpu() for L in layers}))
    return steps


def direction(steps: list[Step], layer: int) -> torch.Tensor | None:
    """mean(reflection ∪ transition) − mean(execution) at `layer`, or None when a side is empty."""
    pos = [s.features[layer] for s in steps if s.label != "execution"]
    neg = [s.features[layer] for s in steps if s.label == "execution"]
    if not pos or not neg:
        return None
    return torch.stack(pos).mean(0) - torch.stack(neg).mean(0)


def auc(pos: torch.Tensor, neg: torch.Tensor) -> float:
    """P(a positive scores above a negative), ties counted half (Mann-Whitney)."""
    diff = pos[:, None] - neg[None, :]
    return float(((diff > 0).float() + 0.5 * (diff == 0).float()).mean())


def separability(steps: list[Step], layers: list[int], num_examples: int) -> dict[int, dict]:
    """Held-out AUC and Fisher ratio per layer (see module docstring); None where a half lacks a class."""
    half = num_examples // 2
    train = [s for s in steps if s.example < half]
    test = [s for s in steps if s.example >= half]
    out: dict[int, dict] = {}
    for L in layers:
        v = direction(train, L)
        pos = [s.features[L] for s in test if s.label != "execution"]
        neg = [s.features[L] for s in test if s.label == "execution"]
        if v is None or not pos or not neg:
            out[L] = {"auc": None, "fisher": None}
            continue
        p, n = torch.stack(pos) @ v, torch.stack(neg) @ v
        var = (p.var(unbiased=False) + n.var(unbiased=False)).item()
        out[L] = {"auc": auc(p, n), "fisher": (p.mean() - n.mean()).item() ** 2 / var if var > 0 else None}
    return out


def build_from_chains(bundle, chains: list[tuple[str, list[int], list[int]]], layers: list[int]) -> tuple[dict, dict]:
    """chains: (example id, prompt ids, output ids). Returns ({layer: v [E]}, metadata without model/dataset)."""
    tables = TokenTables.build(bundle.tokenizer, gate=True)
    steps: list[Step] = []
    for i, (_, prompt_ids, output_ids) in enumerate(chains):
        steps += chain_steps(bundle, tables, prompt_ids, output_ids, layers, example=i)
    counts = {c: sum(s.label == c for s in steps) for c in CLASSES}
    vectors = {L: direction(steps, L) for L in layers}
    if any(v is None for v in vectors.values()):
        hint = ("no step reflects or changes approach: this model may not re-check itself at all (see "
                "skipkv bench reflection-rate on its eval runs), and a vector needs a model that does"
                if counts["execution"] and not counts["reflection"] + counts["transition"]
                else "use more examples or longer generations")
        raise SkipKVError(f"steering build found {counts} steps at \\n\\n tokens in {len(chains)} chains; it needs "
                          f"both execution and reflection/transition steps ({hint})")
    sep = separability(steps, layers, len(chains))
    scored = [(sep[L]["auc"], -k, L) for k, L in enumerate(layers) if sep[L]["auc"] is not None]
    best = max(scored)[2] if scored else layers[0]
    meta = {"ids": [c[0] for c in chains], "hidden_size": int(bundle.model.config.hidden_size), "counts": counts,
            "separability": {str(L): sep[L] for L in layers}, "best_layer": best,
            "best_layer_from": "held-out auc" if scored else "first listed (no held-out auc)"}
    return vectors, meta


def build(model: str, dataset: str, layers: list[int], out: str, limit: int, offset: int = 0,
          max_new_tokens: int = 256, prompt_style: str = "chat", dtype: str = "auto", batch_size: int = 8,
          force_wait: int = 0) -> dict:
    """The whole command: chains -> vectors -> file at `out`. Returns the metadata written."""
    from skipkv.config import EngineConfig, SamplingParams
    from skipkv.engine import generate
    from skipkv.eval import prompts
    from skipkv.eval.datasets import data_request, get_dataset
    from skipkv.models import load_model
    from skipkv.policies import make_policy

    if not layers:
        raise SkipKVError("--layers needs at least one layer")
    from skipkv.config import COUNT_WHY, MAX_COUNT, bounded
    from skipkv.outputs import check_file

    bounded(limit, "--limit", 1, MAX_COUNT, COUNT_WHY)
    bounded(offset, "--offset", 0, MAX_COUNT, COUNT_WHY)
    for L in layers:
        bounded(L, "--layers", 0, 4096, "no model has more decoder layers")
    check_file(out, "--out")  # before the model loads: an unusable --out fails at once, not after the generations
    prompts.check_style(prompt_style)
    ds = get_dataset(dataset)
    sampling = SamplingParams(max_new_tokens=max_new_tokens, force_wait=force_wait)
    EngineConfig(batch_size=batch_size)  # its bounds, before the model loads
    bundle = load_model(model, dtype=dtype)
    num_layers = bundle.model.config.num_hidden_layers
    bad = [L for L in layers if not 0 <= L < num_layers]
    if bad:
        raise SkipKVError(f"steering layer {bad[0]} is outside the model's layers [0, {num_layers})")
    examples = ds.load(data_request({}, bundle.tokenizer, prompt_style))[offset:offset + limit]
    if not examples:
        raise SkipKVError(f"{dataset} has no examples from offset {offset}")
    ids = [prompts.encode(bundle.tokenizer, prompts.render(bundle.tokenizer, ex, prompt_style), prompt_style)
           for ex in examples]
    results = generate(bundle, ids, sampling, make_policy("full"), EngineConfig(batch_size=batch_size))
    chains = [(ex.id, p, r.token_ids[:-1] if r.finish_reason == "eos" else r.token_ids)
              for ex, p, r in zip(examples, ids, results)]
    vectors, meta = build_from_chains(bundle, chains, sorted(set(layers)))
    meta = {"model": model, "dataset": dataset, "offset": offset, "limit": limit, "max_new_tokens": max_new_tokens,
            "prompt_style": prompt_style, "force_wait": force_wait, "dtype": str(bundle.dtype).removeprefix("torch."),
            "recipe": "mean(reflection+transition) - mean(execution), hidden entering the layer at the \\n\\n "
                      "token before each step; SEAL keyword classes", **meta}
    SteeringFile.save(out, vectors, meta)
    return meta
