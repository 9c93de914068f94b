"""``logitproc chat`` driven through a pseudo-terminal as a user would (pexpect), and ``logitproc generate``.

The REPL runs on ``--model tiny`` (the random test model, compiled once into the session's private cache, which the
subprocesses inherit through ``$LOGITPROC_CACHE``); one short session runs on the default SmolLM2.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import jsonschema
import pexpect
import pytest
from server_process import sigint_at_default

PROMPT = ">>> "
ANSI = re.compile(r"\x1b\[[0-9;?]*[a-zA-Z]")
# Byte tokens of the tiny vocabulary (id 3 + byte) for tab, newline, carriage return and space.
NO_WHITESPACE = " ".join(f"{3 + b}=-100" for b in b"\t\n\r ")
SCHEMA = {"type": "object", "properties": {"pet": {"enum": ["cat", "dog"]}, "age": {"type": "integer", "minimum": 0,
                                                                                    "maximum": 99}},
          "required": ["pet", "age"], "additionalProperties": False}


def spawn(*args: str, timeout: float = 120):
    # strict UTF-8: whatever the terminal shows must be whole characters, a Ctrl-C during an answer included
    child = pexpect.spawn(sys.executable, ["-m", "logitproc", "chat", *args], env=dict(os.environ),
                          encoding="utf-8", timeout=timeout, dimensions=(40, 200), preexec_fn=sigint_at_default)
    child.expect_exact(PROMPT)
    return child


def say(child, line: str) -> str:
    """Send a line; return what the REPL printed before the next prompt (the echo of the line removed)."""
    child.sendline(line)
    child.expect_exact(PROMPT)
    text = ANSI.sub("", child.before).replace("\r\n", "\n")
    echoed = text.find(line)
    return (text[echoed + len(line) :] if echoed != -1 else text).strip("\n")


def test_chat_repl_on_the_tiny_model(tiny_compiled) -> None:
    child = spawn("--model", "tiny", "--temperature", "0", "--max-tokens", "12")
    try:
        assert "temperature = 0.5" in say(child, "/temperature 0.5")
        assert "max_tokens = 16" in say(child, "/max_tokens 16")
        answer = say(child, "Hello, who are you?")
        assert answer and "Traceback" not in answer
        # bad commands and values: one helpful line each, never a traceback
        assert say(child, "/temperature hot") == "error: /temperature: 'hot' is not a number"
        assert "top_p must be in (0.0, 1.0]" in say(child, "/top_p 2")
        assert "unknown command /bogus" in say(child, "/bogus")
        assert "not valid JSON" in say(child, "/json {nope")
        settings = say(child, "/settings")
        assert "temperature = 0.5" in settings and "max_tokens = 16" in settings
        # constrained to a JSON schema (whitespace biased away: a random model likes it)
        assert "logit_bias" in say(child, f"/logit_bias {NO_WHITESPACE}")
        assert "temperature = 0.0" in say(child, "/temperature 0")
        assert "max_tokens = 60" in say(child, "/max_tokens 60")
        # a schema the grammar backend cannot compile: one error line when asking, the REPL goes on
        say(child, '/json {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}')
        failed = say(child, "Describe a pet as JSON.")
        assert failed.startswith("error: ") and len(failed.splitlines()) == 1 and "Traceback" not in failed
        echoed = say(child, "/json " + json.dumps(SCHEMA))
        assert echoed == "response_format = JSON schema " + json.dumps(SCHEMA, separators=(",", ":"))
        answer = say(child, "Describe a pet as JSON.")
        jsonschema.validate(json.loads(answer.strip()), SCHEMA)
        assert "stop" in say(child, "/stats") and "tok/s" in say(child, "/stats")
        # Ctrl-C during an answer stops it; the REPL stays
        say(child, "/json off")
        say(child, "/max_tokens off")
        say(child, "/logit_bias clear")
        child.sendline("Tell me a very long story.")
        child.expect(r"story\.\r\n.")  # the answer has begun
        child.sendcontrol("c")
        child.expect_exact("[stopped]")
        assert "^C" not in child.before  # the terminal does not echo the Ctrl-C into the answer's text
        child.expect_exact(PROMPT)
        assert "finish: abort" in say(child, "/stats")
        # Ctrl-C at the prompt does not quit
        child.sendcontrol("c")
        child.expect_exact("Ctrl-C again")
        child.expect_exact(PROMPT)
        assert "history cleared" in say(child, "/reset")
        assert say(child, "/bad_words the a") == "bad_words = ('the', 'a')"
        assert say(child, "/min_tokens 3") == "min_tokens = 3"
        assert "min_tokens must be in [0, 2]" in say(child, "/max_tokens 2")
        assert say(child, "/bad_words clear") == "bad_words = ()"
        assert "/regex PATTERN" in say(child, "/help")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_commands_without_a_value_show_it_system_and_stop(tiny_compiled) -> None:
    child = spawn("--model", "tiny", "--temperature", "0", "--max-tokens", "5")
    try:
        assert say(child, "/temperature") == "temperature = 0.0"
        assert say(child, "/max_tokens") == "max_tokens = 5"
        assert say(child, "/seed") == "seed = off"
        assert say(child, "/json") == "response_format = None"
        assert say(child, "/json object") == "response_format = any JSON object"
        assert say(child, "/regex") == "response_format = any JSON object"
        assert say(child, "/regex [a-z]+") == "response_format = regex '[a-z]+'"
        assert say(child, "/json off") == "response_format = None"
        assert say(child, "/logit_bias") == "logit_bias = {}"
        assert say(child, "/bad_words") == "bad_words = ()"
        assert say(child, "/think") == "max_thinking_tokens = off"
        # the system prompt: set, shown, cleared
        assert say(child, "/system") == "system = none (the model's default)"
        assert say(child, "/system You are terse.") == "system = 'You are terse.'"
        assert say(child, "/system") == "system = 'You are terse.'"
        assert "system: 'You are terse.'" in say(child, "/settings")
        assert say(child, "/system off") == "system = none (the model's default)"
        # stop strings: quoted ones keep their spaces, \n is a newline
        assert say(child, "/stop") == "stop = ()"
        assert say(child, '/stop END "two words" \\n') == "stop = ('END', 'two words', '\\n')"
        assert say(child, "/stop clear") == "stop = ()"
        # an answer cut by max_tokens says so
        assert say(child, "Tell me a long story.").endswith("[cut at max_tokens = 5]")
        assert "model defaults: " in say(child, "/settings")
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_ctrl_d_and_two_ctrl_c_quit(tiny_compiled) -> None:
    child = spawn("--model", "tiny")
    child.sendeof()
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0
    child = spawn("--model", "tiny")
    child.sendcontrol("c")
    child.expect_exact("Ctrl-C again")
    child.sendcontrol("c")
    child.expect(pexpect.EOF)
    child.close()
    assert child.exitstatus == 0


#: Writes numbered chunks of multi-byte text as the REPL writes an answer (answer_terminal, write_whole) for a while,
#: Ctrl-C (SIGINT) only counted, as in an answer; then waits for a line before it leaves answer_terminal (a Ctrl-C
#: after that may flush the output the reader has not read yet: the terminal's defaults, restored). Run unbuffered
#: (PYTHONUNBUFFERED=1), where an interrupted write used to lose its end.
_WRITER = """
import signal, sys, time
from logitproc.serve.chat import answer_terminal, write_whole
interrupts = []
signal.signal(signal.SIGINT, lambda *args: interrupts.append(1))
terminal = answer_terminal(sys.stdin)
print("go", flush=True)
chunks, end = 0, time.monotonic() + 1.5
while time.monotonic() < end:
    write_whole(sys.stdout, f"<{chunks:06d}>" + "é€😀" * 48)
    chunks += 1
