"""Kept so that the docs' older commands still run: the tool is `skipkv bench testbed-calibration`
(skipkv.report.reflection).

    python benchmarks/testbed_calibration.py RUN_DIR ...   # the same as: skipkv bench testbed-calibration RUN_DIR ...
"""

from skipkv.report.reflection import main

if __name__ == "__main__":
    main("testbed-calibration")
