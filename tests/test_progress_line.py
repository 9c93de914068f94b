"""The command line's progress: on a terminal a live counter under the current step, piped only the step lines."""

from __future__ import annotations

import io
import os
import select
import time

from logitproc.serve.progress_line import CLEAR_LINE, ProgressLine


def read_all(fd: int) -> str:
    chunks = []
    while select.select([fd], [], [], 0.2)[0]:
        chunks.append(os.read(fd, 65536))
    return b"".join(chunks).decode()


def test_a_terminal_sees_a_counter_during_a_long_step_and_a_clean_line_at_the_end() -> None:
    leader, follower = os.openpty()
    with os.fdopen(follower, "w") as stream:
        with ProgressLine(stream) as progress:
            progress("compiling ...")
            time.sleep(2.2)
            progress.status("prefill 512 / 7400 tokens")
            time.sleep(0.1)
            progress("compiled")
        text = read_all(leader)  # before the terminal's other end closes
    os.close(leader)
    assert text.startswith("compiling ...\r\n")
    assert f"{CLEAR_LINE}  ... 2s" in text  # the step's seconds, redrawn in place
    assert "prefill 512 / 7400 tokens" in text
    assert text.endswith("compiled\r\n")  # the transient line was erased before the next step's line


def test_a_pipe_gets_only_the_step_lines() -> None:
    stream = io.StringIO()
    with ProgressLine(stream) as progress:
        progress("compiling ...")
        progress.status("prefill 512 / 7400 tokens")
        time.sleep(1.2)
        progress("compiled")
    assert stream.getvalue() == "compiling ...\ncompiled\n"