print(f"\\nwritten {chunks}, interrupted {len(interrupts)}", flush=True)
sys.stdin.readline()
terminal.close()
"""


def test_ctrl_c_neither_cuts_nor_drops_an_answer_being_written() -> None:
    """A Ctrl-C every 20 ms while an answer is written: the terminal shows every character written, whole (its
    defaults echo ^C between a character's bytes and drop output already written)."""
    child = pexpect.spawn(sys.executable, ["-c", _WRITER], env={**os.environ, "PYTHONUNBUFFERED": "1"}, timeout=60)
    try:
        shown, last = b"", 0.0  # read here, not with expect(), to see every byte as it comes
        deadline = time.monotonic() + 30
        while b"interrupted" not in shown:
            assert time.monotonic() < deadline, f"no summary: the writer alive {child.isalive()}, {shown[-100:]!r}"
            if b"go\r\n" in shown and time.monotonic() - last > 0.02:
                child.sendcontrol("c")
                last = time.monotonic()
            try:
                shown += child.read_nonblocking(1 << 16, timeout=0.02)
            except pexpect.TIMEOUT:
                pass
        child.sendline("")
        child.expect(pexpect.EOF)
        shown += child.before
    finally:
        child.close()
    text = shown.decode("utf-8")  # strict: a cut character fails here
    answer, summary = text.split("go\r\n", 1)[1].split("\r\nwritten ", 1)
    chunks, interrupted = map(int, re.findall(r"\d+", summary)[:2])
    assert interrupted > 10  # the Ctrl-Cs reached the writer while it wrote
    expected = "".join(f"<{i:06d}>" + "é€😀" * 48 for i in range(chunks))
    differs = next((i for i, (a, b) in enumerate(zip(answer, expected, strict=False)) if a != b), None)
    # (compared by hand: pytest's diff of megabytes of text takes minutes)
    assert (differs, len(answer)) == (None, len(expected)), (answer[differs - 20 : differs + 40] if differs else "")


def run_generate(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "logitproc", "generate", *args], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ))


