"""ops/prometheus: the scrape config and rule files pass ``promtool check``, every alert passes its
``promtool test rules`` unit tests (ops/prometheus/tests/alerts_test.yml) with a case where it
fires and one where it stays quiet, and the scrape targets are the ports ``kvbus demo`` uses.
promtool is Debian's ``prometheus`` package (``./dev setup`` installs it)."""
from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvbus.demo_layout import metrics_endpoints
from kvbus.top.top_config import parse_endpoints

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
    assert len(alerts) == 10
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


def _query(port: int, promql: str) -> list[dict]:
    """Instant query against the test's Prometheus: its result vector (empty while it has none)."""
    import json
    import urllib.parse
    import urllib.request

    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return json.loads(r.read())["data"]["result"]
    except OSError:  # not listening yet
        return []


@pytest.mark.integration
def test_prometheus_scrapes_a_running_pipeline_and_records_its_rates(test_settings, tmp_path) -> None:
    """The real thing: Prometheus (Debian's) with ops/prometheus's scrape jobs, pointed at a pipeline's
    ports, scrapes every process and the recording rules get values from what they export, per
    replica where the rules join on it; no down alert fires."""
    import uuid

    from kvbus.children import free_port, free_port_block
    from tests.pipeline import Pipeline, eventually

    exe = shutil.which("prometheus")
    assert exe, "prometheus is missing: ./dev setup installs Debian's prometheus package"
    run = uuid.uuid4().hex[:8]
    ports = {"worker": free_port(), "sink": free_port(), "bridges": [free_port(), free_port()]}
    base = free_port_block(4)
    pipeline = Pipeline(test_settings, tmp_path)
    prom = None
    try:
        pipeline.start("sink", "sink", "--group", f"sink-{run}", "--prefix", f"prom{run}:",
                       "--metrics-port", str(ports["sink"]))
        pipeline.start("worker", "worker", "--app-id", f"streams-{run}", "--workdir", str(tmp_path),
                       "--metrics-port", str(ports["worker"]))
        for i, port in enumerate(ports["bridges"]):
            pipeline.start(f"bridge-{i}", "bridge", "--endpoint", f"tcp://127.0.0.1:{base + 2 * i}",
                           "--replay-endpoint", f"tcp://127.0.0.1:{base + 2 * i + 1}", "--replica", f"replica-{i}",
                           "--metrics-port", str(port))
        pipeline.start("fleet", "fleet", "--replicas", "2", "--base-port", str(base), "--rate", "20",
                       "--duration", "120")

        config = yaml.safe_load(CONFIG.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(OPS / f) for f in config["rule_files"]]
        targets = {"kvbus-worker": [f"127.0.0.1:{ports['worker']}"], "kvbus-sink": [f"127.0.0.1:{ports['sink']}"]}
        for job in config["scrape_configs"]:
            if job["job_name"] in targets:
                job["static_configs"] = [{"targets": targets[job["job_name"]]}]
            elif job["job_name"] == "kvbus-bridge":  # the same replica labels, this pipeline's ports
                for sc, port in zip(job["static_configs"], ports["bridges"] + [free_port()]):
                    sc["targets"] = [f"127.0.0.1:{port}"]
                job["static_configs"] = job["static_configs"][:2]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
        web = free_port()
        log = open(tmp_path / "prometheus.log", "wb")
        prom = subprocess.Popen([exe, f"--config.file={tmp_path / 'prometheus.yml'}",
                                 f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web}"],
                                stdout=log, stderr=subprocess.STDOUT)
        log.close()

        def recorded() -> dict | None:
            assert prom.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            got = {q: {tuple(sorted(r["metric"].items())): float(r["value"][1]) for r in _query(web, q)}
                   for q in ("kvbus:events_in:rate1m", "kvbus:events_consolidated:rate1m",
                             "kvbus:events_applied:rate1m", "kvbus:bridge_events_in:rate5m",
                             "kvbus:hop_lag:records", "kvbus:sink_apply_seconds:p99_5m", 'up{job=~"kvbus-.*"}')}
            flowing = all(v > 0 for q in ("kvbus:events_in:rate1m", "kvbus:events_consolidated:rate1m",
                                          "kvbus:events_applied:rate1m", "kvbus:bridge_events_in:rate5m")
                          for v in got[q].values()) and all(got[q] for q in got)
            replicas = {dict(k).get("replica") for k in got["kvbus:bridge_events_in:rate5m"]}
            ups = got['up{job=~"kvbus-.*"}']
            every_up = len(ups) == 4 and all(v == 1 for v in ups.values())
            hops = {dict(k)["hop"] for k in got["kvbus:hop_lag:records"]}
            ok = flowing and replicas == {"replica-0", "replica-1"} and every_up and hops == {"raw", "blocks"}
            return got if ok else None

        got = eventually(recorded, 90, pipeline, interval=1.0)
        assert {dict(k)["hop"] for k in got["kvbus:hop_lag:records"]} == {"raw", "blocks"}  # worker's and sink's gauges
        assert _query(web, 'ALERTS{alertname=~"KvbusSinkDown|KvbusWorkerDown|KvbusDeadLetters"}') == []
    finally:
        if prom is not None:
            prom.terminate()
            prom.wait(30)
        pipeline.stop()
