"""Kept so that the docs' older commands still run: the tool is `skipkv bench reflection-rate`
(skipkv.report.reflection).

    python benchmarks/reflection_rate.py RUN_DIR ...   # the same as: skipkv bench reflection-rate RUN_DIR ...
"""

from skipkv.report.reflection import main

if __name__ == "__main__":
    main("reflection-rate")
