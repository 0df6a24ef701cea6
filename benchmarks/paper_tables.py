"""Kept so that the docs' older commands (and benchmarks/reproduce_skipkv.sh) still run: the tool is
`skipkv bench paper-tables`.

    python benchmarks/paper_tables.py ...   # the same as: skipkv bench paper-tables ...
"""

import sys

from skipkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "paper-tables", *sys.argv[1:]]))
