"""Issue 17 end to end through the CLI: the example MoE GPT (examples/moe_gpt.py, a
medium size: 4 blocks, hidden 1024, 64 experts of width 4096, top-2, capacity 1.25),
profiled and planned for two nodes of 8 A100s, gets expert parallelism, and the plan's
reason says why: the experts' state and all-to-all cost against the best plan without
it."""
from __future__ import annotations

import json

import pytest

from tests.cli.helpers import run

SIZES = {"MOE_LAYERS": "4", "MOE_HIDDEN": "1024", "MOE_HEADS": "16", "MOE_EXPERTS": "64",
         "MOE_TOP_K": "2", "MOE_EXPERT_HIDDEN": "4096", "MOE_CAPACITY": "1.25",
         "MOE_VOCAB": "32000", "MOE_SEQ": "1024"}


@pytest.fixture
def sizes(monkeypatch):
    for k, v in SIZES.items():
        monkeypatch.setenv(k, v)


def test_the_example_moe_gets_expert_parallelism_on_two_nodes_and_says_why(sizes, tmp_path):
    code, out, err = run(["analyze", "examples/moe_gpt.py", "--cluster", "2x8xA100-80GB",
                          "--global-batch", "64", "--precision", "mixed_bfloat16",
                          "--out", str(tmp_path), "--json"])
    assert code == 0, err
    result = json.loads(out[out.index("{"):])
    plan = result["plan"]
    ep = plan["strategy"].get("ep", 1)
    assert ep > 1, plan["name"]
    assert plan["strategy"]["dp"] % ep == 0 and 64 % ep == 0
    reason = plan["reason"]
    assert f"Expert parallelism ep={ep}" in reason
    assert "all-to-alls" in reason and "without expert parallelism" in reason
    assert plan["predicted"]["all_to_all_s"] > 0
    # the profile it planned from counts the routed work: 2 of 64 experts per token
    moe = [l for l in json.loads((tmp_path / "profile.json").read_text())["layers"]
           if l.get("moe_experts")]
    assert [l["name"] for l in moe] == [f"moe_{i}" for i in range(4)]
    for layer in moe:
        assert layer["moe_top_k"] == 2 and layer["moe_experts"] == 64


def test_fix_ep_without_experts_is_refused(tmp_path):
    code, out, err = run(["analyze", "examples/mlp.py", "--cluster", "cpu:4",
                          "--global-batch", "8", "--fix", "dp=4,ep=2", "--out", str(tmp_path)])
    assert code != 0
    assert "mixture-of-experts" in err and "ep=2" in err
