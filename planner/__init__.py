"""tfplan.planner: turns a ModelProfile and a ClusterSpec into a ranked set of Plans.

Pipeline position: second stage, above the profiler (it reads ``ModelProfile``)
and ``tfplan.core`` (errors, cluster types, presets); below apply, the reports and
the CLI, which it never imports. Imports no TensorFlow. Public API: ``load_plan``,
``save_plan``, ``Plan``, ``ClusterSpec`` and the error types here (the last two
re-exported from ``tfplan.core``); ``tfplan.core.presets.parse_cluster``,
``tfplan.planner.search.search`` and ``tfplan.planner.validate.validate_plan`` in
their modules (kept out of this file so that importing the planner stays light).
"""
from __future__ import annotations

from tfplan.core.cluster import ClusterSpec, DeviceSpec, LinkSpec
from tfplan.core.errors import (ClusterSpecError, InfeasiblePlanError, ModelLoadError,
                            PlanMismatchError, PlannerError, SchemaError, SolverError)
from tfplan.planner.plan import Breakdown, Plan, Prediction, Stage, Strategy, load_plan, save_plan

__all__ = [
    "Breakdown", "ClusterSpec", "ClusterSpecError", "DeviceSpec", "InfeasiblePlanError",
    "LinkSpec", "ModelLoadError", "Plan", "PlanMismatchError", "PlannerError", "Prediction",
    "SchemaError", "SolverError", "Stage", "Strategy", "load_plan", "save_plan",
]
