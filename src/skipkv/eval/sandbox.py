"""Run untrusted Python (model-generated code) in a contained child process.

    from skipkv.eval.sandbox import Sandbox
    Sandbox().run("assert 1 + 1 == 2").passed        # True
    python -m skipkv.eval.sandbox                     # prints the isolation available on this machine

Generated code is untrusted. Every run gets a fresh throwaway directory, a clean environment
(no variable of the parent survives; PATH is minimal), a wall-clock timeout and resource limits
(CPU seconds, address space, file size, process count, no core dumps) set with `setrlimit` in the
child before exec. Two isolation levels:

- `namespaces` (Linux, root, `unshare` and `setpriv` present; probed by actually running code):
  new network namespace (no interfaces but a down loopback: nothing is reachable), new mount namespace
  in which every mount is remounted read-only except the throwaway directory, new PID namespace with
  its own /proc (the parent's processes and their environments are invisible; when the sandbox's
  init dies the kernel kills everything left in it, which ends fork bombs), and the code runs under an
  unprivileged uid of its own, drawn at random per run from a range no account uses: RLIMIT_NPROC
  (which root would bypass) then counts only this run's processes, so concurrent sandboxes, say two
  test runs at once, cannot exhaust each other's process allowance.
- `basic` (anything else): the same limits and clean environment, plus a Python audit hook installed
  before the code runs that refuses sockets, subprocesses, forks, ctypes and writes outside the
  throwaway directory. Native code could get past an audit hook; this level is best effort and the
  result records which level graded it.
"""

from __future__ import annotations

import os
import resource
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from skipkv.errors import SkipKVError

UID_RANGE = (1_000_000_000, 2_000_000_000)  # per-run uids/gids under `namespaces`; no account lives there
MIN_PATH = "/usr/bin:/bin"

# Runs as root inside the new namespaces, then drops to the run's uid ($2) and execs Python.
# Every mount becomes a read-only bind except the work dir ($1), which gets its own writable bind.
_NS_SETUP = r"""
set -e
w="$1"; id="$2"; shift 2
mount --make-rprivate /
mount --bind "$w" "$w"
for m in $(awk '{print $2}' /proc/self/mounts); do mount -o remount,bind,ro "$m" 2>/dev/null || true; done
mount -o remount,bind,rw "$w"
cd "$w"
exec setpriv --reuid="$id" --regid="$id" --clear-groups --no-new-privs --inh-caps=-all --bounding-set=-all -- "$@"
"""

# Under `basic`, this runs before the untrusted program (same process) and refuses what the OS
# would otherwise allow. Audit hooks cannot be removed once added.
_GUARD = r'''
import os, sys
_root = os.path.realpath(os.getcwd())
_deny = ("socket.", "subprocess.Popen", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork",
         "os.forkpty", "ctypes.", "os.kill", "os.killpg", "pty.")
_path_events = {"os.remove", "os.rename", "os.rmdir", "os.mkdir", "os.chmod", "os.chown", "os.symlink",
                "os.link", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
def _inside(p):
    try:
        p = os.fsdecode(p) if not isinstance(p, int) else None
    except Exception:
        return False
    if p is None:
        return True
    p = os.path.realpath(p)
    return p == _root or p.startswith(_root + os.sep)
def _other_process(p):
    # /proc/<pid>/... of any process but this one (environ, cmdline, mem of the parent)
    try:
        parts = os.path.realpath(os.fsdecode(p)).split(os.sep)
    except Exception:
        return False
    return len(parts) > 2 and parts[1] == "proc" and parts[2].isdigit() and parts[2] != str(os.getpid())
def _hook(event, args):
    if event.startswith(_deny):
        raise PermissionError("sandbox: " + event + " is not allowed")
    if event == "open":
        path, mode, flags = args
        writes = (mode is not None and any(c in str(mode) for c in "wax+")) \
            or (flags or 0) & (os.O_WRONLY | os.O_RDWR | os.O_CREAT)
        if writes and not _inside(path):
            raise PermissionError("sandbox: write outside the work dir")
        if not isinstance(path, int) and _other_process(path):
            raise PermissionError("sandbox: other processes are not visible")
    elif event in _path_events and args and not _inside(args[0]):
        raise PermissionError("sandbox: " + event + " outside the work dir")
sys.addaudithook(_hook)
del _hook
_prog = "prog.py"
with open(_prog, encoding="utf-8") as _f:
    _code = compile(_f.read(), _prog, "exec")
exec(_code, {"__name__": "__main__", "__file__": _prog})
'''


@dataclass(frozen=True)
class SandboxLimits:
    """Per-run limits. Memory is address space (RLIMIT_AS), so it bounds allocations, not RSS."""

    timeout_s: float = 10.0
    memory_bytes: int = 1 << 30
    file_bytes: int = 16 << 20
    processes: int = 32
    output_bytes: int = 4096  # tail of stdout/stderr kept in the result


