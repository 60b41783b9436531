"""Training runs on the dashboard (issue 16, "Honest words"): apply.monitor.PlanMonitor
writes training.json beside its event files; the plugin's /runs lists it (under the
same real-path rule as analyses) and the dashboard shows measured / predicted."""
from __future__ import annotations

import json
import re

import keras
import numpy as np
import pytest

from tfplan.apply.monitor import TRAINING_FILE, PlanMonitor, training_summary
from tfplan.planner.search import search
from tfplan.reports.plugin import PLUGIN_NAME, find_training_runs
from tests.planner.test_search import chain_profile, make_cluster
from tests.reports.test_plugin import _client, _dump_dom, _serve


@pytest.fixture(scope="module")
def plan():
    return search(chain_profile(), make_cluster(memory_bytes=10**12), 8, fix={"dp": 1}).chosen


def test_the_monitor_writes_the_median_step_time_against_the_prediction(plan, tmp_path):
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
    model.compile(optimizer="sgd", loss="mse")
    monitor = PlanMonitor(plan, tmp_path, warmup_steps=1)
    model.fit(np.ones((40, 4), "float32"), np.zeros((40, 3), "float32"), batch_size=8,
              epochs=1, verbose=0, callbacks=[monitor])
    doc = json.loads((tmp_path / "train" / TRAINING_FILE).read_text())
    measured = float(np.median(monitor.step_times_s))
    assert doc["plan"] == plan.name and doc["steps"] == 4 and doc["schema_version"] == 1
    assert doc["measured_step_time_s"] == pytest.approx(measured)
    assert doc["predicted_step_time_s"] == pytest.approx(plan.predicted.step_time_s)
    assert doc["measured_over_predicted"] == pytest.approx(
        measured / plan.predicted.step_time_s)


def _write(root, run, doc):
    path = root / run / TRAINING_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc if isinstance(doc, str) else json.dumps(doc))
    return path


@pytest.fixture()
def logdir(plan, tmp_path_factory):
    root = tmp_path_factory.mktemp("training")
    _write(root, "fast/train", training_summary(plan, [plan.predicted.step_time_s * 1.5] * 3))
    _write(root, "half", "{")
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "training.json"
    elsewhere.write_text(json.dumps({**training_summary(plan, [1.0]), "plan": "SECRET"}))
    (root / "outside" / "plugins" / PLUGIN_NAME).mkdir(parents=True)
    (root / "outside" / TRAINING_FILE).symlink_to(elsewhere)
    return root


def test_runs_lists_training_runs_with_their_ratio(logdir, plan):
    body = json.loads(_client(logdir).get("/runs").data)
    assert body["runs"] == [] and body["unreadable"] == []
    training = {t["run"]: t for t in body["training"]}
    assert set(training) == {"fast/train", "half", "outside"}
    fast = training["fast/train"]
    assert fast["plan"] == plan.name and fast["steps"] == 3
    assert fast["measured_over_predicted"] == pytest.approx(1.5)
    assert "not valid" in training["half"]["error"] or "does not read" in training["half"]["error"]
    assert "outside the logdir" in training["outside"]["error"]
    assert "SECRET" not in json.dumps(body)
    assert find_training_runs(str(logdir)) == body["training"]


def test_the_dashboard_lists_training_runs(logdir, tmp_path):
    server = _serve(logdir)
    base = next(server)
    try:
        dom = _dump_dom(base + f"/data/plugin_entry.html?name={PLUGIN_NAME}", tmp_path)
    finally:
        server.close()
    assert "Training runs: measured against predicted" in dom
    assert re.search(r'class="training-ratio">1\.50x<', dom)
    assert re.search(r'class="training-error"><td>half</td>', dom)
    assert "SECRET" not in dom
