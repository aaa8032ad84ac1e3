"""ops/prometheus: the scrape config and rule files pass ``promtool check``, every alert passes its
``promtool test rules`` unit tests (ops/prometheus/tests/alerts_test.yml) with a case where it
fires and one where it stays quiet, and the scrape targets are the ports ``kvbus demo`` uses.
promtool is Debian's ``prometheus`` package (``./dev setup`` installs it)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from kvbus.demo import metrics_endpoints
from kvbus.top.config import parse_endpoints

ROOT = Path(__file__).resolve().parent.parent
OPS = ROOT / "ops/prometheus"
CONFIG = OPS / "prometheus.yml"
RULES = sorted((OPS / "rules").glob("*.yml"))
UNIT_TESTS = OPS / "tests/alerts_test.yml"


def promtool(*args: str) -> subprocess.CompletedProcess:
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: ./dev setup installs Debian's prometheus package"
    return subprocess.run([exe, *args], capture_output=True, text=True, timeout=120, cwd=ROOT)


def test_config_and_rules_pass_promtool_check() -> None:
    out = promtool("check", "config", str(CONFIG))  # checks the rule files it names too
    assert out.returncode == 0, out.stdout + out.stderr
    out = promtool("check", "rules", *map(str, RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    config = yaml.safe_load(CONFIG.read_text())
    assert sorted(config["rule_files"]) == sorted(str(p.relative_to(OPS)) for p in RULES)


def test_every_alert_passes_its_promtool_unit_tests() -> None:
    out = promtool("test", "rules", str(UNIT_TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def _alerts() -> list[str]:
    return [r["alert"] for f in RULES for g in yaml.safe_load(f.read_text())["groups"] for r in g["rules"]
            if "alert" in r]


def test_every_alert_has_a_firing_and_a_quiet_case() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())
    assert sorted(tests["rule_files"]) == sorted(f"../rules/{p.name}" for p in RULES)
    cases = [c for t in tests["tests"] for c in t.get("alert_rule_test", [])]
    alerts = _alerts()
    assert len(alerts) == 8
    for alert in alerts:
        mine = [c for c in cases if c["alertname"] == alert]
        assert any(c.get("exp_alerts") for c in mine), f"{alert}: no case where it fires"
        assert any(not c.get("exp_alerts") for c in mine), f"{alert}: no case where it stays quiet"
    assert {c["alertname"] for c in cases} <= set(alerts), "a test of an alert that does not exist"


def test_scrape_targets_are_the_demos_ports_and_jobs_the_rules_name() -> None:
    config = yaml.safe_load(CONFIG.read_text())
    jobs = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]] for j in config["scrape_configs"]}
    demo = metrics_endpoints(3)  # the demo's default fleet: 3 replicas, 1 worker each
    assert jobs["kvbus-bridge"] == list(parse_endpoints(demo["bridges"]))
    assert jobs["kvbus-worker"] == list(parse_endpoints(demo["workers"]))
    assert jobs["kvbus-sink"] == list(parse_endpoints(demo["sinks"]))
    bridges = next(j for j in config["scrape_configs"] if j["job_name"] == "kvbus-bridge")
    assert [sc["labels"]["replica"] for sc in bridges["static_configs"]] == ["replica-0", "replica-1", "replica-2"]
    named = {m for f in RULES for m in re.findall(r'job="([^"]+)"', f.read_text())}
    assert named and named <= set(jobs), sorted(named - set(jobs))
