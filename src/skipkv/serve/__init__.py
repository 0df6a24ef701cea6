"""An OpenAI-compatible server on the step-driven engine: protocol (validation, wire shapes), worker (the
engine thread), app (FastAPI routes), cli (`skipkv serve`).

    skipkv serve --model random:qwen2 --policy rkv --budget 64 --kv-memory 64MiB
"""
