"""Layer-output fidelity (LaProx's Figure 4): per layer, how close the attention output of queries the policies
did NOT score stays to the full cache's once a policy has compressed the prompt.

    skipkv bench fidelity --model qwen2.5-coder-0.5b-instruct --dataset niah --lengths 4096,8192 \\
        --policies snapkv,pyramidkv,laprox --budget-ratio 0.1 --out docs/fidelity.json
    skipkv bench fidelity ... --queries heldout --steps 32    # a held-out prompt window instead
    skipkv bench fidelity ... --queries window                 # the scoring window itself (favours the scorers)

Which queries are compared (`--queries`, `--steps`):
  - decode (default): the first `steps` decode steps of the full cache's greedy answer (EOS ignored). The
    policies compress the whole prompt, scoring it with its last window, and never see these queries.
  - heldout: the last `steps` prompt tokens are held out: the policies compress the prompt before them (their
    scoring window is the window just before the held-out one), and the held-out tokens are then fed one at a
    time with the full cache, as decode steps.
  - window: the last `--window` prompt queries, i.e. the very queries SnapKV/LaProx-style scores are built
    from; this favours those scores by construction and is kept only to compare with earlier figures.
In decode and heldout modes the entries of the fed tokens (positions after the compressed prompt) come from
the full run and are appended to every compressed store, so only the prompt's compression differs.

For each example, the prompt (or the part before the held-out window) is prefilled once with the full cache
and, for policies that need hidden states, once per policy (the others compress a copy of the full prefill,
which is the same thing since compression runs after the forward); every policy is given budget = ratio x
prompt tokens per layer (LaProx spends budget x layers model-wide). Every layer's queries are those of the
full run (post-RoPE), so each layer's inputs are identical in both and the comparison isolates that layer's
approximation. Per layer l and query j, the attention output after o_proj, sum_h softmax(q_j K_h^T) V_h W_O^h,
is computed against the full store and against the compressed store (each key visible iff its true position
<= the query's), and the cosine similarity between the two [E] vectors is averaged over the queries and the
examples. Each layer's kept share of the prompt is recorded too (LaProx's per-layer budgets, the seed's
Figure 6). Printed as a markdown table (mean and worst layer), written as JSON, and plotted (one line per
policy across layers, one panel per length).

On needle sets (niah, niah_multikey) it also reports *needle retention*: per layer, the share of the answer's
tokens (every occurrence of the answer in the context, located through the tokenizer's offsets) that the
compressed store still holds, averaged over kv heads; and the share of layers that hold the whole answer in
every kv head. This says whether a policy that misses the needle dropped it, or kept it and lost it elsewhere.
Policies are specs, `name[:knob=value,...]`, e.g. `laprox:kernel=7,normalize=sum`.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from skipkv.config import SamplingParams
from skipkv.engine import make_requests
from skipkv.engine.runner import ModelRunner
from skipkv.engine.shared import branch, capture_window, prefill_full, shares_prefill
from skipkv.errors import SkipKVError
from skipkv.models.patches import routed

QUERY_MODES = ("decode", "heldout", "window")


def layer_output(module, q: torch.Tensor, qpos: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 kpos: torch.Tensor) -> torch.Tensor:
    """Attention output after o_proj of queries q [Hq, w, D] (true positions qpos [w]) over one slot's cache
    k/v [H, n, D] (true positions kpos [H, n]): [w, E] (fp32)."""
    Hq, w, D = q.shape
    H = k.shape[0]
    G = Hq // H
    scale = getattr(module, "scaling", D**-0.5)
    logits = torch.einsum("hgwd,hnd->hgwn", q.float().view(H, G, w, D), k.float()) * scale
    visible = kpos[:, None, None, :] <= qpos[None, None, :, None]  # [H, 1, w, n]
    probs = torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)
    out = torch.einsum("hgwn,hnd->hgwd", probs, v.float()).reshape(Hq, w, D)  # head order h * G + g
    x = out.permute(1, 0, 2).reshape(w, Hq * D)
    return x @ module.o_proj.weight.float().T + (module.o_proj.bias.float() if module.o_proj.bias is not None else 0)


def _prefill(bundle, policy, ids: list[int]) -> ModelRunner:
    """`policy`'s own prefill (for a policy that cannot compress a copy of the full one, see engine/shared.py)."""
    runner = ModelRunner(bundle, policy, num_slots=1)
    reqs = make_requests(bundle, [ids], SamplingParams(max_new_tokens=1), policy)
    runner.prefill(reqs)
    return runner


