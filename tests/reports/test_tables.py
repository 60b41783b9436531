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
