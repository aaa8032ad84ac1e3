"""``python -m kvbus.streams worker -l info [--datadir DIR]``: the streams Faust app's own command line
(options from KVBUS_* / KVBUS_STREAMS_* variables; see kvbus.streams.options). Faust's web server stays
off unless KVBUS_STREAMS_WEB_PORT is set."""
from __future__ import annotations

import sys

from kvbus.schemas.settings import Settings
from kvbus.streams.agents import build
from kvbus.streams.options import StreamsOptions

if __name__ == "__main__":
    options = StreamsOptions.from_env()
    app = build(Settings.from_env(), options)
    argv = sys.argv[1:]
    if argv[:1] == ["worker"] and not any(a in ("--with-web", "--without-web") for a in argv):
        if options.web_port is None:
            sys.argv.append("--without-web")
        else:
            sys.argv += ["--web-port", str(options.web_port)]
    app.main()
