"""Kept so that the docs' older commands (and benchmarks/reproduce_skipkv.sh) still run: the tool is
`skipkv bench paired`.

    python benchmarks/paired.py ...   # the same as: skipkv bench paired ...
"""

import sys

from skipkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "paired", *sys.argv[1:]]))
