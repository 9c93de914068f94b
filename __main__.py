"""``python -m logitproc`` and the ``logitproc`` command: Ctrl-C while the command line loads exits quietly too."""

import sys


def run() -> int:
    try:
        from logitproc.serve.cli import main
    except KeyboardInterrupt:
        return 128 + 2
    return main()


if __name__ == "__main__":
    sys.exit(run())
