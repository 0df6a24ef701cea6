"""Kept so that the docs' older commands still run: the tool is `skipkv bench shared-prefill`
(skipkv.bench.shared_prefill).

    python benchmarks/shared_prefill.py ...   # the same as: skipkv bench shared-prefill ...
"""

from skipkv.bench.shared_prefill import main

if __name__ == "__main__":
    main()
