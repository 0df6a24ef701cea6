"""The code sandbox: hostile programs are contained and graded as failures, and grading carries on afterwards.

Each hostile completion is written so that it would *pass* its test if the sandbox let it do what it tries
(reach the network, read the parent's environment, write outside its directory ...). A pass therefore means
an escape, and the parent also checks the side effects directly.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import threading
import time
from pathlib import Path

import pytest

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
    grader = CodeGrader(timeout_s=TIMEOUT, isolation="auto")
    if grader.sandbox().isolation != "namespaces":
        pytest.skip("namespace isolation needs Linux, root, unshare and setpriv")
    return grader


@pytest.fixture(scope="module")
def basic() -> CodeGrader:
    return CodeGrader(timeout_s=TIMEOUT, isolation="basic")


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
        assert not verdict.correct, f"{name}: {verdict.detail}"
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
    out = subprocess.run(["ps", "-u", str(uid), "-o", "pid="], capture_output=True, text=True)
    return len(out.stdout.split())


def test_basic_isolation_contains_the_same_attacks(basic: CodeGrader, listener, tmp_path: Path, monkeypatch) -> None:
    # The fallback for machines without namespaces: limits, a clean environment and an audit hook.
    monkeypatch.setenv("SKIPKV_TEST_SECRET", SECRET)
    port, hits = listener
    outside = tmp_path / "escaped.txt"
    attacks = _attacks(port, outside)
    # (the fork bomb is left out: the hook refuses os.fork, so it is the infinite loop again, at 1.5 s a run)
    for name in ("infinite loop", "huge allocation", "network", "write outside", "parent environment", "huge file"):
        verdict, seconds = grade(basic, attacks[name])
        assert not verdict.correct, f"{name}: {verdict.detail}"
        assert "[basic]" in verdict.detail
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
