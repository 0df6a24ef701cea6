"""`skipkv bench`: the benchmarks (skipkv/bench/cli.py) and the analysis tools that read finished runs' records.

    skipkv bench grid docs/results/runs/longctx4k --against laprox-pool7
    skipkv bench paired RUN_A RUN_B
    skipkv bench paper-tables ROOT | reflection-rate RUN... | testbed-calibration RUN...

The analysis tools live in this layer (they read records, run no model), so they join the `bench` parser here:
skipkv/bench/cli.py registers the benchmarks and hands back its subparsers.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from skipkv.bench.cli import register as register_benchmarks
    from skipkv.report import grid, paired, paper_tables, reflection

    bsub = register_benchmarks(sub)
    g = bsub.add_parser("grid", help="a sweep's grid as Markdown tables: Wilson intervals, exact McNemar against a "
                                     "reference policy (records packed or not)",
                        description=(grid.__doc__ or "").splitlines()[0])
    grid.add_arguments(g)
    g.set_defaults(func=grid.run)
    p = bsub.add_parser("paired", help="two eval runs on the same examples: accuracy, exact McNemar, length, "
                                       "identical outputs",
                        description=(paired.__doc__ or "").splitlines()[0])
    p.add_argument("run_a", type=Path, help="a run dir (config.json and records)")
    p.add_argument("run_b", type=Path, help="the run dir to pair with it")
    p.set_defaults(func=paired.run)
    t = bsub.add_parser("paper-tables", help="the SkipKV paper's tables (accuracy and length per method x budget) "
                                             "from a sweep's finished cells",
                        description=(paper_tables.__doc__ or "").splitlines()[0])
    t.add_argument("root", type=Path, help="a sweep's out dir: ROOT/<dataset>/<cell>/summary.json")
    t.set_defaults(func=paper_tables.run)
    for name, func, what in (("reflection-rate", reflection.run_reflection_rate,
                              "how often a model reflects: SEAL's step classes over finished runs' outputs"),
                             ("testbed-calibration", reflection.run_testbed_calibration,
                              "the reflective testbed's calibration table from finished eval runs")):
        r = bsub.add_parser(name, help=what, description=(reflection.__doc__ or "").splitlines()[0])
        r.add_argument("runs", type=Path, nargs="+", help="run dirs (config.json and records, packed or not)")
        r.set_defaults(func=func)
    from skipkv.report import prereg_frontier

    f = bsub.add_parser("prereg-frontier", help="the registered analyses of the frontier grids (issue 45): "
                                                "reasoning or long prompts",
                        description=(prereg_frontier.__doc__ or "").splitlines()[0])
    f.add_argument("kind", choices=("reasoning", "longctx"))
    f.add_argument("root", type=Path, help="the grid's out dir: ROOT/<set>-b<k>/<cell>/records")
    f.add_argument("--json", help="also write every table here")
    f.set_defaults(func=prereg_frontier.run)
