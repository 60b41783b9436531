"""The "Parallel plan" TensorBoard plugin: the plans in a logdir, side by side.

Pipeline position: installed with the package through TensorBoard's
``tensorboard_plugins`` entry point (pyproject.toml). ``reports.tensorboard``
writes, next to a run's summaries, ``plugins/parallel_plan/analysis.json`` (the
chosen plan, the ranked candidates, per-layer rows and the simulated pipeline
schedule); this plugin lists the runs that have one and serves them to its
dashboard (``reports/static/index.js``: plain JavaScript, bundled, no network).

Routes (under ``/data/plugin/parallel_plan``):

* ``/index.js`` -- the dashboard;
* ``/runs`` -- ``[{"run": name, "model": ..., "plan": ...}]``, one per run with an
  analysis;
* ``/analysis?run=NAME`` -- that run's analysis.json.

A run is only ever looked up among the runs this plugin found under the logdir, and
the file it reads must resolve inside the logdir: a ``run`` that is not one of them
(``../..``, an absolute path, a symlink out) gets 404 and nothing is read.
"""
from __future__ import annotations

import json
import os
from typing import Any

from werkzeug import wrappers

from tensorboard.plugins import base_plugin

PLUGIN_NAME = "parallel_plan"
ANALYSIS_FILE = "analysis.json"
STATIC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "static")


def analysis_path(run_dir: str) -> str:
    """Where ``reports.tensorboard`` writes a run's analysis for this plugin."""
    return os.path.join(run_dir, "plugins", PLUGIN_NAME, ANALYSIS_FILE)


def find_runs(logdir: str) -> dict[str, str]:
    """Run name (path relative to the logdir, "." for the logdir itself) -> its analysis
    file, for every run under ``logdir`` that has one (symlinks are not followed; the
    ``.tfplan-*`` directories of an analysis being written, ``core.fileset``, are skipped)."""
    runs = {}
    root = os.path.realpath(logdir)
    for here, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".tfplan-"))
        if os.path.basename(here) == PLUGIN_NAME and ANALYSIS_FILE in files:
            run_dir = os.path.dirname(os.path.dirname(here))
            runs[os.path.relpath(run_dir, root)] = os.path.join(here, ANALYSIS_FILE)
    return runs


def _json(data: Any, status: int = 200) -> wrappers.Response:
    return wrappers.Response(json.dumps(data), status=status, content_type="application/json")


class ParallelPlanPlugin(base_plugin.TBPlugin):
    """Serves the analyses ``plan analyze`` wrote under the logdir (module docstring)."""

    plugin_name = PLUGIN_NAME

    def __init__(self, context: base_plugin.TBContext) -> None:
        self._logdir = context.logdir or ""

    def is_active(self) -> bool:
        return bool(self._logdir) and bool(find_runs(self._logdir))

    def frontend_metadata(self) -> base_plugin.FrontendMetadata:
        return base_plugin.FrontendMetadata(es_module_path="/index.js",
                                            tab_name="Parallel plan")

    def get_plugin_apps(self) -> dict[str, Any]:
        return {"/index.js": self._serve_js, "/runs": self._serve_runs,
                "/analysis": self._serve_analysis}

    @wrappers.Request.application
    def _serve_js(self, request: wrappers.Request) -> wrappers.Response:
        with open(os.path.join(STATIC, "index.js"), encoding="utf-8") as f:
            return wrappers.Response(f.read(), content_type="application/javascript")

    @wrappers.Request.application
    def _serve_runs(self, request: wrappers.Request) -> wrappers.Response:
        out = []
        for run, path in sorted(find_runs(self._logdir).items()):
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
            out.append({"run": run, "model": doc["plan"]["model"]["name"],
                        "plan": doc["plan"]["name"], "cluster": doc["plan"]["cluster"]["name"]})
        return _json(out)

    @wrappers.Request.application
    def _serve_analysis(self, request: wrappers.Request) -> wrappers.Response:
        run = request.args.get("run", "")
        path = find_runs(self._logdir).get(run)  # only runs found under the logdir
        root = os.path.realpath(self._logdir)
        if path is None or not os.path.realpath(path).startswith(root + os.sep):
            return _json({"error": f"no run {run!r} with a parallel plan under the logdir"},
                         status=404)
        with open(path, encoding="utf-8") as f:
            return wrappers.Response(f.read(), content_type="application/json")
