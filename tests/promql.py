"""Which metrics a PromQL expression reads, and which metrics the kvbus processes export: what the
rules and dashboard tests compare, so a renamed metric fails a test instead of silencing an alert."""
from __future__ import annotations

import re

KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan", "Inf", "NaN"}
"""PromQL words that are not metric names."""


def metric_names(expr: str) -> set[str]:
    """Metric (or recorded series) names ``expr`` selects: bare selectors and ``{__name__=~"a|b"}``
    alternatives; function names, keywords, label names and values, ranges are not names."""
    names = {n for m in re.finditer(r'__name__\s*=~?\s*"([^"]*)"', expr) for n in m.group(1).split("|")}
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)                       # string literals
    e = re.sub(r"\{[^}]*\}", " ", e)                                     # label matchers
    e = re.sub(r"\[[^\]]*\]", " ", e)                                    # range durations
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    for m in re.finditer(r"(?<![\w.$])[A-Za-z_:][A-Za-z0-9_:]*", e):
        if e[m.end():].lstrip().startswith("(") or m.group(0) in KEYWORDS:
            continue  # a function or aggregation, or a keyword
        names.add(m.group(0))
    return names


def exported_names() -> dict[str, set[str]]:
    """Sample names each kind of kvbus process serves, per role (``bridge``, ``worker``, ``sink``),
    from the registries the processes serve, as their probes app (:func:`kvbus.runtime.probes.probe_app`)
    completes them (counters ``_total``, histograms ``_bucket``/``_sum``/``_count``; a labelled family
    with no series yet counts too)."""
    from kvbus.producers.metrics import BridgeMetrics
    from kvbus.runtime.probes import Readiness, probe_app
    from kvbus.sinks.metrics import SinkMetrics
    from kvbus.streams.metrics import StreamsMetrics

    out = {}
    for role, registry in (("bridge", BridgeMetrics().registry), ("worker", StreamsMetrics().registry),
                           ("sink", SinkMetrics().registry)):
        probe_app(registry, Readiness())
        names: set[str] = set()
        for fam in registry.collect():
            names |= {s.name for s in fam.samples}
            if fam.type == "counter":
                names.add(fam.name + "_total")
            elif fam.type == "histogram":
                names |= {fam.name + s for s in ("_bucket", "_sum", "_count")}
            else:
                names.add(fam.name)
        out[role] = names
    return out
