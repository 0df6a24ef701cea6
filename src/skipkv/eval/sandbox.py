"""Run untrusted Python (model-generated code) in a contained child process.

    from skipkv.eval.sandbox import Sandbox
    Sandbox().run("assert 1 + 1 == 2").passed        # True
    python -m skipkv.eval.sandbox                     # prints the isolation available on this machine

Generated code is untrusted. Every run gets a clean environment (no variable of the parent survives;
PATH is minimal), a wall-clock timeout and resource limits (CPU seconds, address space, file size, process
count, no core dumps) set with `setrlimit` in the child before exec. Two levels; there is no fallback
from one to the other: the level asked for runs, or the run stops with a SkipKVError.

- `namespaces` (the default; Linux, root, `unshare`, `setpriv`, `pivot_root`; probed once by running code):
  new network namespace (no interfaces but a down loopback: no host, no abstract Unix socket is
  reachable), new PID namespace with its own /proc (the parent's processes and their environments are
  invisible, and when the program exits its shell, the namespace's init, exits and the kernel kills
  everything left in it, so no background process outlives a run), and a private mount namespace whose root
  is a fresh tmpfs of `disk_bytes` (the only writable area, so a disk fill stops there) holding read-only
  binds of only what Python needs (/usr and the Python install, a few /dev nodes) plus /work and /tmp: no host
  path, no host
  Unix socket, no /root, /home or /tmp of the host exists in it. The code runs under an unprivileged uid
  drawn at random per run from a range no account uses (RLIMIT_NPROC then counts this run's processes
  only). The sandbox's first process gets PR_SET_PDEATHSIG=SIGKILL and `unshare --kill-child`, so when the
  caller dies, even by `kill -9`, the namespace's init dies and the kernel ends every process in it.
- `unsafe-basic` (only when asked for by name): the same limits and clean environment and a Python audit
  hook that refuses sockets, subprocesses, forks, ctypes and writes outside a throwaway directory. Plain
  Python gets past an audit hook (e.g. through file descriptors the hook does not see), so this level is
  not a security boundary; `skipkv eval` uses it only with `--sandbox unsafe-basic`.

Every result records the level that ran it (`SandboxResult.isolation`).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
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

from skipkv.config import check_fields, knob
from skipkv.errors import SkipKVError
from skipkv.eval.harness import harness_source

ISOLATION_LEVELS = ("namespaces", "unsafe-basic")
UID_RANGE = (1_000_000_000, 2_000_000_000)  # per-run uids/gids under `namespaces`; no account lives there
MIN_PATH = "/usr/bin:/bin"
PROBE_TIMEOUT_S = 20.0  # the start-up probe's own limit: a tiny per-program timeout must not fail the probe
PR_SET_PDEATHSIG = 1

# Runs as root inside the new namespaces, as the PID namespace's init: builds the new root on a
# size-capped tmpfs, pivots into it, drops the host's tree, then runs Python under the run's uid.
# $1 host dir holding prog.py, $2 empty host dir for the new root, $3 uid, $4 tmpfs size, $5 inodes,
# $6... read-only folders to bind at the same path (the Python install); then "--" and the command.
_NS_SETUP = r"""
set -e
path0="$PATH"; PATH="/usr/sbin:/sbin:$PATH"  # mount tools; the program gets the minimal PATH back
src="$1"; r="$2"; id="$3"; size="$4"; inodes="$5"; shift 5
mount --make-rprivate /
mount -t tmpfs -o "size=$size,nr_inodes=$inodes,mode=755,nosuid,nodev" sandbox "$r"
robind() {  # robind HOST_PATH: a read-only bind of a host folder at the same path in the new root
  [ -d "$1" ] || return 0
  mkdir -p "$r$1"
  mount --rbind "$1" "$r$1"
  mount -o remount,bind,ro,nosuid,nodev "$r$1"
}
for d in usr bin sbin lib lib32 lib64 libx32; do
  if [ -L "/$d" ]; then ln -s "$(readlink "/$d")" "$r/$d"; elif [ -d "/$d" ]; then robind "/$d"; fi
