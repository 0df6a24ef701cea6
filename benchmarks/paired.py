"""Kept so that the docs' older commands still run: the tool is `skipkv bench paired` (skipkv.report.paired).

    python benchmarks/paired.py RUN_A RUN_B   (the same as: skipkv bench paired RUN_A RUN_B)
"""

from skipkv.report.paired import main

if __name__ == "__main__":
    main()
