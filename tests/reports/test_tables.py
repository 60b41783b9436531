"""reports.tables: the ranked-candidates table shows every part of the step time."""
from __future__ import annotations

from tfplan.core.presets import parse_cluster
from tfplan.planner.search import search
from tfplan.reports.tables import CANDIDATE_HEADER, candidate_rows
from tests.planner.gpt_profile import gpt_profile


def test_candidate_rows_show_every_breakdown_part_under_its_header():
    profile = gpt_profile(4, 512, 8, vocab=4096, seq=256)
    result = search(profile, parse_cluster("8xA100-80GB"), 16,
                    fix={"pp": 2, "microbatch_size": 1, "recompute": "full"})
    rows = candidate_rows(result.candidates, result.chosen)
    assert all(len(r) == len(CANDIDATE_HEADER) for r in rows)
    row = dict(zip(CANDIDATE_HEADER, rows[0]))
    assert row[""] == "*" and row["pp"] == "2"
    b = result.chosen.predicted.breakdown
    assert b.recompute_s > 0 and row["recompute"] != "0 s"
    for part in ("compute", "comm", "bubble", "recompute", "optimizer", "overhead"):
        assert part in CANDIDATE_HEADER


def test_candidate_rows_are_ranked_with_the_chosen_one_marked_where_it_ranks():
    from tests.planner.test_search import chain_profile, make_cluster
    from tfplan.reports.tables import SHORT_HEADER, mfu
    result = search(chain_profile(n_layers=4), make_cluster(), 8)  # chosen for simplicity
    assert result.candidates[0] is result.chosen and "simplicity" in result.chosen.reason
    rows = [dict(zip(SHORT_HEADER, r))
            for r in candidate_rows(result.candidates, result.chosen, SHORT_HEADER)]
    assert [r["#"] for r in rows] == [str(i) for i in range(1, len(rows) + 1)]
    marked = [i for i, r in enumerate(rows) if r[""] == "*"]
    assert len(marked) == 1 and marked[0] > 0  # the faster plan ranks above it
    assert rows[marked[0]]["strategy"] == result.chosen.name
    peak = dict(result.chosen.cluster.device.peak_flops_per_s)["float32"]
    assert mfu(result.chosen) == result.chosen.predicted.model_tflops_per_device * 1e12 / peak
