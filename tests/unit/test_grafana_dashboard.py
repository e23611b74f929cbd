"""The Grafana dashboard asks only for series the workers export, and shows every metric."""

from __future__ import annotations

import json
import re

from support import REPO

from elastic._worker.observe.events import EventLog
from elastic._worker.observe.metrics import METRICS, PREFIX, TrainingMetrics

DASHBOARD = REPO / "deploy" / "grafana" / "torchrevive-dashboard.json"
SERIES = re.compile(r"\b((?:torchrevive|process)_[a-z_]+)")


def exported_series() -> set[str]:
    """Every sample name a worker's /metrics carries once each kind of event was seen."""
    metrics = TrainingMetrics(rank=0, run_id="r", restarts=0, world_size=1, samples_per_step=1)
    log = EventLog(None, restart=0)
    log.subscribe(metrics.observe)
    log.emit("eval", step=0, world_size=1, val_loss=1.0)
    return {s.name for family in metrics.registry.collect() for s in family.samples}


def expressions(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    return exprs + [a["expr"] for a in dashboard["annotations"]["list"] if "expr" in a]


def test_every_query_names_an_exported_series_and_is_balanced() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    exported = exported_series()
    for expr in expressions(dashboard):
        for name in SERIES.findall(expr):
            assert name in exported, f"{name} in {expr!r} is not exported"
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr


def test_every_metric_has_a_panel() -> None:
    used = {name for expr in expressions(json.loads(DASHBOARD.read_text())) for name in SERIES.findall(expr)}
    for name, (kind, _) in METRICS.items():
        full = f"{PREFIX}_{name}"
        variants = {full, f"{full}_bucket", f"{full}_sum", f"{full}_count"}
        assert used & variants, f"{full} ({kind}) is on no panel"


def test_panels_use_the_datasource_variable_and_do_not_overlap() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource", "run_id", "rank"}
    cells = set()
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        g = panel["gridPos"]
        assert g["x"] + g["w"] <= 24, panel["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{panel['title']} overlaps another panel"
        cells |= mine
