"""``python -m logitproc`` and the ``logitproc`` command: the process's settings, then the command line (Ctrl-C while
it loads exits quietly too).

The settings a process of the command gets from the start (importing ``logitproc`` changes nothing): TVM's later
import sees torch as absent (``torch_guard.py``: seconds saved at every start; a library user's process imports TVM
as TVM does), TVM's thread pool one thread per physical core (``cpu_threads.py``; a library user's process gets it
when it opens its first kernel library), the tokenizer's own thread pool off.
"""

import os
import sys


def run() -> int:
    # The tokenizer runs one text at a time (encode_batch of one, which lets other threads run meanwhile): its thread
    # pool would only warn after a fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from logitproc import cpu_threads, torch_guard

        torch_guard.install()  # before anything imports TVM
        cpu_threads.configure()  # before TVM's first parallel kernel starts its pool
        from logitproc.serve.cli import main
    except KeyboardInterrupt:
        return 128 + 2
    return main()


if __name__ == "__main__":
    sys.exit(run())
