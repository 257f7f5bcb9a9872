"""``python -m equeue``: the same as the ``equeue`` command."""

import sys

from equeue.cli import main

sys.exit(main())
