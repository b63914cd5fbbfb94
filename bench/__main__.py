"""``python -m bench`` (from a checkout) and ``python -m mtp.bench``: the ``mtp-bench`` CLI."""

import sys

from .cli import main

if __name__ == "__main__":
    sys.exit(main())
