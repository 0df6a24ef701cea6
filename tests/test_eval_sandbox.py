"""The code sandbox: hostile programs are contained and graded as failures, and grading carries on afterwards.

Each hostile completion is written so that it would *pass* its test if the sandbox let it do what it tries
(reach the network, read the parent's environment, write outside its directory ...). A pass therefore means
an escape, and the parent also checks the side effects directly.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from skipkv.errors import SkipKVError
from skipkv.eval.datasets import Example, packaged
from skipkv.eval.graders import CodeGrader
from skipkv.eval.sandbox import Sandbox, SandboxLimits

TIMEOUT = 1.5
SECRET = "s3cret-from-the-parent"


def task(body: str, check: str = "    assert candidate() is True\n") -> tuple[Example, str]:
    """A HumanEval-shaped task whose function `attack` runs `body` and returns its result, and that completion."""
    prompt = "def attack():\n    \"\"\"Try something.\"\"\"\n"
    completion = "".join(f"    {line}\n" for line in body.splitlines())
    example = Example("t", "code", {"prompt": prompt}, f"def check(candidate):\n{check}", {"entry_point": "attack"})
    return example, completion


@pytest.fixture(scope="module")
def namespaces() -> CodeGrader:
    grader = CodeGrader(timeout_s=TIMEOUT)  # the default level
    try:
        assert grader.sandbox().isolation == "namespaces"
    except SkipKVError as exc:
        pytest.skip(str(exc))
    return grader


@pytest.fixture(scope="module")
def basic() -> CodeGrader:
    return CodeGrader(timeout_s=TIMEOUT, isolation="unsafe-basic")


def grade(grader: CodeGrader, body: str, check: str = "    assert candidate() is True\n"):
    example, completion = task(body, check)
    start = time.perf_counter()
    verdict = grader.grade(completion, example)
    return verdict, time.perf_counter() - start


@pytest.fixture()
def listener():
    """A TCP server in the parent; it records whether anyone connected."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    server.settimeout(0.2)
    hits: list[bool] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
                hits.append(True)
                conn.close()
            except OSError:
                pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield server.getsockname()[1], hits
    stop.set()
    thread.join()
    server.close()


def _attacks(port: int, outside: Path) -> dict[str, str]:
    return {
        "infinite loop": "while True:\n    pass",
        "huge allocation": "x = bytearray(16 * 1024 ** 3)\nreturn len(x) > 0",
        "fork bomb": "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
        "network": f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), timeout=1)\nreturn True",
        "write outside": f"open({str(outside)!r}, 'w').write('escaped')\nreturn True",
        "write to /tmp": f"open('/tmp/skipkv-escape-{os.getpid()}', 'w').write('escaped')\nreturn True",
        "parent environment": (
            "import os\n"
            "if os.environ.get('SKIPKV_TEST_SECRET'):\n    return True\n"
            "for pid in [os.getppid()] + [int(p) for p in os.listdir('/proc') if p.isdigit()]:\n"
            "    try:\n"
            "        if b'SKIPKV_TEST_SECRET' in open(f'/proc/{pid}/environ', 'rb').read():\n"
            "            return True\n"
            "    except OSError:\n"
            "        pass\n"
            "return False"),
        "huge file": "open('big', 'wb').write(b'x' * (256 << 20))\nreturn True",
    }


