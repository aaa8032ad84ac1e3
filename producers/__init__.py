"""kvbus producers stage."""

if __name__ != "kvbus.producers":  # producers/ is installed as kvbus.producers (pyproject.toml, package-dir)
    raise ImportError(f"import kvbus.producers, not {__name__}")
