"""``plan analyze --layout``: the device-layout what-if knob, end to end (real
subprocesses, the example MLP, a 2-worker cluster of 2 logical CPUs each)."""
from __future__ import annotations

import json

from tests.cli.test_cli import run_plan

FIX = ("analyze", "examples/mlp.py", "--cluster", "2xcpu:2", "--global-batch", "64",
       "--fix", "dp=2,pp=2")


def _workers(plan: dict) -> list[set[str]]:
    """The workers each data-parallel replica's stages sit on (tp = 1: one device per
    replica per stage)."""
    dp = plan["strategy"]["dp"]
    return [{stage["devices"][r].split("/device:")[0] for stage in plan["stages"]}
            for r in range(dp)]


def test_layout_tp_pp_dp_puts_each_replica_on_one_worker(tmp_path):
    r = run_plan(*FIX, "--layout", "tp-pp-dp", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "dp-outer" in r.stdout and "Layout: tp-pp-dp" in r.stdout  # table and note
    plan = json.loads((tmp_path / "plan.json").read_text())
    assert plan["strategy"]["layout"] == "tp-pp-dp" and "dp-outer" in plan["name"]
    assert _workers(plan) == [{"/job:worker/task:0"}, {"/job:worker/task:1"}]
    # stage s of replica r on worker r's CPU s
    assert [s["devices"] for s in plan["stages"]] == [
        [f"/job:worker/task:{w}/device:CPU:{s}" for w in range(2)] for s in range(2)]


def test_layout_tp_dp_pp_spreads_each_replica_over_both_workers(tmp_path):
    r = run_plan(*FIX, "--layout", "tp-dp-pp", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert plan["strategy"]["layout"] == "tp-dp-pp" and "dp-outer" not in plan["name"]
    assert _workers(plan) == [{"/job:worker/task:0", "/job:worker/task:1"}] * 2
    # stage s on worker s
    assert [s["devices"] for s in plan["stages"]] == [
        [f"/job:worker/task:{s}/device:CPU:{i}" for i in range(2)] for s in range(2)]


def test_unknown_layout_is_refused_with_the_choices():
    r = run_plan(*FIX, "--layout", "dp-tp-pp")
    assert r.returncode == 2
    assert "tp-dp-pp" in r.stderr and "tp-pp-dp" in r.stderr
