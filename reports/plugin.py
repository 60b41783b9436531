"""The "Parallel plan" TensorBoard plugin: the plans in a logdir, side by side.

Pipeline position: installed with the package through TensorBoard's
``tensorboard_plugins`` entry point (pyproject.toml). ``reports.tensorboard``
writes, next to a run's summaries, ``plugins/parallel_plan/analysis.json`` (the
chosen plan, the ranked candidates, per-layer rows and the simulated pipeline
schedule); this plugin lists the runs that have one and serves them to its
dashboard (``reports/static/index.js``: plain JavaScript, bundled, no network).

Routes (under ``/data/plugin/parallel_plan``):

* ``/index.js`` -- the dashboard;
* ``/runs`` -- ``{"runs": [{"run": name, "model": ..., "plan": ..., "cluster": ...}],
  "unreadable": [{"run": name, "error": why}]}``: the runs whose analysis reads, and
  the runs that have an analysis this plugin cannot read (not JSON, half-written, an
  older schema, a symlink out of the logdir), each with the reason, so that one bad
  file never hides the others;
  plus ``"training": [{"run": name, "plan": ..., "steps": n, "measured_step_time_s": ...,
  "predicted_step_time_s": ..., "measured_over_predicted": ...} or {"run", "error"}]``:
  the training runs ``apply.monitor.PlanMonitor`` wrote (``training.json``, read under
  the same real-path rule);
* ``/analysis?run=NAME`` -- that run's analysis.json; a run that is not one found
  under the logdir gets 404, an analysis that resolves outside the logdir 403, one that
  does not read 422, each with ``{"error": why}``.

A run is only ever looked up among the runs this plugin found under the logdir, and
the file it reads must resolve inside the logdir (every route checks the real path):
a ``run`` that is not one of them (``../..``, an absolute path) is refused and nothing
is read; an ``analysis.json`` that is a symlink out of the logdir is listed as
unreadable and never opened. Every response sets its content type and
``X-Content-Type-Options: nosniff``.
"""
from __future__ import annotations

import json
import os
from typing import Any

from werkzeug import wrappers

from tensorboard.plugins import base_plugin

from tfplan.core.errors import SchemaError
from tfplan.core.schema import check_version, field

PLUGIN_NAME = "parallel_plan"
ANALYSIS_FILE = "analysis.json"
TRAINING_FILE = "training.json"  # apply.monitor.PlanMonitor's summary of a training run
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")
OUTSIDE = ("analysis.json is a symlink that resolves outside the logdir; it is not read. "
           "Copy the file into the run instead of linking it.")


def analysis_path(run_dir: str) -> str:
    """Where ``reports.tensorboard`` writes a run's analysis for this plugin."""
    return os.path.join(run_dir, "plugins", PLUGIN_NAME, ANALYSIS_FILE)


def _inside(path: str, root: str) -> bool:
    real = os.path.realpath(path)
    return real == root or real.startswith(root.rstrip(os.sep) + os.sep)


def scan_runs(logdir: str) -> tuple[dict[str, str], dict[str, str]]:
    """``(runs, outside)``: run name (path relative to the logdir, "." for the logdir
    itself) -> the real path of its analysis file, for every run under ``logdir`` whose
    analysis resolves inside the logdir; and run name -> why it is refused, for those
    whose ``analysis.json`` is a symlink out of it. Symlinked directories are not
    followed; the ``.tfplan-*`` directories of an analysis being written
    (``core.fileset``) are skipped."""
    runs, outside = {}, {}
    root = os.path.realpath(logdir)
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".tfplan-"))
        if os.path.basename(here) == PLUGIN_NAME and ANALYSIS_FILE in files:
            run = os.path.relpath(os.path.dirname(os.path.dirname(here)), root)
            path = os.path.join(here, ANALYSIS_FILE)
            if _inside(path, root):
                runs[run] = os.path.realpath(path)
            else:
                outside[run] = OUTSIDE
    return runs, outside


def find_training_runs(logdir: str) -> list[dict[str, Any]]:
    """The training runs under ``logdir``: one entry per ``training.json`` that
    ``apply.monitor.PlanMonitor`` wrote and that resolves inside the logdir, with its
    measured and predicted step time, or the reason it does not read."""
    found = []
    root = os.path.realpath(logdir)
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".tfplan-"))
        if os.path.basename(here) != PLUGIN_NAME or TRAINING_FILE not in files:
            continue
        run = os.path.relpath(os.path.dirname(os.path.dirname(here)), root)
        path = os.path.join(here, TRAINING_FILE)
        if not _inside(path, root):
            found.append({"run": run, "error": OUTSIDE.replace(ANALYSIS_FILE, TRAINING_FILE)})
            continue
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            check_version(doc, TRAINING_FILE)
            entry = {"run": run, "plan": field(doc, "plan", TRAINING_FILE, str),
                     "steps": field(doc, "steps", TRAINING_FILE, int)}
            for key in ("measured_step_time_s", "predicted_step_time_s",
                        "measured_over_predicted"):
                value = doc.get(key)
                entry[key] = float(value) if isinstance(value, (int, float)) else None
        except (OSError, ValueError, SchemaError) as e:
            entry = {"run": run, "error": f"{TRAINING_FILE} does not read: {e}"}
        found.append(entry)
    return found


def find_runs(logdir: str) -> dict[str, str]:
    """Run name -> the real path of its analysis file, for the runs under ``logdir``
    whose analysis resolves inside it (``scan_runs``)."""
    return scan_runs(logdir)[0]


