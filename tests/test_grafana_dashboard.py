"""ops/grafana/kvbus.json is a dashboard Grafana can import: valid JSON, unique panel ids, every
panel placed on the grid with PromQL targets on the dashboard's datasource variable (the metric
names in its expressions are checked by tests/test_metric_names.py)."""
from __future__ import annotations

import json
from pathlib import Path

DASHBOARD = Path(__file__).resolve().parent.parent / "ops/grafana/kvbus.json"


def test_dashboard_is_importable() -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dash["panels"]
    assert len({p["id"] for p in panels}) == len(panels) >= 8
    for p in panels:
        assert p["type"] == "timeseries" and p["title"]
        assert set(p["gridPos"]) == {"x", "y", "w", "h"} and p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert p["targets"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs)
        assert all(t["expr"].strip() and t["datasource"] == p["datasource"] for t in p["targets"])
    # no two panels overlap on the grid
    cells = [(p["gridPos"]["x"] + dx, p["gridPos"]["y"] + dy) for p in panels
             for dx in range(p["gridPos"]["w"]) for dy in range(p["gridPos"]["h"])]
    assert len(cells) == len(set(cells))


def test_dashboard_expressions_are_valid_promql(tmp_path) -> None:
    """Each expression, Grafana's ``$__rate_interval`` taken as 5m, parses: promtool checks it as a
    recording rule."""
    import shutil
    import subprocess

    import yaml

    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"].replace("$__rate_interval", "5m") for p in dash["panels"] for t in p["targets"]]
    rules = {"groups": [{"name": "dashboard", "rules": [{"record": f"dashboard:expr{i}", "expr": e}
                                                         for i, e in enumerate(exprs)]}]}
    path = tmp_path / "dashboard_rules.yml"
    path.write_text(yaml.safe_dump(rules))
    exe = shutil.which("promtool")
    assert exe, "promtool is missing: ./dev setup installs Debian's prometheus package"
    out = subprocess.run([exe, "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(exprs)} rules found" in out.stdout
