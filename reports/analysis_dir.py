"""The analysis directory ``plan analyze --out DIR`` writes, as one set: all new or all old.

Pipeline position: after the planner's search, the last thing ``plan analyze`` does
(``write_analysis_dir``), and the first thing ``plan report DIR`` does
(``read_analysis_dir``, through ``reports.report.load_analysis``).

What a directory holds, each file stamped with the run's id (a uuid per ``plan analyze``)
and the model fingerprint (``ModelProfile.fingerprint``, a hash of the layer names,
types and parameter counts, which ``Plan.model_fingerprint`` also carries):

* ``plan.json`` -- the chosen plan (``"run_id"`` beside the plan's fields;
  ``model.fingerprint``);
* ``profile.json`` -- the model profile (``"run_id"``, ``"fingerprint"``);
* ``candidates.json`` -- ``{"run_id", "fingerprint", "candidates": [plans]}``;
* ``tensorboard/`` -- the TensorBoard run; its ``plugins/parallel_plan/analysis.json``
  carries ``"run_id"`` and ``"fingerprint"``;
* ``manifest.json`` -- the run id, the fingerprint, the model, cluster and global batch,
  and the files above: moved into place last.

The set is committed through ``core.fileset``'s journal, so after any interrupt (a
SIGKILL included) the directory reads as the complete previous set or the complete new
one. ``read_analysis_dir`` trusts the manifest's run id and refuses, with
``IncompleteAnalysisError`` naming the file and the command to re-run, a file that is
missing, truncated, of another run or of another model; a directory without a manifest
(written before run ids existed, or by hand) is refused too. ``apply.wrap`` and
``plan launch`` read plan.json alone (``planner.load_plan``): it is complete by itself.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

from tfplan.core.atomic import os_reason, write_json
from tfplan.core.errors import (IncompleteAnalysisError, OutputPathError, PlannerError,
                               SchemaError)
from tfplan.core.fileset import commit, current_path, read_bytes, writing
from tfplan.planner.plan import Plan, save_plan
from tfplan.profiler.model_profile import ModelProfile

PLAN, PROFILE, CANDIDATES, TENSORBOARD, MANIFEST = (
    "plan.json", "profile.json", "candidates.json", "tensorboard", "manifest.json")
# analysis.json inside the TensorBoard run (reports.plugin.analysis_path, relative)
PLUGIN_ANALYSIS = "tensorboard/plugins/parallel_plan/analysis.json"
MANIFEST_KIND = "tfplan analysis"
# the commit order: the manifest, which names the run, last
COMMIT_ORDER = (PLAN, PROFILE, CANDIDATES, TENSORBOARD, MANIFEST)


@dataclass(frozen=True)
class WrittenAnalysis:
    run_id: str
    plan_path: str
    logdir: str


@dataclass(frozen=True)
class Analysis:
    """What ``plan report`` shows: one run's profile, chosen plan and ranked candidates."""

    profile: ModelProfile
    chosen: Plan
    candidates: tuple[Plan, ...]
    run_id: str = ""


def new_run_id() -> str:
    return uuid.uuid4().hex


def save_candidates(candidates: Sequence[Plan], out_dir: str | os.PathLike,
                    run_id: str | None = None, fingerprint: str | None = None) -> str:
    """Write the ranked candidates as ``out_dir/candidates.json`` (atomically); return the
    path."""
    path = os.path.join(os.fspath(out_dir), CANDIDATES)
    fingerprints = {c.model_fingerprint for c in candidates}
    write_json(path, {"run_id": run_id,
                      "fingerprint": fingerprint or (fingerprints.pop() if len(fingerprints)
                                                     == 1 else None),
                      "candidates": [c.to_dict() for c in candidates]}, indent=1)
    return path


