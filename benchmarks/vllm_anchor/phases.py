"""Rates by phase from compare.py's JSON: for each run, tokens/s over the whole window and over given time spans
(from its timeline of [seconds, tokens so far, requests that got a token], linearly interpolated at the span ends;
the run's end, `wall_s` with all its tokens, closes the timeline), its first token and its batch at the end.

    python benchmarks/vllm_anchor/phases.py docs/results/vllm_anchor/capped_1gib_64x512x4096_960s.json \\
        [--span 200:470 --span 560:960]
"""

from __future__ import annotations

import argparse
import json


def tokens_at(points: list[tuple[float, float]], t: float) -> float:
    """Cumulative tokens at time t, linear between timeline points (and from 0 tokens at 0 s to the first point),
    flat after the last."""
    if t <= points[0][0]:
        return points[0][1] * t / points[0][0] if points[0][0] > 0 else points[0][1]
    for (t0, n0), (t1, n1) in zip(points, points[1:]):
        if t0 <= t <= t1:
            return n0 + (n1 - n0) * (t - t0) / (t1 - t0) if t1 > t0 else n1
    return points[-1][1]


def phases(run: dict, spans: list[tuple[float, float]]) -> dict:
    points = [(float(t), float(n)) for t, n, *_ in run["timeline"]]
    points.append((float(run["wall_s"]), float(run["generated_tokens"])))
    out = {"arm": run["arm"], "window_tokens_per_s": run["tokens_per_s"], "first_token_s": points[0][0],
           "batch_end": run["timeline"][-1][2] if run["timeline"] and len(run["timeline"][-1]) > 2 else None,
           "max_batch": run.get("max_batch"), "stalls": run.get("stalls")}
    for a, b in spans:
        out[f"tokens_per_s_{a:g}_{b:g}"] = (tokens_at(points, b) - tokens_at(points, a)) / (b - a)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("json")
    ap.add_argument("--span", action="append", default=[], help="START:END in seconds (repeatable)")
    args = ap.parse_args()
    spans = [tuple(float(x) for x in s.split(":")) for s in (args.span or ["200:470", "560:960"])]
    report = json.load(open(args.json))
    for row in (phases(run, spans) for run in report["runs"]):
        print(json.dumps({k: (round(v, 1) if isinstance(v, float) else v) for k, v in row.items()}))


if __name__ == "__main__":
    main()