done
while [ "$1" != "--" ]; do robind "$1"; shift; done
shift
mkdir -p "$r/etc" "$r/dev" "$r/proc" "$r/work" "$r/tmp"
[ -f /etc/ld.so.cache ] && cp /etc/ld.so.cache "$r/etc/"
for n in null zero random urandom; do touch "$r/dev/$n"; mount --bind "/dev/$n" "$r/dev/$n"; done
mount -t proc -o nosuid,nodev,noexec proc "$r/proc"
cp "$src/prog.py" "$r/work/prog.py"
# Not recursive: a Python install living under /tmp or /work is bound read-only inside them.
chown "$id:$id" "$r/work" "$r/work/prog.py" "$r/tmp"
chmod 700 "$r/work"; chmod 1777 "$r/tmp"
cd "$r"; mkdir .host; pivot_root . .host; umount -l /.host; rmdir /.host
cd /work
PATH="$path0"
# Not `exec`: this shell stays the namespace's init, as root, so the parent-death signal that
# `unshare --kill-child` gave it survives (a uid change, as in setpriv, would clear it). When the
# caller dies, unshare dies (PR_SET_PDEATHSIG), this init dies, and the kernel kills the namespace.
set +e
setpriv --reuid="$id" --regid="$id" --clear-groups --no-new-privs --inh-caps=-all --bounding-set=-all -- "$@"
status=$?
exit $status
"""

# Under `unsafe-basic`, this runs before the untrusted program (same process) and refuses what the OS
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

    timeout_s: float = knob(10.0, "wall-clock seconds per program", gt=0.0, le=86400.0)
    memory_bytes: int = knob(1 << 30, "address space of the program", ge=16 << 20)
    file_bytes: int = knob(16 << 20, "largest file the program may write", gt=0)
    disk_bytes: int = knob(64 << 20, "size of the writable tmpfs (namespaces): all files together", ge=1 << 20)
    disk_inodes: int = knob(4096, "files and folders the program may create (namespaces)", ge=64)
    processes: int = knob(32, "processes of the run (its uid's, and counted over its process tree)", gt=0)
    # The sum over every process of the run, checked while it runs (the address-space limit above is per process:
    # ten children under it could together take ten times as much).
    total_memory_bytes: int = knob(1 << 30, "resident memory of all the run's processes together", ge=16 << 20)
    output_bytes: int = knob(4096, "tail of stdout/stderr kept in the result", gt=0)

    def __post_init__(self) -> None:
        check_fields(self, "sandbox")


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


def _die_with_parent(parent: int) -> None:
    """PR_SET_PDEATHSIG=SIGKILL for this (child) process; if the parent already died, exit at once."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        os._exit(127)
    if os.getppid() != parent:  # the parent died between fork and prctl: nobody would kill us later
        os._exit(127)


def _limits_preexec(limits: SandboxLimits, die_with_parent: bool):
    cpu = int(limits.timeout_s) + 1
    parent = os.getpid()

    def apply() -> None:
        # Runs in the child between fork and exec: these limits are inherited by everything it starts.
        if die_with_parent:
            _die_with_parent(parent)
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


def _python_dirs(python: str) -> list[str]:
    """The host folders an interpreter needs, bound read-only into the new root (outside /usr)."""
    real = os.path.realpath(python)
    dirs = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.prefix), os.path.dirname(real),
            os.path.dirname(os.path.abspath(python))}
    usr = ("/usr/", "/bin/", "/lib/", "/lib64/", "/sbin/")
    dirs = {d for d in dirs if not (d + "/").startswith(usr) and d not in ("/", "")}
    return sorted(d for d in dirs if not any(d.startswith(o + "/") for o in dirs))  # a parent's bind covers it


