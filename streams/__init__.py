"""kvbus streams stage."""

if __name__ != "kvbus.streams":  # streams/ is installed as kvbus.streams (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.streams, not {__name__}")
