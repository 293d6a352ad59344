"""The Prometheus alert rules and the Grafana dashboard in deploy/observability/ are valid: the rules
load in Prometheus' own checker and fire (or not) on the series their unit tests give them
(``promtool test rules``), every dashboard query parses as PromQL, and the dashboard has the shape
Grafana imports. That they read only metrics the server exports: tests/e2e/test_observability.py.

promtool comes from Debian's ``prometheus`` package (``make test`` installs it, as it installs
Chromium for the playground's test)."""

import json
import shutil
import subprocess
from pathlib import Path

import jsonschema
import yaml

OBSERVABILITY = Path(__file__).resolve().parents[2] / "deploy" / "observability"
PROMTOOL = shutil.which("promtool")
if PROMTOOL is None:
    raise RuntimeError("promtool is missing: `make test` installs it (apt-get install prometheus)")

# What Grafana needs to import a dashboard and draw its panels (the fields this one uses).
DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["title", "uid", "schemaVersion", "panels", "templating"],
    "properties": {
        "uid": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,40}$"},
        "schemaVersion": {"type": "integer", "minimum": 30},
        "templating": {"type": "object", "required": ["list"]},
        "panels": {"type": "array", "minItems": 1, "items": {
            "type": "object",
            "required": ["id", "type", "title", "gridPos"],
            "properties": {
                "id": {"type": "integer"},
                "type": {"enum": ["row", "timeseries", "stat"]},
                "gridPos": {"type": "object", "required": ["h", "w", "x", "y"], "properties": {
                    "w": {"type": "integer", "minimum": 1, "maximum": 24},
                    "x": {"type": "integer", "minimum": 0, "maximum": 23}}},
                "targets": {"type": "array", "items": {"type": "object", "required": ["refId", "expr"],
                                                       "properties": {"expr": {"type": "string", "minLength": 1}}}},
            },
        }},
    },
}


def promtool(*args, cwd=OBSERVABILITY) -> subprocess.CompletedProcess:
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def dashboard() -> dict:
    return json.loads((OBSERVABILITY / "grafana-dashboard.json").read_text())


def test_the_alert_rules_load_and_fire_on_the_series_they_should():
    checked = promtool("check", "rules", "alerts.yml")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", "alerts.test.yml")
    assert tested.returncode == 0, tested.stdout + tested.stderr
    alerts = {rule["alert"] for group in yaml.safe_load((OBSERVABILITY / "alerts.yml").read_text())["groups"]
              for rule in group["rules"]}
    assert {"HotloraRecompiled", "HotloraEngineRebuilt", "HotloraQueueSaturated", "HotloraColdFetchSlow"} <= alerts


def test_the_promql_check_catches_a_broken_expression(tmp_path):
    """The check above is not vacuous: promtool refuses a rule file with an expression that does not parse."""
    (tmp_path / "broken.yml").write_text(yaml.safe_dump(
        {"groups": [{"name": "x", "rules": [{"record": "x:y", "expr": "sum(rate(hotlora_requests_total[5m])"}]}]}))
    assert promtool("check", "rules", "broken.yml", cwd=tmp_path).returncode != 0


def test_every_dashboard_query_is_valid_promql(tmp_path):
    """Each panel's query as a recording rule (Grafana's variables given values) for promtool to parse."""
    rules = []
    for panel in dashboard()["panels"]:
        for target in panel.get("targets", []):
            expr = target["expr"].replace("$__rate_interval", "5m").replace("$instance", ".*")
            assert "$" not in expr, expr  # no variable the substitution above does not know
            rules.append({"record": f"dashboard:panel_{panel['id']}_{target['refId'].lower()}", "expr": expr})
    assert len(rules) >= 15
    (tmp_path / "dashboard.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = promtool("check", "rules", "dashboard.yml", cwd=tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_the_dashboard_has_the_shape_grafana_imports():
    board = dashboard()
    jsonschema.validate(board, DASHBOARD_SCHEMA)
    ids = [panel["id"] for panel in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        if panel["type"] != "row":
            assert panel["targets"] and panel["datasource"]["uid"] == "${datasource}", panel["title"]
            refs = [t["refId"] for t in panel["targets"]]
            assert len(refs) == len(set(refs)), panel["title"]
    assert {v["name"] for v in board["templating"]["list"]} == {"datasource", "instance"}

