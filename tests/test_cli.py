"""The command line as a user meets it: a fast ``--help`` that shows every default, no torch behind ``import tvm``,
quiet stderr, Ctrl-C and closed pipes without tracebacks, answers cut by max_tokens said so, the model's default
settings, Tree Decode files given on the command line. Commands run in subprocesses on ``--model tiny``."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
from logitproc.serve import model_defaults as defaults
from server_process import sigint_at_default


def python(*code_or_args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *code_or_args], capture_output=True, text=True, env=dict(os.environ),
                          timeout=kwargs.pop("timeout", 300), **kwargs)


def logitproc(*args: str, **kwargs) -> subprocess.CompletedProcess[str]:
    return python("-m", "logitproc", *args, **kwargs)


# ---------------------------------------------------------------------------------------------------- start-up
def test_help_loads_no_tvm_and_shows_every_default() -> None:
    done = python("-c", "import sys; from logitproc.serve.cli import build_parser; build_parser(); "
                        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tvm', 'tvm_ffi', 'torch', "
                        "'numpy')))")
    assert done.returncode == 0 and done.stdout.strip() == "[]", done.stdout + done.stderr
    for command in ("chat", "generate", "compile"):
        text = logitproc(command, "--help").stdout
        options = [entry for entry in re.split(r"\n  (?=-)", text) if entry.startswith("-")]
        assert len(options) > 3
        for entry in options:
            if not entry.startswith(("-h, --help", "--prompt")):
                assert "default" in entry, f"{command}: no default in {entry!r}"
        if command != "compile":
            assert f"--max-tokens defaults to {defaults.DEFAULT_MAX_TOKENS}" in " ".join(text.split())


def test_target_choices_are_the_compilers() -> None:
    from logitproc.compile import TARGET_KINDS
    from logitproc.serve.cli_options import TARGET_CHOICES

    assert TARGET_CHOICES == TARGET_KINDS


def test_the_command_imports_tvm_without_torch_and_torch_still_imports_after() -> None:
    command = "import sys; sys.argv = ['logitproc', 'devices']; from logitproc.__main__ import run; run(); "
    done = python("-c", command + "print('tvm' in sys.modules, 'torch' in sys.modules)")
    assert done.returncode == 0 and done.stdout.split()[-2:] == ["True", "False"], done.stderr
    pytest.importorskip("torch")
    done = python("-c", command + "import torch; print(torch.ones(2).sum().item())")
    assert done.returncode == 0 and done.stdout.split()[-1] == "2.0", done.stderr
    # a library user's process (no command): TVM imports as TVM does, with torch where it is installed
    done = python("-c", "import sys, logitproc.runtime; "
                        "print(sys.modules['tvm_ffi']._convert.torch is sys.modules['torch'])")
    assert done.returncode == 0 and done.stdout.strip() == "True", done.stderr


# ---------------------------------------------------------------------------------------------------- stderr
def test_harmless_native_messages_are_filtered_and_the_rest_passes() -> None:
    code = """
import os, sys
from logitproc.quiet_stderr import filtered_stderr
with filtered_stderr():
    os.write(2, b"[03:46:04] /project/include/tvm/topi/transform.h:1261: Warning: Fast mode segfaults when there "
                b"are out-of-bounds indices. Make sure input indices are in bound\\n")
    os.write(2, b"error: XDG_RUNTIME_DIR is invalid or not set in the environment.\\n")
    os.write(2, b"a real problem\\n")
    print("progress line", file=sys.stderr)
    os.write(2, b"no newline at the end")