@dataclass(frozen=True)
class SandboxResult:
    """What happened. status: passed (exit 0), failed (non-zero exit or killed by a limit), timeout."""

    status: str
    returncode: int | None
    stdout: str
    stderr: str
    seconds: float
    isolation: str
    uid: int | None = None  # the uid the code ran as (namespaces), e.g. to check that nothing outlived the run

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def summary(self) -> str:
        """One short line for a record: status and the last line of stderr."""
        tail = self.stderr.strip().splitlines()[-1:] or [""]
        return f"{self.status}: {tail[0][:200]}" if tail[0] else self.status


def _limits_preexec(limits: SandboxLimits):
    cpu = int(limits.timeout_s) + 1

    def apply() -> None:
        # Runs in the child between fork and exec: these limits are inherited by everything it starts.
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
        resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
        resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

    return apply


def _tail(path: Path, num_bytes: int) -> str:
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        f.seek(max(0, f.tell() - num_bytes))
        return f.read().decode("utf-8", errors="replace")


class Sandbox:
    """Runs one Python program per call; see the module docstring for what is contained and how.

    isolation: "auto" (namespaces when they work here, else basic), "namespaces" (error if unavailable)
    or "basic". python: the interpreter the code runs under (default: this one).
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), isolation: str = "auto",
                 python: str | None = None) -> None:
        if isolation not in ("auto", "namespaces", "basic"):
            raise SkipKVError(f"unknown sandbox isolation {isolation!r}; choose auto, namespaces or basic")
        self.limits = limits
        self.python = python or sys.executable
        self._requested = isolation
        self._isolation: str | None = None if isolation != "basic" else "basic"

    @property
    def isolation(self) -> str:
        """The level in use, probed once per instance by running a trivial program."""
        if self._isolation is None:
            works = self._namespaces_work()
            if self._requested == "namespaces" and not works:
                raise SkipKVError("sandbox isolation 'namespaces' needs Linux, root, unshare and setpriv")
            self._isolation = "namespaces" if works else "basic"
        return self._isolation

    def _namespaces_work(self) -> bool:
        if sys.platform != "linux" or os.geteuid() != 0:
            return False
        if not (shutil.which("unshare") and shutil.which("setpriv") and shutil.which("mount")):
            return False
        probe = self._run("import os\nprint(os.getuid())\n", "namespaces")
        return probe.passed and probe.stdout.strip() == str(probe.uid)

    def run(self, code: str) -> SandboxResult:
        """Execute `code` as a program in a fresh work dir; exit status 0 means passed."""
        return self._run(code, self.isolation)

    def _command(self, isolation: str, workdir: Path, uid: int | None) -> list[str]:
        if isolation == "namespaces":
            return ["unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
                    "--mount-proc", "--", "sh", "-c", _NS_SETUP, "sandbox", str(workdir), str(uid),
                    self.python, "-I", "-B", "prog.py"]
        (workdir / "_guard.py").write_text(_GUARD, encoding="utf-8")
        return [self.python, "-I", "-B", "_guard.py"]

    def _run(self, code: str, isolation: str) -> SandboxResult:
        logs = Path(tempfile.mkdtemp(prefix="skipkv-sandbox-logs-"))  # parent-owned, outside the work dir
        workdir = Path(tempfile.mkdtemp(prefix="skipkv-sandbox-"))
        try:
            (workdir / "prog.py").write_text(code, encoding="utf-8")
            uid = None
            if isolation == "namespaces":
                uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
                os.chown(workdir, uid, uid)
                os.chown(workdir / "prog.py", uid, uid)
            env = {"PATH": MIN_PATH, "HOME": str(workdir), "TMPDIR": str(workdir), "LANG": "C.UTF-8"}
            start = time.perf_counter()
            with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err:
                proc = subprocess.Popen(self._command(isolation, workdir, uid), cwd=workdir, env=env,
                                        stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        preexec_fn=_limits_preexec(self.limits), start_new_session=True)
                try:
                    returncode: int | None = proc.wait(timeout=self.limits.timeout_s)
                    status = "passed" if returncode == 0 else "failed"
                except subprocess.TimeoutExpired:
                    # The whole session goes; under namespaces, killing the PID namespace's parent
                    # (--kill-child) takes every process inside with it, including ones that called setsid.
                    _kill_group(proc)
                    returncode, status = None, "timeout"
            seconds = time.perf_counter() - start
            return SandboxResult(status, returncode, _tail(logs / "out", self.limits.output_bytes),
                                 _tail(logs / "err", self.limits.output_bytes), seconds, isolation, uid)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


if __name__ == "__main__":
    box = Sandbox()
    print(f"isolation: {box.isolation}")
    print(box.run("print('hello from the sandbox')"))
