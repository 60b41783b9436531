"""Typed errors for the whole pipeline (profiler -> planner -> apply -> reports, the CLI).

Every stage raises one of these for bad input or an impossible request; the CLI
maps them to exit codes in one place (``tfplan.cli``). Messages say what was
received, what was expected, and how to fix it.
"""
from __future__ import annotations


class PlannerError(Exception):
    """Base class: a problem the user can fix. Exit code 2 at the CLI."""

    exit_code = 2


class ModelLoadError(PlannerError):
    """The model file or ``module:function`` could not be loaded or built."""


class ClusterSpecError(PlannerError):
    """The cluster preset, ``cpu:N`` form or cluster file is unknown or malformed."""


class InfeasiblePlanError(PlannerError):
    """No strategy fits the devices; the message names the binding limit."""

    exit_code = 3


class SolverError(PlannerError):
    """The ILP solver failed or returned an answer that breaks the constraints."""

    exit_code = 4


class PlanMismatchError(PlannerError):
    """A plan file does not match the model, the devices or the batch it is used with."""


class WorkerLostError(PlannerError):
    """A worker of a multi-worker job died, hung or cannot be reached; the job cannot go on.
    ``tasks``: the workers named (TF_CONFIG indices; empty where TensorFlow names none).
    The fix is a restart of the whole job (``plan launch --restarts N``, or the scheduler's),
    which ``BackupAndRestore`` resumes from its last backup."""

    def __init__(self, message: str, tasks: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.tasks = tasks


class SchemaError(PlannerError):
    """A JSON document (profile, cluster, plan) is malformed or has the wrong schema_version."""


class OutputPathError(PlannerError):
    """An output location (``--out``, ``--html``, ``--logdir``) cannot be written; checked
    before any slow work. ``path`` is the location, ``reason`` the operating system's."""

    def __init__(self, message: str, path: str = "", reason: str = "") -> None:
        super().__init__(message)
        self.path = path
        self.reason = reason


class IncompleteAnalysisError(SchemaError):
    """An analysis directory (``plan analyze --out DIR``) holds a truncated file, a file of
    another run or model, or was written by a version without run ids. ``path`` names the
    file that is wrong."""

    def __init__(self, message: str, path: str = "") -> None:
        super().__init__(message)
        self.path = path