def write_analysis_dir(out_dir: str | os.PathLike, profile: ModelProfile, chosen: Plan,
                       candidates: Sequence[Plan], trace_files: Sequence[str] = (),
                       run_id: str | None = None, model_source: str = "") -> WrittenAnalysis:
    """Write plan.json, profile.json, candidates.json, the TensorBoard run (with the XProf
    capture ``trace_files``, if any) and manifest.json under ``out_dir``, replacing the
    previous set all at once (module docstring). ``model_source``: the MODEL argument of
    ``plan analyze`` (for the re-run advice of a reader that refuses the set)."""
    from tfplan.reports.tensorboard import attach_capture, write_analysis

    out_dir = os.path.abspath(os.fspath(out_dir))
    run_id = run_id or new_run_id()
    fingerprint = profile.fingerprint
    try:
        with writing(out_dir, run_id) as staging:
            save_plan(chosen, os.path.join(staging, PLAN), run_id=run_id)
            write_json(os.path.join(staging, PROFILE), {**profile.to_dict(), "run_id": run_id})
            save_candidates(candidates, staging, run_id=run_id, fingerprint=fingerprint)
            logdir = write_analysis(os.path.join(staging, TENSORBOARD), profile, chosen,
                                    candidates, run_id=run_id)
            if trace_files:  # a measured run's XProf capture, in the same run (Profile tab)
                attach_capture(logdir, trace_files)
            write_json(os.path.join(staging, MANIFEST), {
                "kind": MANIFEST_KIND, "run_id": run_id, "fingerprint": fingerprint,
                "model_name": profile.model_name, "model_source": model_source,
                "cluster": chosen.cluster.name,
                "global_batch": chosen.global_batch,
                "written_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                    timespec="seconds"),
                "files": [PLAN, PROFILE, CANDIDATES, PLUGIN_ANALYSIS]})
            commit(out_dir, staging, COMMIT_ORDER)
    except OSError as e:  # a full disk, a directory made read-only meanwhile, ...
        raise OutputPathError(
            f"--out {out_dir!r}: writing the analysis failed: {os_reason(e)} "
            f"({getattr(e, 'filename', None) or out_dir}). The directory still holds a "
            "complete analysis, the previous one or this one (plan report DIR says which).",
            out_dir, os_reason(e)) from None
    return WrittenAnalysis(run_id, os.path.join(out_dir, PLAN),
                           os.path.join(out_dir, TENSORBOARD))


def read_analysis_dir(out_dir: str | os.PathLike, attempts: int = 3) -> Analysis:
    """The set ``write_analysis_dir`` wrote, checked to be one run of one model;
    IncompleteAnalysisError (or PlannerError for a directory with no analysis) if not.
    A set that changes while it is read (a writer committing) is read again."""
    out_dir = os.fspath(out_dir)
    for attempt in range(attempts):
        try:
            return _read_once(out_dir)
        except _RunChanged as e:
            if attempt == attempts - 1:
                raise e.error from None
            time.sleep(0.05)
    raise AssertionError("unreachable")


class _RunChanged(Exception):
    """A file's run id differs from the manifest's: a writer may be committing."""

    def __init__(self, error: IncompleteAnalysisError) -> None:
        super().__init__(str(error))
        self.error = error


