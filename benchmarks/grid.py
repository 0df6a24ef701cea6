"""Kept so that the docs' older commands (and benchmarks/reproduce_skipkv.sh) still run: the tool is
`skipkv bench grid`.

    python benchmarks/grid.py ...   # the same as: skipkv bench grid ...
"""

import sys

from skipkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "grid", *sys.argv[1:]]))
