"""planner: turns a ModelProfile and a ClusterSpec into a ranked set of Plans.

Pipeline position: second stage. Imports no TensorFlow (the CLI imports the
profiler and apply lazily). Public API: ``load_plan``, ``save_plan``, ``Plan``,
``ClusterSpec`` and the error types here; ``planner.presets.parse_cluster``,
``planner.search.search`` and ``planner.validate.validate_plan`` in their modules
(kept out of this file so that importing ``planner`` stays light).
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
