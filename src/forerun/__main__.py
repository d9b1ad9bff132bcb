"""``python -m forerun``: the command line."""

import sys

from forerun.cli import main

sys.exit(main())