def needle_positions(tokenizer, text: str, ids: list[int], answers) -> list[int] | None:
    """Token positions of every occurrence of the answer string(s) in the prompt text, or None when the
    tokenizer gives no offsets or re-encoding does not reproduce `ids` (then retention is not reported)."""
    answers = [answers] if isinstance(answers, str) else [a for a in answers if isinstance(a, str)]
    if not answers or not getattr(tokenizer, "is_fast", False):
        return None
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    if list(enc["input_ids"]) != list(ids):
        return None
    spans = []
    for a in answers:
        start = text.find(a)
        while a and start >= 0:
            spans.append((start, start + len(a)))
            start = text.find(a, start + 1)
    pos = [t for t, (b, e) in enumerate(enc["offset_mapping"]) if any(b < se and e > ss for ss, se in spans)]
    return pos or None


def retention(store, layer: int, needle: torch.Tensor) -> tuple[float, bool]:
    """(share of needle tokens held, averaged over kv heads; whether every head holds all of them) in one layer."""
    n = int(store.lengths[layer, 0])
    held = torch.stack([torch.isin(needle,
                                   store.pos[layer][0, h, :n].long()) for h in range(store.pos[layer].shape[1])])
    return float(held.float().mean()), bool(held.all())


def feed_full(full: ModelRunner, req, first: int, steps: int, forced: list[int] | None = None) -> None:
    """Decode `steps` tokens one at a time on the full-cache runner, so that its query buffer and store then hold
    their queries and entries: the greedy answer from `first` on, or the `forced` tokens (a held-out window)."""
    token = forced[0] if forced else first
    for i in range(steps):
        req.add_token(token, time.perf_counter())
        full.fit(exact=True)
        [nxt] = full.decode()  # feeds `token` (the request's last output) at the next position
        token = forced[i + 1] if forced and i + 1 < steps else nxt


