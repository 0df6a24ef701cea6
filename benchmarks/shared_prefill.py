"""Kept so that the docs' older commands still run: the tool is `skipkv bench shared-prefill`
(skipkv/bench/shared_prefill.py; its flags are in skipkv/bench/cli.py).

    python benchmarks/shared_prefill.py ...   # the same as: skipkv bench shared-prefill ...
"""

import sys

from skipkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "shared-prefill", *sys.argv[1:]]))
