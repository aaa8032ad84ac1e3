"""``python -m kvbus.sinks {sink,lookup} ...``: the sinks stage's commands without the ``kvbus`` wrapper."""
import sys

from kvbus.sinks.cli import main

sys.exit(main())
