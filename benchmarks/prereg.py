"""Kept so that the registered configs' commands still run: the analysis lives in skipkv.report.prereg_laprox.

    python benchmarks/prereg.py ...   (the same as: python -m skipkv.report.prereg_laprox ...)
"""

from skipkv.report.prereg_laprox import main

if __name__ == "__main__":
    main()
