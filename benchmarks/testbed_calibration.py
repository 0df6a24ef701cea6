"""Kept so that the docs' older commands (and benchmarks/reproduce_skipkv.sh) still run: the tool is
`skipkv bench testbed-calibration`.

    python benchmarks/testbed_calibration.py ...   # the same as: skipkv bench testbed-calibration ...
"""

import sys

from skipkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "testbed-calibration", *sys.argv[1:]]))