def test_hostile_programs_are_contained(namespaces: CodeGrader, listener, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("SKIPKV_TEST_SECRET", SECRET)
    port, hits = listener
    outside = tmp_path / "escaped.txt"
    os.chmod(tmp_path, 0o777)  # even a world-writable directory outside the sandbox must stay untouched
    results = {}
    for name, body in _attacks(port, outside).items():
        verdict, seconds = grade(namespaces, body)
        results[name] = verdict
        # /tmp inside the sandbox is its own (part of the capped tmpfs): writing there is allowed; the
        # host's /tmp is checked below.
        assert not verdict.correct or name == "write to /tmp", f"{name}: {verdict.detail}"
        assert seconds < TIMEOUT + 5, f"{name} took {seconds:.1f}s"
        assert SECRET not in verdict.detail
    assert results["infinite loop"].detail.startswith("timeout")
    assert "MemoryError" in results["huge allocation"].detail
    assert not hits, "the sandbox reached the parent's TCP listener"
    assert not outside.exists()
    assert not Path(f"/tmp/skipkv-escape-{os.getpid()}").exists()
    # A fork bomb leaves nothing running: the processes of the run's uid are gone once the run returned.
    bomb = Sandbox(SandboxLimits(timeout_s=TIMEOUT)).run(_attacks(port, outside)["fork bomb"])
    assert bomb.status == "timeout" and bomb.uid is not None
    deadline = time.time() + 3
    while time.time() < deadline and _processes_of(bomb.uid):
        time.sleep(0.1)
    assert _processes_of(bomb.uid) == 0
    # ... and grading goes on: an honest solution still passes in the same sandbox.
    assert grade(namespaces, "return True")[0].correct


def _processes_of(uid: int) -> int:
    """Live processes of `uid`. Zombies do not count: they are dead, waiting for a reaper (this machine's
    init may be slow to reap the ones orphaned by a killed caller)."""
    out = subprocess.run(["ps", "-u", str(uid), "-o", "stat="], capture_output=True, text=True)
    return sum(1 for state in out.stdout.split() if not state.startswith("Z"))


def test_basic_isolation_contains_the_plain_attacks(basic: CodeGrader, listener, tmp_path: Path, monkeypatch) -> None:
    # The opt-in level for machines without namespaces: limits, a clean environment and an audit hook.
    # It holds against these, not against everything (see the escapes below), hence its name.
    monkeypatch.setenv("SKIPKV_TEST_SECRET", SECRET)
    port, hits = listener
    outside = tmp_path / "escaped.txt"
    attacks = _attacks(port, outside)
    # (the fork bomb is left out: the hook refuses os.fork, so it is the infinite loop again, at 1.5 s a run)
    for name in ("infinite loop", "huge allocation", "network", "write outside", "parent environment", "huge file"):
        verdict, seconds = grade(basic, attacks[name])
        assert not verdict.correct, f"{name}: {verdict.detail}"
        assert "[unsafe-basic]" in verdict.detail and verdict.sandbox == "unsafe-basic"
        assert seconds < TIMEOUT + 5
    assert not hits and not outside.exists()
    assert grade(basic, "import tempfile\nwith tempfile.NamedTemporaryFile() as f:\n    f.write(b'ok')\n"
                        "open('inside.txt', 'w').write('ok')\nreturn True")[0].correct


def test_sandbox_environment_is_clean(monkeypatch) -> None:
    monkeypatch.setenv("SKIPKV_TEST_SECRET", SECRET)
    result = Sandbox(SandboxLimits(timeout_s=TIMEOUT)).run("import os, json\nprint(json.dumps(dict(os.environ)))")
    assert result.passed
    env = json.loads(result.stdout)
    assert "SKIPKV_TEST_SECRET" not in env
    assert env["PATH"] == "/usr/bin:/bin"


def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail() -> None:
    rows = [json.loads(line) for line in packaged("humaneval.jsonl").open()]
    grader = CodeGrader(timeout_s=5.0)
    for row in rows[::40]:  # 5 tasks spread over the set
        ex = Example(row["id"], "code", {"prompt": row["prompt"]}, row["test"], {"entry_point": row["entry_point"]})
        # raw completion (the body), then a chat reply with the whole function in a fence
        assert grader.grade(row["canonical_solution"], ex).correct, row["id"]
        fenced = f"Sure.\n```python\n{row['prompt']}{row['canonical_solution']}```\n"
        assert grader.grade(fenced, ex).correct, row["id"]
        assert not grader.grade("    return None\n", ex).correct, row["id"]


# ------------------------------------------------------------------------------------------------------
# The attacks that got past the old levels, each contained at the default level (namespaces).
def _escapes(outside: Path, sock: Path, victim: int) -> dict[str, str]:
    o = str(outside)
    return {
        "unix socket at a host path": (
            f"import socket\ns = socket.socket(socket.AF_UNIX)\ns.connect({str(sock)!r})\nreturn True"),
        "rename out": f"import os\nopen('a', 'w').write('x')\nos.rename('a', {o + '/renamed'!r})\nreturn True",
        "hard link out": f"import os\nopen('a', 'w').write('x')\nos.link('a', {o + '/linked'!r})\nreturn True",
        "symlink out": (f"import os\nos.symlink({o + '/via-symlink'!r}, 'l')\nopen('l', 'w').write('x')\n"
                        "return True"),
        "dir_fd out": (f"import os\nfd = os.open({o!r}, os.O_RDONLY)\n"
                       "os.close(os.open('via-dirfd', os.O_WRONLY | os.O_CREAT, dir_fd=fd))\nreturn True"),
        "host paths visible": (f"import os\nreturn any(os.path.exists(p) for p in ({o!r}, '/root/.bashrc', "
                               "'/home', '/var', '/run', '/etc/passwd', '/sys/kernel'))"),
        "pidfd kill": (
            "import os, signal\nhit = False\n"
            f"for pid in {{{victim}, os.getppid()}} - {{0}}:  # (kill(0) is the own process group)\n"
            "    try:\n"
            "        signal.pidfd_send_signal(os.pidfd_open(pid), signal.SIGKILL)\n"
            "        hit = True\n"
            "    except OSError:\n"
            "        pass\n"
            "    try:\n"
            "        os.kill(pid, signal.SIGKILL)\n"
            "        hit = True\n"
            "    except OSError:\n"
            "        pass\n"
            "return hit"),
    }


def test_escapes_are_contained_by_namespaces(namespaces: CodeGrader, tmp_path: Path) -> None:
    outside = tmp_path / "host"
    outside.mkdir()
    os.chmod(tmp_path, 0o777)
    os.chmod(outside, 0o777)  # world-writable: only the sandbox's walls keep the program out
    sock_path = tmp_path / "host.sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(sock_path))
    os.chmod(sock_path, 0o777)
    server.listen(1)
    server.setblocking(False)
    victim = subprocess.Popen(["sleep", "60"])  # stands in for the parent: never the test process itself
    try:
        for name, body in _escapes(outside, sock_path, victim.pid).items():
            verdict, _ = grade(namespaces, body)
            assert not verdict.correct, f"{name}: {verdict.detail}"
            assert verdict.sandbox == "namespaces"
        with pytest.raises(BlockingIOError):
            server.accept()  # nobody connected to the host socket
        assert victim.poll() is None, "the sandbox killed a host process"
        assert sorted(outside.iterdir()) == []
    finally:
        victim.kill()
        server.close()


def test_background_process_and_disk_fill_are_contained() -> None:
    box = Sandbox(SandboxLimits(timeout_s=5.0, disk_bytes=8 << 20))
    try:
        assert box.isolation == "namespaces"
    except SkipKVError as exc:
        pytest.skip(str(exc))
    # A daemon that detaches (fork + setsid) and would live for a minute after the program returns.
    bg = box.run("import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\n    os._exit(0)\n"
                 "print('parent done')\n")
    assert bg.passed and bg.uid is not None
    assert _wait_gone(bg.uid), "a background process outlived the run"
    # Filling the disk with many small files (each under the per-file limit) stops at the tmpfs size.
    fill = box.run("import os\nn = 0\ntry:\n    while True:\n"
                   "        open(f'/tmp/f{n}', 'wb').write(b'x' * (1 << 20))\n        n += 1\n"
                   "except OSError as e:\n    print(n, e.errno)\n")
    written, errno = map(int, fill.stdout.split())
    assert written <= 8 and errno == 28, fill.stdout  # ENOSPC at the 8 MiB cap


def _wait_gone(uid: int, seconds: float = 5.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline and _processes_of(uid):
        time.sleep(0.1)
    return _processes_of(uid) == 0


_CALLER = """
import secrets, sys
import skipkv.eval.sandbox as sb
sb.secrets.randbelow = lambda n: int(sys.argv[1]) - sb.UID_RANGE[0]  # a uid the test can look for
box = sb.Sandbox(sb.SandboxLimits(timeout_s=60))
assert box.isolation == "namespaces"  # the start-up probe runs (and ends) before the program
print("probed", flush=True)
box.run("import time\\ntime.sleep(60)")
"""


def test_program_dies_with_its_caller_killed_by_sigkill(namespaces: CodeGrader, tmp_path: Path) -> None:
    import secrets
    import signal

    from skipkv.eval.sandbox import UID_RANGE

    uid = UID_RANGE[0] + secrets.randbelow(UID_RANGE[1] - UID_RANGE[0])
    script = tmp_path / "caller.py"
    script.write_text(_CALLER)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1] / "src")}
    caller = subprocess.Popen([sys.executable, str(script), str(uid)], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert caller.stdout.readline().strip() == "probed"
        deadline = time.time() + 20
        while time.time() < deadline and not _processes_of(uid):
            time.sleep(0.1)
        assert _processes_of(uid), "the sandboxed program never started"
        os.kill(caller.pid, signal.SIGKILL)
        caller.wait()
        assert _wait_gone(uid), "the program outlived its caller"
        # ... and so did nothing of the sandbox's own (unshare, its shell): their command lines carry the uid.
        ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
        assert f" {uid} " not in ps
    finally:
        caller.kill()
        for pid in subprocess.run(["ps", "-u", str(uid), "-o", "pid="], capture_output=True, text=True).stdout.split():
            with contextlib.suppress(OSError):
                os.kill(int(pid), signal.SIGKILL)  # only if the test failed: leave no survivor behind


def test_no_silent_downgrade(monkeypatch) -> None:
    import skipkv.eval.sandbox as sb

    # A per-program timeout too short for Python to start does not fail the start-up probe ...
    tiny = Sandbox(SandboxLimits(timeout_s=0.01))
    try:
        assert tiny.isolation == "namespaces"
    except SkipKVError as exc:
        pytest.skip(str(exc))
    # ... and a machine that cannot provide namespaces is an error, never a quiet fallback to a weaker level.
    real_which = sb.shutil.which
    monkeypatch.setattr(sb.shutil, "which", lambda t: None if t == "pivot_root" else real_which(t))
    with pytest.raises(SkipKVError, match="unavailable.*unsafe-basic"):
        _ = Sandbox().isolation
    with pytest.raises(SkipKVError, match="unavailable"):
        CodeGrader().ready()
    assert CodeGrader(isolation="unsafe-basic").sandbox().isolation == "unsafe-basic"  # asked for by name
    for bad in ("auto", "basic", "none"):
        with pytest.raises(SkipKVError, match="isolation"):
            CodeGrader(isolation=bad)


# A wrong body followed by code that ends the process with status 0 before (or however) the asserts ran. Each
# would be graded `correct` if exit status 0 meant a pass.
_WRONG = "    return 0\n"
_EXITS = {
    "os._exit": _WRONG + "import os\nos._exit(0)\n",
    "exit()": _WRONG + "exit()\n",
    "quit()": _WRONG + "quit()\n",
    "sys.exit in the body": "    import sys\n    sys.exit(0)\n",
    "raise SystemExit(0)": _WRONG + "raise SystemExit(0)\n",
    "atexit hook": _WRONG + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
    "sys.excepthook": _WRONG + "import sys, os\nsys.excepthook = lambda *a: os._exit(0)\n",
    "exec /bin/true": _WRONG + "import os\nos.execv('/bin/true', ['true'])\n",
    "thread exits": _WRONG + "import os, threading\nthreading.Thread(target=os._exit, args=(0,)).start()\n"
                    "import time\ntime.sleep(1)\n",
    "prints a pass": _WRONG + "print('passed')\nimport os\nos._exit(0)\n",
    "closes stdout": _WRONG + "import os, sys\nos.close(1)\nos._exit(0)\n",
    "SystemExit from check": "    raise SystemExit(0)\n",
}


@pytest.mark.parametrize("level", ["namespaces", "unsafe-basic"])
def test_exiting_early_is_never_a_pass(level: str) -> None:
    grader = CodeGrader(timeout_s=5.0, isolation=level)
    try:
        grader.sandbox()
    except SkipKVError as exc:
        pytest.skip(str(exc))
    prompt = "def add(a, b):\n    \"\"\"Add.\"\"\"\n"
    test = "def check(candidate):\n    assert candidate(1, 2) == 3\n    assert candidate(2, 2) == 4\n"
    example = Example("t", "code", {"prompt": prompt}, test, {"entry_point": "add"})
    assert grader.grade("    return a + b\n", example).correct  # the harness does pass a right answer
    passed = [name for name, completion in _EXITS.items() if grader.grade(completion, example).correct]
    assert passed == [], f"graded correct although the tests failed or never ran: {passed}"


def test_memory_and_processes_are_bounded_for_the_whole_run() -> None:
    """Six children, each far under the per-process address-space limit, together over the run's total: killed.
    The same program under a larger total runs to the end."""
    program = ("import os, time\npids = []\nfor i in range(6):\n    pid = os.fork()\n    if pid == 0:\n"
               "        x = bytearray(64 << 20)\n        for j in range(0, len(x), 4096):\n            x[j] = 1\n"
               "        time.sleep(1)\n        os._exit(0)\n    pids.append(pid)\n"
               "for p in pids:\n    os.waitpid(p, 0)\nprint('all done')\n")
    tight = Sandbox(SandboxLimits(timeout_s=8.0, memory_bytes=512 << 20, total_memory_bytes=192 << 20))
    try:
        assert tight.isolation == "namespaces"
    except SkipKVError as exc:
        pytest.skip(str(exc))
    r = tight.run(program)
    assert r.status == "failed" and "together held" in r.stderr and "all done" not in r.stdout, r
    roomy = Sandbox(SandboxLimits(timeout_s=8.0, memory_bytes=512 << 20, total_memory_bytes=1 << 30))
    assert roomy.run(program).stdout.strip() == "all done"
    few = Sandbox(SandboxLimits(timeout_s=8.0, processes=3))
    r = few.run(program.replace("64 << 20", "1 << 20"))
    assert r.status == "failed" and "all done" not in r.stdout, r
