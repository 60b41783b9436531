"""reports.analysis_dir: the files of ``plan analyze --out DIR`` carry one run id and one
model fingerprint, and a truncated, missing, mixed or pre-run-id set is refused with a
typed error that names the wrong file and says what to re-run."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from tfplan.core import fileset
from tfplan.core.errors import IncompleteAnalysisError, PlannerError, SchemaError
from tfplan.planner.plan import load_plan
from tfplan.planner.search import search
from tfplan.reports.analysis_dir import (CANDIDATES, MANIFEST, PLAN, PLUGIN_ANALYSIS, PROFILE,
                                         read_analysis_dir, write_analysis_dir)
from tests.planner.test_search import chain_profile, make_cluster

FILES = (PLAN, PROFILE, CANDIDATES, PLUGIN_ANALYSIS, MANIFEST)


def analyze(out_dir, n_layers=8, global_batch=32):
    profile = chain_profile(n_layers=n_layers)
    result = search(profile, make_cluster(memory_bytes=10**12), global_batch)
    written = write_analysis_dir(out_dir, profile, result.chosen, result.candidates)
    return written, profile, result


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory):
    """Two analyses of one model (global batch 32 and 64) and one of another model."""
    root = tmp_path_factory.mktemp("runs")
    return {key: analyze(root / key, n_layers=n, global_batch=b)
            for key, n, b in (("a", 8, 32), ("b", 8, 64), ("other", 6, 32))}


@pytest.fixture()
def run_a(two_runs, tmp_path):
    shutil.copytree(os.path.dirname(two_runs["a"][0].plan_path), tmp_path / "a")
    return tmp_path / "a"


def test_every_file_carries_the_run_id_and_the_fingerprint(two_runs):
    written, profile, _ = two_runs["a"]
    out = os.path.dirname(written.plan_path)
    docs = {name: json.loads(open(os.path.join(out, name)).read()) for name in FILES}
    assert {d["run_id"] for d in docs.values()} == {written.run_id}
    assert docs[PLAN]["model"]["fingerprint"] == profile.fingerprint
    for name in (PROFILE, CANDIDATES, PLUGIN_ANALYSIS, MANIFEST):
        assert docs[name]["fingerprint"] == profile.fingerprint
    assert docs[MANIFEST]["global_batch"] == 32 and docs[MANIFEST]["model_name"] == "chain"
    assert sorted(os.listdir(out)) == sorted([PLAN, PROFILE, CANDIDATES, MANIFEST,
                                              "tensorboard"])
    a = read_analysis_dir(out)
    assert a.run_id == written.run_id and a.chosen.global_batch == 32


def test_a_second_run_replaces_the_whole_set(two_runs, run_a):
    b_dir = os.path.dirname(two_runs["b"][0].plan_path)
    written, _, _ = analyze(run_a, global_batch=64)
    a = read_analysis_dir(run_a)
    assert a.run_id == written.run_id and a.chosen.global_batch == 64
    assert read_analysis_dir(b_dir).chosen == a.chosen


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("keep", [0, 0.5, 0.99])
def test_a_truncated_file_is_named(run_a, name, keep):
    path = run_a / name
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(IncompleteAnalysisError, match="truncated or not valid JSON") as e:
        read_analysis_dir(run_a)
    assert e.value.path == str(path) and repr(str(path)) in str(e.value)
    assert "Re-run plan analyze" in str(e.value) and e.value.exit_code == 2


@pytest.mark.parametrize("name", (PLAN, PROFILE, CANDIDATES, PLUGIN_ANALYSIS))
def test_a_file_of_another_run_of_the_same_model_is_named(two_runs, run_a, name):
    b_dir = os.path.dirname(two_runs["b"][0].plan_path)
    shutil.copyfile(os.path.join(b_dir, name), run_a / name)
    with pytest.raises(IncompleteAnalysisError, match="another plan analyze run") as e:
        read_analysis_dir(run_a)
    assert e.value.path == str(run_a / name)
    assert "mixed set" in str(e.value) and "--global-batch 32" in str(e.value)


def test_a_file_of_another_model_is_named_even_with_the_right_run_id(two_runs, run_a):
    other = os.path.dirname(two_runs["other"][0].plan_path)
    doc = json.loads(open(os.path.join(other, PROFILE)).read())
    doc["run_id"] = two_runs["a"][0].run_id
    doc.pop("fingerprint")  # a hand-made mix: only the layers tell
    (run_a / PROFILE).write_text(json.dumps(doc))
    with pytest.raises(IncompleteAnalysisError, match="fingerprint") as e:
        read_analysis_dir(run_a)
    assert e.value.path == str(run_a / PROFILE)


def test_a_missing_file_is_named(run_a):
    (run_a / PROFILE).unlink()
    with pytest.raises(IncompleteAnalysisError, match="is missing") as e:
        read_analysis_dir(run_a)
    assert e.value.path == str(run_a / PROFILE)


def test_a_directory_written_before_run_ids_is_refused(run_a):
    # what plan analyze wrote until now: no manifest, no run ids
    (run_a / MANIFEST).unlink()
    with pytest.raises(IncompleteAnalysisError, match="older version of plan analyze") as e:
        read_analysis_dir(run_a)
    assert e.value.path == str(run_a / MANIFEST)
    assert f"--out {run_a}" in str(e.value)
    # apply.wrap and plan launch read its plan.json alone: complete by itself
    assert load_plan(run_a / PLAN).global_batch == 32


def test_a_directory_without_an_analysis_is_not_called_incomplete(tmp_path):
    with pytest.raises(PlannerError, match="plan analyze MODEL") as e:
        read_analysis_dir(tmp_path)
    assert not isinstance(e.value, IncompleteAnalysisError)


def test_a_malformed_document_of_the_right_run_is_named(run_a):
    doc = json.loads((run_a / CANDIDATES).read_text())
    doc["candidates"] = [{"schema_version": 1, "name": 3}]
    (run_a / CANDIDATES).write_text(json.dumps(doc))
    with pytest.raises(IncompleteAnalysisError) as e:
        read_analysis_dir(run_a)
    assert e.value.path == str(run_a / CANDIDATES)


def test_load_plan_names_a_truncated_file(run_a):
    path = run_a / PLAN
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(SchemaError, match="truncated or not valid JSON") as e:
        load_plan(path)
    assert str(path) in str(e.value) and "Re-run `plan analyze" in str(e.value)
    path.write_text('{"schema_version": 1}')
    with pytest.raises(SchemaError, match=f"Plan file '{path}': Plan.model is missing"):
        load_plan(path)


def test_readers_see_an_interrupted_commit_as_the_new_set(two_runs, run_a):
    """A commit stopped after the journal rename (what SIGKILL can leave): plan.json on
    disk is already new, profile.json still old; readers see the new set whole."""
    b_dir = os.path.dirname(two_runs["b"][0].plan_path)
    journal = run_a / fileset.JOURNAL
    shutil.copytree(b_dir, journal)
    (journal / fileset.ORDER_FILE).write_text(json.dumps(
        [PLAN, PROFILE, CANDIDATES, "tensorboard", MANIFEST]))
    os.replace(journal / PLAN, run_a / PLAN)
    assert read_analysis_dir(run_a).run_id == two_runs["b"][0].run_id
    assert load_plan(run_a / PLAN).global_batch == 64
    fileset.roll_forward(run_a)  # what the next writer does first
    assert read_analysis_dir(run_a).run_id == two_runs["b"][0].run_id
    assert not journal.exists()
