"""``kvbus sink`` with extra librdkafka settings for its consumer, for benchmarks that restart sinks.

    python benchmarks/sink_with_conf.py --conf group.instance.id=sink-0 --conf session.timeout.ms=6000 -- sink --group G ...

Everything after ``--`` is a ``kvbus`` command line; each ``--conf KEY=VALUE`` is added to the
``consumer_conf`` every ``sinks.consumer.SinkConsumer`` of this process is built with (the CLI has no
option for it). ``benchmarks/faults.py`` uses it for static group membership (``group.instance.id``):
a sink killed with SIGKILL and started again under the same id gets its partitions back at once
instead of after the dead member's session timeout (librdkafka's default 45 s).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv: list[str]) -> int:
    if "--" not in argv:
        raise SystemExit("usage: sink_with_conf.py [--conf KEY=VALUE ...] -- <kvbus arguments>")
    cut = argv.index("--")
    p = argparse.ArgumentParser(prog="sink_with_conf.py")
    p.add_argument("--conf", action="append", default=[], metavar="KEY=VALUE")
    extra = dict(kv.split("=", 1) for kv in p.parse_args(argv[:cut]).conf)

    from sinks.consumer import SinkConsumer

    init = SinkConsumer.__init__

    def with_conf(self, *args, consumer_conf=None, **kw):  # type: ignore[no-untyped-def]
        init(self, *args, consumer_conf={**extra, **(consumer_conf or {})}, **kw)

    SinkConsumer.__init__ = with_conf  # type: ignore[method-assign]
    from kvbus.cli import main as kvbus_main

    return kvbus_main(argv[cut + 1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
