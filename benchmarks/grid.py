"""Kept so that the docs' older commands still run: the tool is `skipkv bench grid` (skipkv.report.grid).

    python benchmarks/grid.py ...   (the same as: skipkv bench grid ...)
"""

from skipkv.report.grid import main

if __name__ == "__main__":
    main()
