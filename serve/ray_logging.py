"""The ``logitproc`` log lines of a Ray Serve worker process (the ingress, an engine replica) written to its stderr.

The single-process server writes its log (INFO and above, the message alone) to stderr. In a Ray Serve replica
process nothing is set up for the ``logitproc`` loggers (Ray Serve configures its own ``ray.serve`` logger only), so
Python would drop their INFO lines and print WARNING ones through its last-resort handler; here they get the same
handler as in the single-process server. Ray streams a worker's stderr to the ``logitproc serve`` command's output
(a local instance) and to the worker's log file under the cluster's session directory.
"""

from __future__ import annotations

import logging
import sys


class _StderrHandler(logging.StreamHandler):
    """The handler ``log_to_stderr`` adds (its class tells that it was added)."""


def log_to_stderr() -> None:
    """Write the ``logitproc`` loggers' INFO-and-above records to stderr, the message alone, once per process."""
    logger = logging.getLogger("logitproc")
    if any(isinstance(handler, _StderrHandler) for handler in logger.handlers):
        return
    handler = _StderrHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False  # (a handler Ray or a library puts on the root logger would write it twice)
