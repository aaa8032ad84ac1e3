"""Every metric name that ``kvbus top``, the Prometheus rules (ops/prometheus/rules) and the Grafana
dashboard (ops/grafana/kvbus.json) read is one the kvbus processes export, or an external one listed
below with its source: a renamed metric fails here instead of leaving an empty column or an alert
that can never fire."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from kvbus.top.metrics import ROLES
from tests.promql import exported_names, metric_names

ROOT = Path(__file__).resolve().parent.parent
RULE_FILES = sorted((ROOT / "ops/prometheus/rules").glob("*.yml"))
DASHBOARD = ROOT / "ops/grafana/kvbus.json"

EXTERNAL = {
    "up": "Prometheus itself: 1 when the target's last scrape succeeded",
    "vllm:prompt_tokens_total":
        "vLLM's /metrics (the engine job): prefill tokens processed (vllm/v1/metrics/loggers.py)",
    "sglang:prompt_tokens_total": "SGLang's /metrics (the engine job): prefill tokens processed",
}
"""Names the rules read that no kvbus process exports, and who exports them."""


def _rules() -> list[dict]:
    return [r for f in RULE_FILES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]]


def _dashboard_exprs() -> list[str]:
    dash = json.loads(DASHBOARD.read_text())
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


def test_the_name_extractor_finds_selectors_only() -> None:
    expr = ('sum by (reason) (rate(kvbus_sink_dead_letters_total{reason!="x",job=~"a|b"}[5m])) '
            '> 0.01 * kvbus:consolidated:rate5m unless on (replica) '
            'rate({__name__=~"vllm:prompt_tokens_total|sglang:prompt_tokens_total"}[$__rate_interval]) or vector(0)')
    assert metric_names(expr) == {"kvbus_sink_dead_letters_total", "kvbus:consolidated:rate5m",
                                  "vllm:prompt_tokens_total", "sglang:prompt_tokens_total"}


def test_kvbus_top_reads_exported_names() -> None:
    exported = exported_names()
    for role, spec in ROLES.items():
        assert spec.sample_names() - exported[role] == set(), role


@pytest.mark.parametrize("source", ["rules", "dashboard"])
def test_rules_and_dashboard_read_exported_names(source: str) -> None:
    exported = set().union(*exported_names().values())
    recorded = {r["record"] for r in _rules() if "record" in r}
    exprs = [r["expr"] for r in _rules()] if source == "rules" else _dashboard_exprs()
    used = set().union(*(metric_names(e) for e in exprs))
    assert used, "no metric found in any expression"
    unknown = used - exported - recorded - set(EXTERNAL)
    assert unknown == set(), f"{source} read metrics nobody exports: {sorted(unknown)}"
    if source == "rules":  # the external list names only what the rules use
        assert set(EXTERNAL) <= used, sorted(set(EXTERNAL) - used)
        names = [r["record"] for r in _rules() if "record" in r]
        assert len(names) == len(set(names)), "a series recorded twice"
