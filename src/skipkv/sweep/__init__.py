"""Sweeps: a YAML grid (dataset x policy x budget x seed) expanded into one eval run per cell.

    skipkv sweep examples/sweep_gsm8k.yaml --dry-run     # list the cells and their output dirs
    skipkv sweep examples/sweep_gsm8k.yaml --status      # records per cell, complete or running (no accuracy)
    skipkv sweep examples/sweep_gsm8k.yaml               # run them one after another, in this process
    skipkv sweep examples/sweep_gsm8k.yaml --ray         # one Ray task per cell on a local Ray cluster
    skipkv sweep examples/sweep_gsm8k.yaml --ray ray://head:10001 --num-cpus 4

Each cell writes to its own directory, `OUT/<dataset>/<policy>-b<budget>-s<seed>` (`-r<ratio>` for a budget
ratio, no budget part for a policy that keeps everything), and the runner resumes a directory by itself,
so re-running a sweep only finishes what is missing. The YAML (see `SWEEP_KEYS`) is checked up front,
policy names, knobs, dataset names and options against the registries, and every mistake is a one-line
`SkipKVError`. `expand_sweep` turns the parsed YAML into plain cell dicts (no I/O); a cell becomes the
runner's `EvalConfig` only when it runs (`eval_fields`, `to_eval_config`).

A budget ratio on a dataset with a reference answer length (gsm8k, math500...) is a fraction of the
full-cache run's mean generation length, so such a cell refers to the sweep's own full-cache cell of the
same dataset and seed and runs after it; on long-context sets it is a fraction of the prompt length.

With `share_prefill: true`, cells that differ only in policy and budget and whose policies compress from the
stored K/V, window queries and prefill attention sums (every policy but skipkv and seal) run as one unit: each
example is prefilled once and every cell's policy continues from a copy (eval.shared.run_shared,
engine/shared.py). Each cell's directory gets the records a run of its own would write (batch_size 1, greedy).
With h2o among them, that one prefill accumulates attention sums (H2O's slower prefill, once for the unit).

The package: `spec` reads and checks the YAML and expands it into cells, `run` turns a cell into an eval run
and dispatches cells (in this process or as Ray tasks), `status` reads how far each cell is, `cli` is
`skipkv sweep`.
"""

from skipkv.sweep.cli import register
from skipkv.sweep.run import CellResult, expand_results, run_cell, run_local, run_ray, shared_units, to_eval_config
from skipkv.sweep.spec import SWEEP_KEYS, Cell, expand_sweep, load_sweep

__all__ = ["SWEEP_KEYS", "Cell", "CellResult", "expand_results", "expand_sweep", "load_sweep", "register", "run_cell",
           "run_local", "run_ray", "shared_units", "to_eval_config"]
