"""The command line given hostile input: one clear line on stderr and status 2 (or 141 for a closed pipe), never a
traceback. Commands run in subprocesses on ``--model tiny``."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

GENERATE = [sys.executable, "-m", "logitproc", "generate", "--model", "tiny"]


def run(args: list, **kwargs) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(args, capture_output=True, env=dict(os.environ), timeout=300, **kwargs)


def assert_one_error_line(done: subprocess.CompletedProcess[bytes], *words: str) -> None:
    err = done.stderr.decode(errors="replace")
    assert done.returncode == 2, err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and all(w in lines[0] for w in words), err


@pytest.mark.parametrize("where", ["--prompt", "--stop", "--regex"])
def test_argv_that_is_not_utf8(where) -> None:
    args = [*GENERATE, "--prompt", "hi", where, b"caf\xe9 \xff"]
    assert_one_error_line(run(args), "not valid UTF-8", "caf\\xe9")


@pytest.mark.parametrize("schema", ["[]", '[{"type": "string"}]', "file:3", "file:null"])
def test_a_json_schema_that_is_not_an_object(schema, tmp_path) -> None:
    if schema.startswith("file:"):
        (tmp_path / "schema.json").write_text(schema[5:])
        schema = str(tmp_path / "schema.json")
    assert_one_error_line(run([*GENERATE, "--prompt", "hi", "--json-schema", schema]), "JSON schema is an object")


@pytest.mark.parametrize("value", ["2147483648", str(10**30)])
def test_top_k_beyond_int32(value) -> None:
    assert_one_error_line(run([*GENERATE, "--prompt", "hi", "--top-k", value]), "--top-k", "too large")


@pytest.mark.parametrize("redirect", ["| true", "| head -c 1", ">&-"])
def test_output_closed_before_or_after_the_answer(tiny_compiled, redirect) -> None:
    """The reader gone before anything is written, after the first byte of a short answer, or stdout closed from
    the start: no traceback, status 141 (SIGPIPE's) or 2 (closed stdout), or 0 when the answer got out whole."""
    command = " ".join(GENERATE[1:])
    done = run(f"{sys.executable} {command} --prompt story --max-tokens 5 {redirect}; exit ${{PIPESTATUS[0]}}",
               shell=True, executable="/bin/bash")
    err = done.stderr.decode()
    assert "Traceback" not in err and "BrokenPipe" not in err and "Exception ignored" not in err, err
    if redirect == ">&-":
        assert_one_error_line(done, "standard output is closed")
    else:
        assert done.returncode in (0, 141), err


def test_an_empty_regex_is_not_ignored() -> None:
    """``--regex ''`` reaches the config (which refuses it, naming the field) instead of being dropped."""
    assert_one_error_line(run([*GENERATE, "--prompt", "hi", "--regex", ""]), "regex")


@pytest.mark.parametrize(("option", "value", "says"), [
    ("--allowed-origins", "evil.example", "is not an origin like http://example.com:8080"),
    ("--allowed-origins", "http://a.example/path", "is not an origin"),
    ("--allowed-hosts", "http://box.lan", "is not a host name like example.com"),
    ("--allowed-hosts", "a.lan,b lan", "'b lan' is not a host name"),
])
def test_serve_refuses_a_policy_it_cannot_read(option, value, says) -> None:
    """Checked before anything loads: one line naming the option and the value."""
    done = run([sys.executable, "-m", "logitproc", "serve", "--model", "tiny", "--port", "0", option, value])
    assert_one_error_line(done, option, says)
