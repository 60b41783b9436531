"""reports.report: `plan report DIR` reads back what `plan analyze --out DIR` wrote and
exports one self-contained HTML page."""
from __future__ import annotations

import json

import pytest

from tfplan.core.errors import PlannerError
from tfplan.planner.plan import save_plan
from tfplan.planner.search import search
from tfplan.reports.report import html_report, load_analysis, save_candidates, summary_lines
from tests.planner.test_search import chain_profile, make_cluster


@pytest.fixture()
def analysis_dir(tmp_path):
    profile = chain_profile()
    result = search(profile, make_cluster(memory_bytes=10**12), 32)
    save_plan(result.chosen, tmp_path / "plan.json")
    (tmp_path / "profile.json").write_text(json.dumps(profile.to_dict()))
    save_candidates(result.candidates, tmp_path)
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


def test_older_analyses_without_candidates_show_the_chosen_plan(analysis_dir):
    path, result = analysis_dir
    (path / "candidates.json").unlink()
    assert load_analysis(path).candidates == (result.chosen,)
