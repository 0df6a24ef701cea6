"""Kept so that the docs' older commands still run: the tool is `skipkv bench profile-step`
(skipkv.bench.profile_step).

    python benchmarks/profile_step.py ...   # the same as: skipkv bench profile-step ...
"""

from skipkv.bench.profile_step import main

if __name__ == "__main__":
    main()
