"""Kept so that the registered configs' commands still run: the analysis lives in skipkv.report.prereg_plot.

    python benchmarks/plot_prereg.py ...   (the same as: python -m skipkv.report.prereg_plot ...)
"""

from skipkv.report.prereg_plot import main

if __name__ == "__main__":
    main()
