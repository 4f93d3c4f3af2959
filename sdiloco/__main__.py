"""`python -m sdiloco train ...`: the command line of `sdiloco.lab.cli`."""

import sys

from .lab.cli import main as main


if __name__ == "__main__":
    sys.exit(main())