def read_analysis(path: str) -> tuple[bytes, dict[str, Any]]:
    """The bytes of the analysis at ``path`` and the document they hold, checked for
    what the dashboard reads; SchemaError, saying what is wrong and how to fix it, for a
    file that cannot be read, is not JSON (half-written, damaged) or has another schema."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise SchemaError(f"analysis.json cannot be read ({e.strerror or e}).") from e
    try:
        doc = json.loads(data.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise SchemaError(f"analysis.json is not UTF-8 text (byte {e.start}); it is damaged. "
                          "Run `plan analyze` again to rewrite it.") from e
    except json.JSONDecodeError as e:
        raise SchemaError(
            f"analysis.json is not valid JSON ({e.msg} at line {e.lineno}, column {e.colno} "
            f"of {len(data):,} bytes); it may be half-written or damaged. Run `plan analyze` "
            "again to rewrite it.") from e
    kind = "analysis.json"
    if not isinstance(doc, dict):
        raise SchemaError(f"{kind}: expected a JSON object, received {type(doc).__name__}. "
                          "Run `plan analyze` again to rewrite it.")
    plan = field(doc, "plan", kind, dict)
    check_version(plan, f"{kind}: plan")
    field(plan, "name", kind, str, where="plan")
    field(field(plan, "model", kind, dict, where="plan"), "name", kind, str, where="plan.model")
    field(field(plan, "cluster", kind, dict, where="plan"), "name", kind, str,
          where="plan.cluster")
    for key in ("strategy", "predicted"):
        field(plan, key, kind, dict, where="plan")
    field(plan, "stages", kind, list, where="plan")
    field(doc, "candidates", kind, list)
    field(doc, "layers", kind, list)
    field(field(doc, "schedule", kind, dict), "slots", kind, list, where="schedule")
    return data, doc


def _respond(body: str | bytes, content_type: str, status: int = 200) -> wrappers.Response:
    response = wrappers.Response(body, status=status, content_type=content_type)
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def _json(data: Any, status: int = 200) -> wrappers.Response:
    return _respond(json.dumps(data), "application/json; charset=utf-8", status)


class ParallelPlanPlugin(base_plugin.TBPlugin):
    """Serves the analyses ``plan analyze`` wrote under the logdir (module docstring)."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._logdir = context.logdir or ""
        # real path -> ((mtime_ns, size), run summary or why it does not read): /runs
        # re-reads a file only when it changed
        self._summaries: dict[str, tuple[tuple[int, int], Any]] = {}

    def is_active(self) -> bool:
        return bool(self._logdir) and (any(scan_runs(self._logdir)) or
                                       bool(find_training_runs(self._logdir)))

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js",
                                            tab_name="Parallel plan")

    def get_plugin_apps(self) -> dict[str, Any]:
        return {"/index.js": self._serve_js, "/runs": self._serve_runs,
                "/analysis": self._serve_analysis}

    @wrappers.Request.application
    def _serve_js(self, request: wrappers.Request) -> wrappers.Response:
        with open(os.path.join(STATIC, "index.js"), encoding="utf-8") as f:
            return _respond(f.read(), "text/javascript; charset=utf-8")

    def _summary(self, run: str, path: str) -> dict[str, str]:
        """``/runs``' entry for one run; SchemaError when its analysis does not read."""
        try:
            st = os.stat(path)
            stamp = (st.st_mtime_ns, st.st_size)
        except OSError:
            stamp = (-1, -1)
        cached = self._summaries.get(path)
        if cached is None or cached[0] != stamp:
            try:
                plan = read_analysis(path)[1]["plan"]
                value: Any = {"model": plan["model"]["name"], "plan": plan["name"],
                              "cluster": plan["cluster"]["name"]}
            except SchemaError as e:
                value = str(e)  # the message only: the exception would hold the file's bytes
            cached = self._summaries[path] = (stamp, value)
        if isinstance(cached[1], str):
            raise SchemaError(cached[1])
        return {"run": run, **cached[1]}

    @wrappers.Request.application
    def _serve_runs(self, request: wrappers.Request) -> wrappers.Response:
        runs, outside = scan_runs(self._logdir)
        listed, unreadable = [], [{"run": run, "error": why} for run, why in outside.items()]
        for run, path in sorted(runs.items()):
            try:
                listed.append(self._summary(run, path))
            except SchemaError as e:
                unreadable.append({"run": run, "error": str(e)})
        for path in set(self._summaries) - set(runs.values()):
            self._summaries.pop(path, None)
        return _json({"runs": listed, "unreadable": sorted(unreadable, key=lambda r: r["run"]),
                      "training": find_training_runs(self._logdir)})

    @wrappers.Request.application
    def _serve_analysis(self, request: wrappers.Request) -> wrappers.Response:
        run = request.args.get("run", "")
        runs, outside = scan_runs(self._logdir)  # only runs found under the logdir
        if run in outside:
            return _json({"run": run, "error": outside[run]}, status=403)
        path = runs.get(run)
        if path is None or not _inside(path, os.path.realpath(self._logdir)):
            return _json({"run": run,
                          "error": f"no run {run!r} with a parallel plan under the logdir"},
                         status=404)
        try:
            data, _ = read_analysis(path)
        except SchemaError as e:
            return _json({"run": run, "error": str(e)}, status=422)
        return _respond(data, "application/json; charset=utf-8")
