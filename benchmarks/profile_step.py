"""Kept so that the docs' older commands still run: the tool is `skipkv bench profile-step`
(skipkv/bench/profile_step.py; its flags are in skipkv/bench/cli.py).

    python benchmarks/profile_step.py ...   # the same as: skipkv bench profile-step ...
"""

import sys

from skipkv.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", "profile-step", *sys.argv[1:]]))
