"""``python -m kvbus`` = the ``kvbus`` command."""
import sys

from kvbus.cli import main

sys.exit(main())
