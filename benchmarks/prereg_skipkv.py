"""Kept so that the registered configs' commands still run: the analysis lives in skipkv.report.prereg_skipkv.

    python benchmarks/prereg_skipkv.py ...   (the same as: python -m skipkv.report.prereg_skipkv ...)
"""

from skipkv.report.prereg_skipkv import main

if __name__ == "__main__":
    main()
