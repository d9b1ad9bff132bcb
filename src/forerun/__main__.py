import sys

from forerun.cli import main

sys.exit(main())
