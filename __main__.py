"""``python -m logitproc`` and the ``logitproc`` command: Ctrl-C while the command line loads exits quietly too."""

import os
import sys


def run() -> int:
    # The tokenizer runs one text at a time (encode_batch of one, which lets other threads run meanwhile): its thread
    # pool would only warn after a fork.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        from logitproc.serve.cli import main
    except KeyboardInterrupt:
        return 128 + 2
    return main()


if __name__ == "__main__":
    sys.exit(run())
