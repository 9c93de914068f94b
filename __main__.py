"""``python -m logitproc``: the same as the ``logitproc`` command."""

import sys

from logitproc.serve.cli import main

sys.exit(main())
