"""`plan audit MODEL --plan PLAN_JSON`: one step of the wrapped model, each device's bytes
by kind beside the plan's priced bytes, a verdict and its exit code; bad input names the
fix."""
from __future__ import annotations

import json

from tfplan.cli import main
from tfplan.planner.plan import save_plan
from tests.apply import helpers
from tests.apply.test_acceptance import SPLITS

MLP = "tests/apply/tiny_mlp.py"


def _plan_file(tmp_path):
    module = helpers.load_model_file("tiny_mlp")
    plan = helpers.tp_plan(module.build_model(), [helpers.cpus(0, 1, 2, 3)], SPLITS["tiny_mlp"],
                           dp=2, global_batch=16, name="audit dp2 tp2")
    path = tmp_path / "plan.json"
    save_plan(plan, str(path))
    return str(path)


def test_audit_prints_each_devices_bytes_beside_the_plans(tmp_path, capsys):
    assert main(["audit", MLP, "--plan", _plan_file(tmp_path), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["engine"] == "SpmdModel" and doc["within_tolerance"]
    assert len(doc["devices"]) == 4
    for row in doc["devices"].values():
        assert {"tp", "dp"} <= set(row["measured"])
        assert abs(row["ratio"] - 1) <= 0.10 and row["priced_bytes"] > 0
    assert doc["busiest_over_mean"] <= 1.25


def test_audit_of_a_model_file_without_sample_batch_names_the_fix(tmp_path, capsys):
    model = tmp_path / "bare.py"
    model.write_text("import keras\n\ndef build_model():\n"
                     "    i = keras.Input((12,))\n"
                     "    return keras.Model(i, keras.layers.Dense(3)(i))\n")
    code = main(["audit", str(model), "--plan", _plan_file(tmp_path)])
    assert code != 0
    assert "sample_batch" in capsys.readouterr().err