class Sandbox:
    """Runs one Python program per call; see the module docstring for what is contained and how.

    isolation: "namespaces" (default; a SkipKVError if this machine cannot provide it) or "unsafe-basic"
    (only an audit hook; never chosen automatically). python: the interpreter the code runs under.
    """

    def __init__(self, limits: SandboxLimits = SandboxLimits(), isolation: str = "namespaces",
                 python: str | None = None) -> None:
        if isolation not in ISOLATION_LEVELS:
            raise SkipKVError(f"unknown sandbox isolation {isolation!r}; choose one of: {', '.join(ISOLATION_LEVELS)}")
        self.limits = limits
        self.python = python or sys.executable
        self._requested = isolation
        self._checked = isolation != "namespaces"

    @property
    def isolation(self) -> str:
        """The level in use: the one asked for, checked once per instance (namespaces: by running a program)."""
        if not self._checked:
            why = self._namespaces_unavailable()
            if why:
                raise SkipKVError(f"sandbox isolation 'namespaces' is unavailable here ({why}); generated code is "
                                  "not run without it unless you ask for --sandbox unsafe-basic")
            self._checked = True
        return self._requested

    def _namespaces_unavailable(self) -> str | None:
        if sys.platform != "linux" or os.geteuid() != 0:
            return "needs Linux and root"
        missing = [t for t in ("unshare", "setpriv", "mount", "umount", "pivot_root") if not shutil.which(t)]
        if missing:
            return f"{', '.join(missing)} not found"
        probe_limits = dataclasses.replace(self.limits, timeout_s=max(self.limits.timeout_s, PROBE_TIMEOUT_S))
        probe = self._run("import os\nprint(os.getuid())\n", "namespaces", probe_limits)
        if not (probe.passed and probe.stdout.strip() == str(probe.uid)):
            last = (probe.stderr.strip().splitlines() or [probe.status])[-1][:160]
            return f"the start-up probe {probe.status}: {last}"
        return None

    def run(self, code: str, check: str | None = None) -> SandboxResult:
        """Execute `code` as a program in a fresh work dir. Without `check`, exit status 0 means passed. With it
        (a statement such as "check(add)"), the program runs inside the test harness (harness.py) and passes only
        if the harness reports that `check` returned, whatever the program does to its process."""
        return self._run(code, self.isolation, self.limits, check)

    def _command(self, isolation: str, workdir: Path, root: Path, uid: int | None, limits: SandboxLimits) -> list[str]:
        if isolation == "namespaces":
            return ["unshare", "--net", "--mount", "--pid", "--ipc", "--uts", "--fork", "--kill-child", "--",
                    "sh", "-c", _NS_SETUP, "sandbox", str(workdir), str(root), str(uid), str(limits.disk_bytes),
                    str(limits.disk_inodes), *_python_dirs(self.python), "--", self.python, "-I", "-B", "prog.py"]
        (workdir / "_guard.py").write_text(_GUARD, encoding="utf-8")
        return [self.python, "-I", "-B", "_guard.py"]

    def _run(self, code: str, isolation: str, limits: SandboxLimits, check: str | None = None) -> SandboxResult:
        logs = Path(tempfile.mkdtemp(prefix="skipkv-sandbox-logs-"))  # parent-owned, outside the work dir
        workdir = Path(tempfile.mkdtemp(prefix="skipkv-sandbox-"))
        root = Path(tempfile.mkdtemp(prefix="skipkv-sandbox-root-"))  # stays empty on the host side
        token = secrets.token_hex(16) if check is not None else ""
        try:
            uid = None
            if isolation == "namespaces":
                uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
                home = "/work"
            else:
                home = str(workdir)
            env = {"PATH": MIN_PATH, "HOME": home, "TMPDIR": "/tmp" if uid is not None else home, "LANG": "C.UTF-8"}
            start = time.perf_counter()
            with open(logs / "out", "wb") as out, open(logs / "err", "wb") as err, \
                    open(logs / "report", "wb") as report:
                source = code if check is None else harness_source(code, check, report.fileno())
                (workdir / "prog.py").write_text(source, encoding="utf-8")
                proc = subprocess.Popen(self._command(isolation, workdir, root, uid, limits), cwd=workdir, env=env,
                                        stdin=subprocess.PIPE if check is not None else subprocess.DEVNULL,
                                        stdout=out, stderr=err, pass_fds=(report.fileno(),) if check else (),
                                        preexec_fn=_limits_preexec(limits, isolation == "namespaces"),
                                        start_new_session=True)
                try:
                    if proc.stdin is not None:
                        with contextlib.suppress(BrokenPipeError):
                            proc.stdin.write(token.encode() + b"\n")
                            proc.stdin.close()
                    returncode, status, why = _watch(proc, limits)
                except BaseException:
                    _kill_group(proc)  # e.g. KeyboardInterrupt in the caller: the program does not outlive it
                    raise
            seconds = time.perf_counter() - start
            stderr = _tail(logs / "err", limits.output_bytes) + (f"\nsandbox: {why}\n" if why else "")
            if status == "passed" and check is not None and f"\n{token}\n" not in _tail(logs / "report", 4096):
                # Exit 0 without the harness's report: the program ended its process before the checks finished.
                status = "failed"
                stderr += "\nsandbox: the tests did not run to the end (the program exited before the harness)\n"
            return SandboxResult(status, returncode, _tail(logs / "out", limits.output_bytes), stderr, seconds,
                                 isolation, uid)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
            shutil.rmtree(logs, ignore_errors=True)
            shutil.rmtree(root, ignore_errors=True)


WATCH_S = 0.02  # how often the run's processes are counted and their memory summed


def _tree(proc: subprocess.Popen) -> list:
    import psutil

    try:
        top = psutil.Process(proc.pid)
        return [top, *top.children(recursive=True)]
    except psutil.Error:
        return []


def _watch(proc: subprocess.Popen, limits: SandboxLimits) -> tuple[int | None, str, str]:
    """Wait for `proc` within the timeout while bounding its whole process tree: every WATCH_S the resident memory
    of all its processes is summed and they are counted; over `total_memory_bytes` or `processes`, or past the
    timeout, the run is killed. Returns (returncode, status, why it was stopped or "")."""
    import psutil

    deadline = time.monotonic() + limits.timeout_s
    while True:
        try:
            returncode = proc.wait(timeout=WATCH_S)
            return returncode, "passed" if returncode == 0 else "failed", ""
        except subprocess.TimeoutExpired:
            pass
        if time.monotonic() > deadline:
            # The whole session goes; under namespaces, killing the PID namespace's parent (--kill-child) takes
            # every process inside with it, including ones that called setsid.
            _kill_group(proc)
            return None, "timeout", ""
        tree = _tree(proc)
        rss = 0
        for p in tree:
            with contextlib.suppress(psutil.Error):
                rss += p.memory_info().rss
        why = ""
        if rss > limits.total_memory_bytes:
            why = (f"its processes together held {rss >> 20} MiB, over the limit of "
                   f"{limits.total_memory_bytes >> 20} MiB")
        elif len(tree) > limits.processes + 3:  # + unshare, the namespace's init shell and setpriv's exec
            why = f"it ran {len(tree)} processes, over the limit of {limits.processes}"
        if why:
            _kill_group(proc)
            return proc.returncode, "failed", why


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


if __name__ == "__main__":
    box = Sandbox()
    try:
        print(f"isolation: {box.isolation}")
    except SkipKVError as exc:
        sys.exit(f"isolation: none ({exc})")
    print(box.run("print('hello from the sandbox')"))
