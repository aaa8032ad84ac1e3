"""``python -m kvbus.streams worker -l info [--datadir DIR]``: the streams Faust app's own command line
(options from KVBUS_* / KVBUS_STREAMS_* variables; see kvbus.streams.options). Faust's web server stays
off unless KVBUS_STREAMS_WEB_PORT is set."""
from __future__ import annotations

import sys

from kvbus.runtime.env import SettingError
from kvbus.runtime.settings import Settings
from kvbus.streams.agents import build
from kvbus.streams.options import StreamsOptions

if __name__ == "__main__":
    try:
        options, settings = StreamsOptions.from_env(), Settings.from_env()
    except SettingError as e:  # one line, exit 2, as kvbus does
        print(f"python -m kvbus.streams: {e}", file=sys.stderr)
        sys.exit(2)
    app = build(settings, options)
    argv = sys.argv[1:]
    if argv[:1] == ["worker"] and not any(a in ("--with-web", "--without-web") for a in argv):
        if options.web_port is None:
            sys.argv.append("--without-web")
        else:
            sys.argv += ["--web-port", str(options.web_port)]
    app.main()