def fidelity_one(bundle, ids: list[int], policies: dict, window: int, needle: list[int] | None = None,
                 queries: str = "decode", steps: int = 32) -> dict[str, dict[str, Any]]:
    """Per policy label: {"cosine": the per-layer mean cosine similarity [L], "kept": entries per layer, and with
    `needle` positions, "needle": per-layer retention [L] and "needle_whole": per-layer all-heads-hold-it flags
    [L]} on one prompt, over the queries `queries` selects (see the module docstring)."""
    if queries not in QUERY_MODES:
        raise SkipKVError(f"unknown query mode {queries!r}; choose from {', '.join(QUERY_MODES)}")
    fed = 0 if queries == "window" else steps
    prefix = ids[: len(ids) - steps] if queries == "heldout" else ids
    P = len(prefix)
    layers = bundle.model.model.layers
    shared = max(window, capture_window([p for p in policies.values() if shares_prefill(p)]))
    with routed(bundle.model), torch.inference_mode():
        sampling = SamplingParams(max_new_tokens=fed + 1, ignore_eos=True)
        full, req, first = prefill_full(bundle, prefix, max(shared, fed), sampling)
        # Every policy compresses a copy of the prompt prefill BEFORE the full runner decodes on.
        runs = {name: (branch(bundle, full, policy, prefix, SamplingParams(max_new_tokens=1))[0]
                       if shares_prefill(policy, shared) else _prefill(bundle, policy, prefix))
                for name, policy in policies.items()}
        if fed:
            feed_full(full, req, first, fed, list(ids[P:]) if queries == "heldout" else None)
            qpos = torch.arange(P, P + fed, device=bundle.device)
        else:
            qpos = torch.arange(P - window, P, device=bundle.device)
        slot = torch.tensor([0], device=bundle.device)
        fs = full.store
        refs, qs, tails = [], [], []
        assert full.queries is not None  # the full run buffers the window's queries
        for l, layer in enumerate(layers):
            q = full.queries.recent(l, slot, len(qpos))[0]
            n = int(fs.lengths[l, 0])
            refs.append(layer_output(layer.self_attn, q, qpos, fs.k[l][0, :, :n], fs.v[l][0, :, :n],
                                     fs.pos[l][0, :, :n]))
            qs.append(q)
            # The fed tokens' entries (identical under every policy: only the prompt was compressed).
            tails.append((fs.k[l][0, :, P:n], fs.v[l][0, :, P:n], fs.pos[l][0, :, P:n]))
        out = {}
        pos = torch.tensor(needle, device=bundle.device) if needle else None
        for name, run in runs.items():
            s = run.store
            cos, kept, whole, sizes = [], [], [], []
            for l, layer in enumerate(layers):
                n = int(s.lengths[l, 0])
                sizes.append(n)
                k, v, kp = (torch.cat([a[0, :, :n], t], dim=1) for a, t in zip((s.k[l], s.v[l], s.pos[l]), tails[l]))
                got = layer_output(layer.self_attn, qs[l], qpos, k, v, kp)
                cos.append(float(torch.nn.functional.cosine_similarity(got, refs[l], dim=-1).mean()))
                if pos is not None:
                    share, all_heads = retention(s, l, pos)
                    kept.append(share)
                    whole.append(all_heads)
            out[name] = {"cosine": cos, "kept": sizes, "scored_len": P,
                         **({"needle": kept, "needle_whole": whole} if pos is not None else {})}
    return out


def format_table(results: dict, lengths: list[int]) -> str:
    needles = any("needle" in r for by_len in results.values() for r in by_len.values())
    head = "| policy | length | mean cosine | worst layer (cosine) |"
    rule = "|---|---:|---:|---:|"
    if needles:
        head += " needle tokens held (mean over layers) | layers holding the whole needle |"
        rule += "---:|---:|"
    lines = [head, rule]
    for name, by_len in results.items():
        for n in lengths:
            r = by_len[str(n)]
            per_layer = r["per_layer"]
            worst = min(range(len(per_layer)), key=per_layer.__getitem__)
            line = f"| {name} | {n} | {statistics.fmean(per_layer):.4f} | {worst} ({per_layer[worst]:.4f}) |"
            if needles:
                line += (f" {statistics.fmean(r['needle']):.0%} | {statistics.fmean(r['needle_whole']):.0%} |"
                         if r.get("needle") else " - | - |")
            lines.append(line)
    return "\n".join(lines)


def plot(results: dict, lengths: list[int], path: Path, title: str) -> None:
    from matplotlib.figure import Figure

    fig = Figure(figsize=(5 * len(lengths), 6.6), dpi=120)
    grid = fig.subplots(2, len(lengths), squeeze=False)
    for col, n in enumerate(lengths):
        top, bottom = grid[0][col], grid[1][col]
        for name, by_len in results.items():
            r = by_len[str(n)]
            top.plot(range(len(r["per_layer"])), r["per_layer"], marker="o", markersize=3, label=name)
            if r.get("kept_share"):
                bottom.plot(range(len(r["kept_share"])), r["kept_share"], marker="o", markersize=3, label=name)
        top.set_title(f"{n} tokens")
        top.set_ylabel("cosine(attention output, full)")
        bottom.set_xlabel("layer")
        bottom.set_ylabel("share of the prompt kept (per layer)")
        for ax in (top, bottom):
            ax.grid(alpha=0.3)
    grid[0][0].legend(fontsize=7)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)


