"""Kept so that the docs' older commands (and benchmarks/reproduce_skipkv.sh) still run: the tool is
`skipkv bench reflection-rate`.

    python benchmarks/reflection_rate.py ...   # the same as: skipkv bench reflection-rate ...
"""

import sys

from skipkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "reflection-rate", *sys.argv[1:]]))
