"""``python -m streams worker -l info [--datadir DIR]``: the streams Faust app's own command line
(options from KVBUS_* / KVBUS_STREAMS_* variables; see streams.options). Faust's web server stays
off unless KVBUS_STREAMS_WEB_PORT is set."""
from __future__ import annotations

import sys

import streams.agents  # noqa: F401  (declares topics, table, agents)
from streams.app import OPTIONS, app

if __name__ == "__main__":
    argv = sys.argv[1:]
    if argv[:1] == ["worker"] and not any(a in ("--with-web", "--without-web") for a in argv):
        if OPTIONS.web_port is None:
            sys.argv.append("--without-web")
        else:
            sys.argv += ["--web-port", str(OPTIONS.web_port)]
    app.main()