def run_fidelity(model: str, dataset: str, lengths: list[int], policies: list[str], budget_ratio: float,
                 examples: int, window: int, dtype: str, out: str | None, prompt_style: str = "chat",
                 queries: str = "decode", steps: int = 32) -> dict:
    from skipkv.eval import prompts
    from skipkv.eval.datasets import data_request, get_dataset
    from skipkv.hardware import environment
    from skipkv.models import load_model
    from skipkv.outputs import check_file, write_atomic
    from skipkv.policies import parse_policy_spec

    if out is not None:
        check_file(out, "--out")  # before the model loads
        check_file(Path(out).with_suffix(".png"), "--out")
    if not 0 < budget_ratio <= 1:
        raise SkipKVError(f"budget ratio must be in (0, 1], got {budget_ratio}")
    if queries not in QUERY_MODES:
        raise SkipKVError(f"unknown query mode {queries!r}; choose from {', '.join(QUERY_MODES)}")
    if steps <= 0:
        raise SkipKVError(f"--steps must be positive, got {steps}")
    for p in policies:  # the per-layer comparison below reads a uniform store (every kv head of a layer alike)
        if parse_policy_spec(p, budget=1 << 20)[1].head_split:
            raise SkipKVError(f"bench fidelity does not compare head-split policies yet ({p})")
    ds = get_dataset(dataset)
    if not getattr(ds, "long_context", False):
        raise SkipKVError(f"bench fidelity runs on long-context sets (niah, ...); {dataset} is not one")
    bundle = load_model(model, dtype=dtype)
    exs = ds.load(data_request({"lengths": list(lengths)}, bundle.tokenizer, prompt_style))
    sums: dict[str, dict[str, list[dict]]] = {p: {str(n): [] for n in lengths} for p in policies}
    prompt_lens: dict[str, dict[str, list[int]]] = {p: {str(n): [] for n in lengths} for p in policies}
    for n in lengths:
        chosen = [e for e in exs if int(e.meta.get("length", 0)) == n][:examples]
        for ex in chosen:
            text = prompts.render(bundle.tokenizer, ex, prompt_style)
            ids = prompts.encode(bundle.tokenizer, text, prompt_style)
            scored = len(ids) - steps if queries == "heldout" else len(ids)  # the prompt the policies compress
            if scored <= window:
                raise SkipKVError(f"a {len(ids)}-token prompt leaves {scored} tokens to score, not more than the "
                                  f"observation window ({window})")
            budget = max(1, round(budget_ratio * scored))
            built = dict(parse_policy_spec(p, budget=budget) for p in policies)
            needle = needle_positions(bundle.tokenizer, text, ids, ex.reference) if dataset.startswith("niah") else None
            for p, got in fidelity_one(bundle, ids, built, window, needle, queries, steps).items():
                sums[p][str(n)].append(got)
                prompt_lens[p][str(n)].append(got["scored_len"])
    results: dict[str, Any] = {}
    for p, by_len in sums.items():
        results[p] = {}
        for k, v in by_len.items():
            r = {"per_layer": [statistics.fmean(c) for c in zip(*(x["cosine"] for x in v))], "examples": len(v),
                 "kept_share": [statistics.fmean(c) for c in zip(*(
                     [n / int(k) for n in x["kept"]] for x, k in zip(v, prompt_lens[p][k])))]}
            if v and all("needle" in x for x in v):
                r["needle"] = [statistics.fmean(c) for c in zip(*(x["needle"] for x in v))]
                r["needle_whole"] = [statistics.fmean(c) for c in zip(*(x["needle_whole"] for x in v))]
            results[p][k] = r
    table = format_table(results, lengths)
    print(table)
    report = {"model": model, "dataset": dataset, "lengths": lengths, "budget_ratio": budget_ratio,
              "window": window, "queries": queries, "steps": steps if queries != "window" else None,
              "dtype": str(bundle.dtype).removeprefix("torch."), "examples_per_length": examples,
              "machine": environment(bundle.dtype_choice),
              "results": results, "table": table}
    if out is not None:
        path = check_file(out, "--out")  # again: the place may have changed while the benchmark ran
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, json.dumps(report, indent=2))
        plot(results, lengths, path.with_suffix(".png"), f"{model} · {dataset} · budget {budget_ratio:g} of the prompt")
    return report