print("after", file=sys.stderr)
"""
    done = python("-c", code)
    assert done.returncode == 0
    assert done.stderr == "a real problem\nprogress line\nno newline at the endafter\n"


def test_a_model_compile_prints_progress_and_no_engine_warning(tiny_model_compiled_by_cli, tmp_path: Path) -> None:
    done = tiny_model_compiled_by_cli  # the session's build of the tiny model, unless an earlier test built it first
    if "compiled and exported" not in done.stderr:  # then a fresh build in an empty cache
        done = subprocess.run([sys.executable, "-m", "logitproc", "compile", "--model", "tiny"], capture_output=True,
                              text=True, timeout=900, env=dict(os.environ, LOGITPROC_CACHE=str(tmp_path)))
    assert done.returncode == 0, done.stderr
    assert "compiled and exported" in done.stderr
    assert "Warning" not in done.stderr and "segfaults" not in done.stderr, done.stderr


def test_devices_prints_no_driver_noise() -> None:
    done = logitproc("devices")
    assert done.returncode == 0 and "cpu:0" in done.stdout
    assert "XDG_RUNTIME_DIR" not in done.stderr, done.stderr


def test_models_lists_every_family_without_loading_tvm() -> None:
    from logitproc.compile.families import FAMILIES

    done = python("-c", "import sys; from logitproc.serve.cli import main; main(['models']); "
                        "print('tvm' in sys.modules)")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for family in FAMILIES:
        assert any(line.startswith(family.name) and family.hf_architectures[0] in line for line in lines), lines
    assert lines[-1] == "False"


# ---------------------------------------------------------------------------------------------------- generate
def test_an_answer_cut_by_max_tokens_is_said_on_stderr(tiny_compiled) -> None:
    done = logitproc("generate", "--model", "tiny", "--prompt", "hi", "--max-tokens", "3", "--min-tokens", "3")
    assert done.returncode == 0, done.stderr
    assert "the answer was cut at max_tokens = 3" in done.stderr
    whole = logitproc("generate", "--model", "tiny", "--prompt", "hi", "--regex", "ab", "--max-tokens", "30")
    assert whole.returncode == 0 and whole.stdout == "ab\n" and "cut" not in whole.stderr


def test_ctrl_c_exits_130_quietly(tiny_compiled) -> None:
    child = subprocess.Popen([sys.executable, "-m", "logitproc", "generate", "--model", "tiny", "--prompt",
                              "a long story", "--max-tokens", "4000", "--min-tokens", "3999"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ),
                             preexec_fn=sigint_at_default)
    assert child.stdout is not None
    child.stdout.read(1)  # the answer has begun
    child.send_signal(signal.SIGINT)
    out, err = child.communicate(timeout=120)
    assert child.returncode == 130
    assert b"Traceback" not in err and b"KeyboardInterrupt" not in err, err.decode()


def test_a_closed_pipe_exits_quietly(tiny_compiled) -> None:
    started = time.perf_counter()
    done = subprocess.run(
        f"{sys.executable} -m logitproc generate --model tiny --prompt story --max-tokens 4000 --min-tokens 3999"
        " | head -c 1; exit ${PIPESTATUS[0]}", shell=True, capture_output=True, env=dict(os.environ), timeout=300,
        executable="/bin/bash")
    assert done.returncode == 141 and len(done.stdout) == 1  # 128 + SIGPIPE, as other tools
    assert b"Traceback" not in done.stderr and b"BrokenPipe" not in done.stderr, done.stderr.decode()
    assert time.perf_counter() - started < 120  # it stopped instead of writing 4000 tokens into nothing


@pytest.mark.parametrize("delay", [0.0, 0.2, 0.5])
def test_ctrl_c_while_the_command_starts_is_quiet(tiny_compiled, delay: float) -> None:
    child = subprocess.Popen([sys.executable, "-m", "logitproc", "generate", "--model", "tiny", "--prompt", "x"],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=dict(os.environ),
                             preexec_fn=sigint_at_default)
    assert child.stderr is not None
    child.stderr.readline()  # the first progress line: the interpreter and the command line have loaded
    time.sleep(delay)
    child.send_signal(signal.SIGINT)
    _, err = child.communicate(timeout=120)
    # 0 when it had already answered; -SIGINT when the signal came while the interpreter was exiting (a shell
    # shows both 130 and a SIGINT death as $? = 130)
    assert child.returncode in (0, 130, -signal.SIGINT)
    assert b"Traceback" not in err, err.decode()


# ---------------------------------------------------------------------------------------------------- defaults
def test_model_defaults_come_from_the_generation_config_then_the_table(tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"do_sample": True, "temperature": 0.6, "top_p": 0.95, "max_new_tokens": 100, "eos_token_id": 2}))
    found = defaults.model_defaults("Some-Model", [tmp_path])
    assert found.values == {"temperature": 0.6, "top_p": 0.95, "max_tokens": 100}
    assert "generation_config.json" in found.source
    only_ids = tmp_path / "ids"
    only_ids.mkdir()
    (only_ids / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    smol = defaults.model_defaults("SmolLM2-135M-Instruct.Q4_1", [only_ids])
    assert smol.values == {**defaults.PER_MODEL["smollm2-135m-instruct"], "max_tokens": defaults.DEFAULT_MAX_TOKENS}
    fallback = defaults.model_defaults("other model", [])
    assert fallback.values == {**defaults.FALLBACK, "max_tokens": defaults.DEFAULT_MAX_TOKENS}


def test_the_defaults_make_a_valid_generation_config() -> None:
    from logitproc.runtime import GenerationConfig

    for values in [*defaults.PER_MODEL.values(), defaults.FALLBACK]:
        GenerationConfig(**values, max_tokens=defaults.DEFAULT_MAX_TOKENS)


def test_options_given_win_over_the_model_defaults(tiny_compiled) -> None:
    from logitproc.serve.cli import build_parser
    from logitproc.serve.cli_options import config_from_options, options_from_args

    args = build_parser().parse_args(["generate", "--prompt", "x", "--temperature", "0.5", "--max-tokens", "7"])
    config = config_from_options(options_from_args(args), {"temperature": 0.0, "repetition_penalty": 1.1,
                                                           "max_tokens": 512})
    assert (config.temperature, config.repetition_penalty, config.max_tokens) == (0.5, 1.1, 7)


# ---------------------------------------------------------------------------------------------------- tree decode
def test_tree_decode_file_given_on_the_command_line(tiny_compiled, tmp_path: Path) -> None:
    """Anywhere, absolute or relative to the working directory; the answer follows the tree."""
    tree = {"start_token_id": 0, "end_token_id": 2, "prefix_dict": {"0": [3 + ord("o")], f"0_{3 + ord('o')}":
                                                                          [3 + ord("k")]}}
    (tmp_path / "tree.json").write_text(json.dumps(tree))
    for value, cwd in [(str(tmp_path / "tree.json"), None), ("tree.json", tmp_path)]:
        done = logitproc("generate", "--model", "tiny", "--prompt", "hi", "--tree-decode-config", value, cwd=cwd)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "ok\n" and "tree decode: map loaded" in done.stderr
    missing = logitproc("generate", "--model", "tiny", "--prompt", "hi", "--tree-decode-config", "nope.json",
                        cwd=tmp_path)
    assert missing.returncode == 2 and "--tree-decode-config" in missing.stderr and "no such file" in missing.stderr


def test_a_chat_template_file_replaces_the_models(tiny_compiled, tmp_path: Path) -> None:
    """``--chat-template FILE`` renders the chats (here a template that refuses, naming the message); a file that is
    not jinja is refused before the model opens."""
    refuse, broken = tmp_path / "refuse.jinja", tmp_path / "broken.jinja"
    refuse.write_text("{{ raise_exception('custom template saw ' + messages[-1]['content']) }}")
    done = logitproc("generate", "--model", "tiny", "--prompt", "hi", "--chat-template", str(refuse))
    assert done.returncode == 2 and f"chat template: the chat template {refuse}" in done.stderr
    assert "failed to render these messages: custom template saw hi" in done.stderr
    broken.write_text("{% if %}")
    refused = logitproc("generate", "--model", "tiny", "--prompt", "hi", "--chat-template", str(broken))
    assert refused.returncode == 2 and "is not valid jinja" in refused.stderr and "loading" not in refused.stderr


def test_tests_use_a_private_cache() -> None:
    cache = Path(os.environ["LOGITPROC_CACHE"]).resolve()
    assert cache != (Path.home() / ".cache" / "logitproc").resolve()
    assert Path(tempfile.gettempdir()).name == "tmp" and Path(tempfile.gettempdir()).parent.name.startswith(
        "logitproc-test-run-")


def test_speculative_option_reports_its_figures_and_refuses_bad_values(tiny_compiled) -> None:
    done = logitproc("generate", "--model", "tiny", "--no-chat-template", "--prompt", "one two three four " * 20,
                     "--temperature", "0", "--max-tokens", "40", "--speculative", "ngram:4")
    assert done.returncode == 0, done.stderr
    assert "speculation: " in done.stderr and "draft tokens accepted" in done.stderr
    plain = logitproc("generate", "--model", "tiny", "--no-chat-template", "--prompt", "one two three four " * 20,
                      "--temperature", "0", "--max-tokens", "40")
    assert plain.stdout == done.stdout  # the same answer
    for bad, message in (("eagle", "method must be one of ['ngram'], got 'eagle'"),
                         ("ngram:0", "num_speculative_tokens must be an int in [1, 32], got 0")):
        refused = logitproc("generate", "--model", "tiny", "--prompt", "x", "--speculative", bad)
        assert refused.returncode == 2 and message in refused.stderr and "Traceback" not in refused.stderr


def test_a_schema_read_from_standard_input_or_a_pipe_constrains_the_answer(tiny_compiled, tmp_path) -> None:
    """``--json-schema -`` reads standard input (here redirected from a file) and ``<(...)`` a pipe, each once."""
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
              "additionalProperties": False}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    common = ("generate", "--model", "tiny", "--prompt", "a number", "--max-tokens", "40", "--seed", "1")
    with open(path) as stdin:
        piped = logitproc(*common, "--json-schema", "-", stdin=stdin)
    assert piped.returncode == 0, piped.stderr
    assert set(json.loads(piped.stdout)) == {"n"} and "schema: the answer is valid" in piped.stderr
    script = f"{shlex.quote(sys.executable)} -m logitproc {shlex.join(common)} --json-schema <(cat {path})"
    via_pipe = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=dict(os.environ), timeout=300)
    assert via_pipe.returncode == 0 and via_pipe.stdout == piped.stdout, via_pipe.stderr
    chat = logitproc("chat", "--model", "tiny", "--json-schema", "-", stdin=subprocess.DEVNULL)
    assert chat.returncode == 2 and "standard input" in chat.stderr and "Traceback" not in chat.stderr