def _read_once(out_dir: str) -> Analysis:
    manifest_path = os.path.join(out_dir, MANIFEST)
    try:
        manifest = _json(out_dir, MANIFEST, None)
    except FileNotFoundError:
        if not os.path.lexists(current_path(out_dir, PLAN)):
            raise PlannerError(
                f"{out_dir!r} holds no plan.json: it is not an analysis directory. Make one "
                f"with plan analyze MODEL --cluster C --global-batch B --out {out_dir}.") from None
        raise IncompleteAnalysisError(
            f"{manifest_path!r} is missing: {out_dir!r} was written by an older version of "
            "plan analyze (or by hand), so its plan.json, profile.json and candidates.json "
            "cannot be checked to belong to one run of one model. Re-run plan analyze MODEL "
            f"--cluster C --global-batch B --out {out_dir} (apply.wrap still reads its "
            "plan.json alone).", manifest_path) from None
    if not (isinstance(manifest, dict) and manifest.get("kind") == MANIFEST_KIND
            and isinstance(manifest.get("run_id"), str)
            and isinstance(manifest.get("fingerprint"), str)):
        raise IncompleteAnalysisError(
            f"{manifest_path!r} is not a plan analyze manifest (no kind {MANIFEST_KIND!r}, "
            f"run_id and fingerprint). {_rerun(out_dir, None)}", manifest_path)
    run_id, fingerprint = manifest["run_id"], manifest["fingerprint"]

    docs: dict[str, Any] = {}
    for name in (PLAN, PROFILE, CANDIDATES, PLUGIN_ANALYSIS):
        path = os.path.join(out_dir, name)
        try:
            doc = _json(out_dir, name, manifest)
        except FileNotFoundError:
            raise IncompleteAnalysisError(
                f"{path!r} is missing from the analysis of run {run_id}. "
                f"{_rerun(out_dir, manifest)}", path) from None
        theirs = doc.get("run_id") if isinstance(doc, dict) else None
        if theirs != run_id:
            raise _RunChanged(IncompleteAnalysisError(
                f"{path!r} belongs to another plan analyze run ({theirs or 'no run id'}) than "
                f"{manifest_path!r} (run {run_id}): the directory holds a mixed set of files. "
                f"{_rerun(out_dir, manifest)}", path))
        if doc.get("fingerprint", fingerprint) != fingerprint:
            raise IncompleteAnalysisError(
                f"{path!r} describes model fingerprint {doc.get('fingerprint')}, the manifest "
                f"model {manifest.get('model_name')!r} with fingerprint {fingerprint}. "
                f"{_rerun(out_dir, manifest)}", path)
        docs[name] = doc

    profile = _build(out_dir, PROFILE, docs, manifest, ModelProfile.from_dict)
    chosen = _build(out_dir, PLAN, docs, manifest, Plan.from_dict)
    candidates = _build(out_dir, CANDIDATES, docs, manifest, lambda d: tuple(
        Plan.from_dict(c) for c in _candidate_list(d)))
    docs_of = {PROFILE: (profile.fingerprint,), PLAN: (chosen.model_fingerprint,),
               CANDIDATES: tuple(c.model_fingerprint for c in candidates)}
    for name, fingerprints in docs_of.items():
        for fp in fingerprints:
            if fp != fingerprint:
                path = os.path.join(out_dir, name)
                raise IncompleteAnalysisError(
                    f"{path!r} describes a model with fingerprint {fp}; the manifest's model "
                    f"{manifest.get('model_name')!r} has fingerprint {fingerprint}. "
                    f"{_rerun(out_dir, manifest)}", path)
    return Analysis(profile, chosen, candidates, run_id)


def _json(out_dir: str, name: str, manifest: dict | None) -> Any:
    """``name`` of the directory's current set, parsed; FileNotFoundError if absent."""
    path = os.path.join(out_dir, name)
    try:
        raw = read_bytes(out_dir, name)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(path) from None
    except OSError as e:
        raise IncompleteAnalysisError(f"{path!r} cannot be read ({e.strerror or e}).",
                                      path) from None
    try:
        return json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise IncompleteAnalysisError(
            f"{path!r} is truncated or not valid JSON ({e}): the analysis was interrupted "
            f"while it was written, or the file was edited. {_rerun(out_dir, manifest)}",
            path) from None


def _build(out_dir: str, name: str, docs: dict, manifest: dict, make: Any) -> Any:
    """``make(doc)`` for file ``name``; a malformed document is IncompleteAnalysisError."""
    path = os.path.join(out_dir, name)
    try:
        return make(docs[name])
    except IncompleteAnalysisError:
        raise
    except (SchemaError, KeyError, TypeError, ValueError, AttributeError, IndexError,
            OverflowError) as e:
        # SchemaError from from_dict; the others from a hand-edited document of odd shape
        what = str(e) if isinstance(e, SchemaError) else f"malformed ({type(e).__name__}: {e})."
        raise IncompleteAnalysisError(f"{path!r}: {what} {_rerun(out_dir, manifest)}",
                                      path) from None


def _candidate_list(doc: Any) -> list:
    cands = doc.get("candidates") if isinstance(doc, dict) else None
    if not isinstance(cands, list):
        raise SchemaError("expected an object with a 'candidates' list of plans.")
    return cands


def _rerun(out_dir: str, manifest: dict | None) -> str:
    if manifest:
        source = manifest.get("model_source") or "MODEL"
        return (f"Re-run plan analyze {source} --cluster {manifest.get('cluster', 'C')} "
                f"--global-batch {manifest.get('global_batch', 'B')} --out {out_dir} "
                + ("" if source != "MODEL" else
                   f"(MODEL: the model file of {manifest.get('model_name', 'the model')!r}) ")
                + "with the options of that run, to write the whole set again.")
    return (f"Re-run plan analyze MODEL --cluster C --global-batch B --out {out_dir} to write "
            "the whole set again.")
