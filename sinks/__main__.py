"""``python -m sinks {sink,lookup} ...``: the sinks stage's commands without the ``kvbus`` wrapper."""
import sys

from sinks.cli import main

sys.exit(main())
