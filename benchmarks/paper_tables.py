"""Kept so that benchmarks/reproduce_skipkv.sh and the docs' commands still run: the tool is
`skipkv bench paper-tables` (skipkv.report.paper_tables).

    python benchmarks/paper_tables.py ROOT   (the same as: skipkv bench paper-tables ROOT)
"""

import sys

from skipkv.report.paper_tables import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
