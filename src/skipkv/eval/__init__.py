"""Evaluation harness: datasets, prompts, graders, a sandbox for generated code, and the resumable runner.

    skipkv eval --model random:qwen2 --dataset gsm8k --limit 6 --policy rkv --budget 32 --interval 8 \
        --max-tokens 40 --out runs/smoke --quiet

Modules: datasets (file benchmarks + registry), longctx (generated long-context sets), prompts, graders,
sandbox, records (the crash-safe JSONL store), runner (EvalConfig, run_eval, the file formats), cli.
Importing this package is cheap: the runner (torch, the engine) is imported only by who needs it.
"""