def test_generate_prints_only_the_answer_on_stdout(tiny_compiled) -> None:
    done = run_generate("--model", "tiny", "--prompt", "hi", "--regex", "(yes|no), [a-z]{3}", "--seed", "1")
    assert done.returncode == 0, done.stderr
    assert re.fullmatch(r"(yes|no), [a-z]{3}\n", done.stdout), done.stdout
    assert "finish: stop" in done.stderr and "tok/s" in done.stderr
    same = run_generate("--model", "tiny", "--prompt", "hi", "--regex", "(yes|no), [a-z]{3}", "--seed", "1")
    assert same.stdout == done.stdout
    bad = run_generate("--model", "tiny", "--prompt", "hi", "--top-p", "3")
    assert bad.returncode == 2 and bad.stdout == "" and "top_p must be in" in bad.stderr


# ---------------------------------------------------------------------------------------------------- SmolLM2
@pytest.fixture(scope="module")
def smollm2_args() -> list[str]:
    """Fetch and compile SmolLM2 in this process; the subprocesses then find it in the cache. With
    ``$LOGITPROC_TEST_MODEL_CACHE`` set (the GGUF kept between sessions) they get its path, else no --model."""
    from logitproc.compile.model_fetch import fetch_default_model
    from logitproc.serve.cli_options import open_model

    kept = os.environ.get("LOGITPROC_TEST_MODEL_CACHE")
    path = fetch_default_model(kept)
    args = ["--model", str(path)] if kept else []
    open_model(args[1] if args else "default", "cpu")
    return args


def test_chat_repl_on_smollm2(smollm2_args) -> None:
    child = spawn(*smollm2_args, "--temperature", "0", "--max-tokens", "40", timeout=60)
    usage = re.compile(r"last answer: (\d+) prompt tok \((\d+) from the prefix cache\)")
    try:
        assert "Paris" in say(child, "What is the capital of France?")
        first_prompt, first_cached = map(int, usage.search(say(child, "/stats")).groups())
        assert first_cached == 0
        assert say(child, "And of Italy?")
        second_prompt, second_cached = map(int, usage.search(say(child, "/stats")).groups())
        # the second turn repeats the first (prompt and answer): only the new message is prefilled
        assert first_prompt < second_cached < second_prompt
        child.sendline("/exit")
        child.expect(pexpect.EOF)
    finally:
        child.close()
    assert child.exitstatus == 0


def test_generate_on_smollm2(smollm2_args) -> None:
    done = run_generate(*smollm2_args, "--prompt", "What is the capital of France?", "--temperature", "0",
                        "--max-tokens", "40")
    assert done.returncode == 0 and "Paris" in done.stdout, done.stderr


def test_schema_arguments_inline_file_pipe_and_stdin(tmp_path, monkeypatch) -> None:
    import io

    from logitproc.serve.cli_options import read_schema

    schema = {"type": "object", "required": ["a"]}
    (tmp_path / "s.json").write_text(json.dumps(schema))
    assert read_schema(json.dumps(schema)) == schema
    assert read_schema(str(tmp_path / "s.json")) == schema
    r, w = os.pipe()  # what the shell's <(...) passes: a /dev/fd path that is not a regular file
    os.write(w, json.dumps(schema).encode())
    os.close(w)
    try:
        assert read_schema(f"/dev/fd/{r}") == schema
    finally:
        os.close(r)
    monkeypatch.setattr(sys, "stdin", io.StringIO(json.dumps(schema)))
    assert read_schema("-", stdin=True) == schema
    for bad, message in [("-", "reads standard input, which the chat needs"),
                         (str(tmp_path), "neither inline JSON nor a file"),
                         ("{not json", "not valid JSON"), (str(tmp_path / "missing.json"), "neither")]:
        with pytest.raises(ValueError, match=message):
            read_schema(bad)


def test_ctrl_c_during_a_long_prompt_stops_it_within_a_chunk(tiny_compiled) -> None:
    """A long prompt goes in by chunks of the step's budget, and Ctrl-C (SIGINT) is seen between them: the answer
    ends as stopped long before the prompt is in (counted in prompt tokens, and within 2 s)."""
    import io
    import signal
    import threading
    import time

    from logitproc.runtime import GenerationConfig
    from logitproc.serve.chat import ChatSession
    from logitproc.serve.engine import Engine

    engine = Engine(tiny_compiled, max_num_batched_tokens=16)
    out = io.StringIO()
    session = ChatSession(engine, GenerationConfig(temperature=0.0, max_tokens=8), out=out)
    seen: list[tuple[int, int] | None] = []
    original = engine.prompt_progress

    def progress(request_id: str) -> tuple[int, int] | None:  # what the chat asks between chunks, recorded
        seen.append(original(request_id))
        return seen[-1]

    engine.prompt_progress = progress
    sent: list[float] = []

    def interrupt() -> None:
        while not any(s is not None and s[0] > 0 for s in seen):
            time.sleep(0.005)
        sent.append(time.perf_counter())
        os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    session.answer("a b c d e f g h " * 200)
    stopped = time.perf_counter()
    assert session.last_output.finish_reason == "abort" and out.getvalue().strip() == "[stopped]"
    done, total = max((s for s in seen if s is not None), key=lambda s: s[0])
    assert total > 2000 and done < total / 2  # most of the prompt never went in
    assert stopped - sent[0] < 2.0
