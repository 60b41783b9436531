"""reports.report: `plan report DIR` reads back what `plan analyze --out DIR` wrote and
exports one self-contained HTML page."""
from __future__ import annotations

import pytest

from tfplan.core.errors import IncompleteAnalysisError, PlannerError
from tfplan.planner.search import search
from tfplan.reports.analysis_dir import write_analysis_dir
from tfplan.reports.report import html_report, load_analysis, summary_lines
from tests.planner.test_search import chain_profile, make_cluster


@pytest.fixture()
def analysis_dir(tmp_path):
    profile = chain_profile()
    result = search(profile, make_cluster(memory_bytes=10**12), 32)
    write_analysis_dir(tmp_path, profile, result.chosen, result.candidates)
    return tmp_path, result


def test_the_analysis_reads_back_as_written(analysis_dir):
    path, result = analysis_dir
    a = load_analysis(path)
    assert a.chosen == result.chosen
    assert a.candidates == result.candidates
    lines = summary_lines(a)
    assert lines[1].startswith(f"Chosen: {result.chosen.name}")
    assert any(line.startswith("Why: ") for line in lines)


def test_html_report_is_self_contained(analysis_dir):
    path, result = analysis_dir
    page = html_report(load_analysis(path))
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert result.chosen.name in page and "peak mem / device" in page
    assert page.count('src="data:image/png;base64,') == 3  # the three pictures, inline
    assert "<script" not in page and "http://" not in page and "https://" not in page
    for cand in result.candidates:
        assert cand.name in page


def test_a_directory_without_an_analysis_names_the_command(tmp_path):
    with pytest.raises(PlannerError, match="plan analyze MODEL"):
        load_analysis(tmp_path)


def test_an_analysis_without_its_candidates_is_refused(analysis_dir):
    # Until run ids, a directory without candidates.json (older runs) showed the chosen
    # plan alone; now every file of the set must be there, from one run (issue 13).
    path, result = analysis_dir
    (path / "candidates.json").unlink()
    with pytest.raises(IncompleteAnalysisError, match="candidates.json' is missing") as e:
        load_analysis(path)
    assert e.value.path == str(path / "candidates.json") and "Re-run plan analyze" in str(e.value)


def test_the_traffic_table_lists_each_devices_bytes_by_kind(analysis_dir):
    from tfplan.planner.traffic import KINDS
    from tfplan.reports.report import TRAFFIC_HEADER, traffic_rows
    _, result = analysis_dir
    plan = result.chosen
    rows = traffic_rows(plan)
    sent = {d: dict(k) for d, k in plan.predicted.sent_bytes_per_device}
    assert sum(int(r[1].replace(",", "")) for r in rows) == len(sent)
    totals = sorted({sum(k.values()) for k in sent.values()}, reverse=True)
    assert len(rows) >= len(totals)  # one row per distinct set of bytes, busiest first
    assert TRAFFIC_HEADER[2:-1] == KINDS
