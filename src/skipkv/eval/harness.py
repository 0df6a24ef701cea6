"""The test harness around a generated program: it passes only if the harness itself saw the checks finish.

    from skipkv.eval.harness import harness_source
    src = harness_source("def f(): return 1\ndef check(c): assert c() == 1\n", "check(f)", report_fd=7)
    # the sandbox runs `src`, sends a fresh token on stdin, and reads what arrives on the report fd

A program's exit status says nothing about its tests: `os._exit(0)`, `exit()`, `raise SystemExit(0)`, an
`atexit` hook or a replaced `sys.excepthook` all end a process with status 0 before (or whatever) the
asserts did. So, as in human-eval's reference (which appends "passed" after `exec` returns), the harness runs
the program and then the check call in one namespace, and only after both returned writes a token it read
from stdin before the program started (stdin is then closed: the program cannot read it) to a file
descriptor of its own; the sandbox counts a run as passed only if that token arrived and the process exited 0.
Anything that ends the process early, raises, or never returns leaves no token.

Not covered (as in the reference): code that deliberately searches the harness's own frames or memory for the
token while it runs in the same interpreter.
"""

from __future__ import annotations

_BODY = r'''
import os as _os, sys as _sys
def _skipkv_harness(_src, _check):
    _token = _sys.stdin.buffer.readline().strip()
    _null = _os.open(_os.devnull, _os.O_RDONLY)
    _os.dup2(_null, 0)  # the program reads nothing of the token
    _os.close(_null)
    _ns = {"__name__": "__main__", "__file__": "program.py", "__builtins__": __builtins__}
    exec(compile(_src, "program.py", "exec"), _ns)
    exec(compile(_check, "<check>", "exec"), _ns)
    for _f in (_sys.stdout, _sys.stderr):
        try:
            _f.flush()
        except Exception:
            pass
    _os.write(_FD, b"\n" + _token + b"\n")
    _os._exit(0)  # nothing the program registered (atexit, threads, finalizers) runs after the report
_skipkv_harness(_SRC, _CHECK)
'''


def harness_source(program: str, check: str, report_fd: int) -> str:
    """The Python source the sandbox runs: `program`, then the statement `check` (e.g. "check(add)"), then the
    token on `report_fd` (a descriptor the sandbox passes to the process; see the module docstring)."""
    return f"_SRC = {program!r}\n_CHECK = {check!r}\n_FD = {int(report_fd)}\n{_BODY}"
