"""`python -m sim`: see sim/cli.py."""

import sys

from sim.cli import main

sys.exit(main())
