"""Every code block of README.md and docs/*.md works as written.

- ``python`` blocks run, in order, in one namespace per file (a later block may use an earlier one's names), in a
  subprocess whose working directory holds ``docs/`` (so ``docs/examples/...`` paths work) and whose cache is the
  tests' private one.
- ``bash`` blocks pass ``bash -n``; each ``logitproc ...`` command in them parses with the real argument parser, and a
  ``python scripts/X.py ...`` command answers ``--help``; blocks marked ``bash run`` are run and must succeed.
- ``json`` blocks parse.
- A block marked ``illustrative`` after its language (```` ```python illustrative ````) is not run: it shows a shape
  with placeholders. A python block marked ``needs=torch,transformers`` runs where those optional packages are
  installed (CI's second step) and is left out elsewhere. Blocks without a language are plain text.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```[ \t]*$", re.M | re.S)
CHECKED_LANGUAGES = {"python", "bash", "json"}


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    language: str
    flags: frozenset[str]
    code: str

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = []
    for match in FENCE.finditer(text):
        language, *flags = match.group(1).split() or [""]
        found.append(Block(path, text.count("\n", 0, match.start()) + 1, language, frozenset(flags), match.group(2)))
    return found


ALL_BLOCKS = [block for path in DOCS for block in blocks(path)]


def snippet_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(ROOT.parent) + os.pathsep + os.environ.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    """A working directory with ``docs/`` in it, as at the repository root, where snippets may write files."""
    work = tmp_path_factory.mktemp("snippets")
    (work / "docs").symlink_to(ROOT / "docs")
    (work / "scripts").symlink_to(ROOT / "scripts")
    return work


def test_every_code_block_has_a_known_language_or_is_text() -> None:
    for block in ALL_BLOCKS:
        assert block.language in CHECKED_LANGUAGES | {""}, f"{block.where}: unknown block language {block.language!r}"
        marks = {flag for flag in block.flags if not flag.startswith("needs=")}
        assert marks <= {"illustrative", "run"}, f"{block.where}: unknown marks {marks}"


# ---------------------------------------------------------------------------------------------------- python
RUNNER = """
import json, sys, traceback
namespace = {"__name__": "__main__"}
for where, code in json.load(sys.stdin):
    try:
        exec(compile(code, where, "exec"), namespace)
    except BaseException:
        print(f"FAILED {where}", file=sys.stderr)
        traceback.print_exc()
        sys.exit(1)
"""


def runnable(block: Block) -> bool:
    """A python block that runs here: not illustrative, and every module its ``needs=`` mark names is installed."""
    needs = [name for flag in block.flags if flag.startswith("needs=") for name in flag[len("needs="):].split(",")]
    return (block.language == "python" and "illustrative" not in block.flags
            and all(importlib.util.find_spec(name) is not None for name in needs))


def python_files() -> list[Path]:
    return [path for path in DOCS if any(runnable(b) for b in blocks(path))]


@pytest.mark.parametrize("path", python_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_python_blocks_run(path: Path, workdir: Path, default_model_in_cache) -> None:
    code = [(f"{b.where}", b.code) for b in blocks(path) if runnable(b)]
    done = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(code), capture_output=True, text=True,
                          cwd=workdir, env=snippet_env(), timeout=900)
    assert done.returncode == 0, f"{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------------------------------------- bash
def commands(code: str) -> list[list[str]]:
    """The simple commands of a block (continuation lines joined, comments dropped, split at && ; |)."""
    joined = code.replace("\\\n", " ")
    found = []
    for line in joined.splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        words: list[str] = []
        for word in lexer:
            if word in (";", "&&", "||", "|", "&"):
                found.append(words)
                words = []
            else:
                words.append(word)
        found.append(words)
    return [c for c in found if c]


def logitproc_args(command: list[str]) -> list[str] | None:
    if command[0] == "logitproc":
        return command[1:]
    if command[:3] == ["python", "-m", "logitproc"]:
        return command[3:]
    return None


BASH_BLOCKS = [b for b in ALL_BLOCKS if b.language == "bash" and "illustrative" not in b.flags]


@pytest.mark.parametrize("block", BASH_BLOCKS, ids=lambda b: b.where)
def test_bash_blocks_are_valid(block: Block) -> None:
    from logitproc.serve.cli import build_parser

    syntax = subprocess.run(["bash", "-n"], input=block.code, capture_output=True, text=True)
    assert syntax.returncode == 0, f"{block.where}: {syntax.stderr}"
    for command in commands(block.code):
        args = logitproc_args(command)
        if args is not None:
            try:
                build_parser().parse_args(args)
            except SystemExit as exit:
                pytest.fail(f"{block.where}: `{shlex.join(command)}` does not parse (exit {exit.code})")
        elif command[0] == "python" and len(command) > 1 and command[1].startswith("scripts/"):
            script = ROOT / command[1]
            assert script.is_file(), f"{block.where}: no {command[1]}"
            done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True,
                                  env=snippet_env(), cwd=ROOT, timeout=120)
            assert done.returncode == 0, f"{block.where}: {command[1]} --help: {done.stderr[-2000:]}"
        elif command[0] == "bash" and len(command) > 1:
            assert (ROOT / command[1]).is_file(), f"{block.where}: no {command[1]}"


RUN_BLOCKS = [b for b in BASH_BLOCKS if "run" in b.flags]


@pytest.mark.parametrize("block", RUN_BLOCKS, ids=lambda b: b.where)
def test_bash_blocks_marked_run_succeed(block: Block, workdir: Path, default_model_in_cache) -> None:
    script = f'logitproc() {{ "{sys.executable}" -m logitproc "$@"; }}\nset -euo pipefail\n{block.code}'
    done = subprocess.run(["bash", "-c", script], capture_output=True, text=True, cwd=workdir, env=snippet_env(),
                          timeout=900)
    assert done.returncode == 0, f"{block.where}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr


# ---------------------------------------------------------------------------------------------------- json
def test_json_blocks_and_example_files_parse() -> None:
    for block in ALL_BLOCKS:
        if block.language == "json":
            json.loads(block.code)
    for path in (ROOT / "docs" / "examples").glob("*.json"):
        json.loads(path.read_text())


def test_the_examples_folder_holds_what_the_docs_name() -> None:
    for path in DOCS:
        for name in re.findall(r"docs/examples/[\w./-]+\w", path.read_text()):
            assert (ROOT / name).is_file(), f"{path.name} names {name}, which is missing"


def test_the_files_the_docs_name_exist() -> None:
    """A path in backticks (``runtime/targets.py``, ``docs/examples/person.json``) names a file of the repository."""
    named = re.compile(r"`([\w./-]+/[\w.-]+\.(?:py|md|json|sh|html|js|css|txt|toml))`")
    missing = [f"{doc.name}: {match.group(1)}" for doc in DOCS for match in named.finditer(doc.read_text())
               if not (ROOT / match.group(1)).exists()]
    assert not missing, missing
