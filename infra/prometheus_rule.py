"""The Prometheus Operator's ``PrometheusRule`` of kvbus, built from the rule files in
``ops/prometheus/rules`` (the recording and alert rules a plain Prometheus loads, unit-tested with
``promtool``): the same groups, in file order, so the rules have one source.

:mod:`kvbus.infra.manifests` writes it to ``deploy/kubernetes/base/prometheus-rule.yaml``.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

API_VERSION = "monitoring.coreos.com/v1"
NAME = "kvbus"
LABELS = {"app.kubernetes.io/part-of": "kvbus"}


def rule_files(rules_dir: Path) -> list[Path]:
    """The rule files of ``rules_dir`` (``*.yml``), in name order (the order Prometheus' ``rule_files`` glob gives)."""
    return sorted(rules_dir.glob("*.yml"))


def rule_groups(rules_dir: Path) -> list[dict[str, Any]]:
    """Every rule group of the files in ``rules_dir``, file by file."""
    return [group for path in rule_files(rules_dir) for group in yaml.safe_load(path.read_text())["groups"]]


def prometheus_rule(rules_dir: Path) -> dict[str, Any]:
    """The ``PrometheusRule`` holding every group of ``rules_dir``."""
    return {"apiVersion": API_VERSION, "kind": "PrometheusRule", "metadata": {"name": NAME, "labels": dict(LABELS)},
            "spec": {"groups": rule_groups(rules_dir)}}
