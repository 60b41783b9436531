"""MILP scaffolding shared by the planner's ILPs: named variable families, labelled
constraint rows, one HiGHS solve, and its answer read the same way everywhere.

Pipeline position: below ``planner.pipeline_ilp``, ``planner.tp_ilp`` and
``planner.placement_ilp``, which write their formulations with ``Milp`` (house style 5:
named variable families and labelled constraint blocks, never pointer arithmetic over
flat arrays), solve them with ``Milp.solve_or_raise`` and read one-hot choices with
``pick_one``. It imports only scipy (HiGHS through ``scipy.optimize.milp``) and
``tfplan.core.errors``. Each caller still re-checks the decoded answer against its own
problem (scipy issue 24141: milp can report success for a point that breaks a
constraint).
"""
from __future__ import annotations

import contextlib
import ctypes
import math
import os
import sys
from typing import Callable, Hashable, Iterable, Mapping, TypeVar

from tfplan.core.errors import InfeasiblePlanError, SolverError

HIGHS = "HiGHS via scipy.optimize.milp"  # how solver strings name the solver
# HiGHS status codes (scipy.optimize.milp's OptimizeResult.status)
STATUS_OPTIMAL, STATUS_LIMIT, STATUS_INFEASIBLE = 0, 1, 2

K = TypeVar("K", bound=Hashable)


class NoSolutionInTime(SolverError):
    """HiGHS stopped at its time (or iteration) limit before finding any solution."""


class Milp:
    """A MILP written as named variable families and labelled constraint rows.

    ``family`` hands out one variable per key (a dict key -> column), ``minimise`` adds
    to the objective, ``constrain`` adds a labelled row lo <= expr <= hi, where an
    expression is a {column: coefficient} mapping (``lin`` sums terms into one).
    """

    def __init__(self) -> None:
        self.lower: list[float] = []
        self.upper: list[float] = []
        self.integer: list[int] = []
        self.cost: list[float] = []
        self.rows: list[tuple[str, dict[int, float], float, float]] = []

    def family(self, keys: Iterable, *, lower: float, upper: float,
               integer: bool) -> dict:
        index = {}
        for key in keys:
            index[key] = len(self.lower)
            self.lower.append(lower)
            self.upper.append(upper)
            self.integer.append(1 if integer else 0)
            self.cost.append(0.0)
        return index

    def minimise(self, expr: Mapping[int, float]) -> None:
        for var, coef in expr.items():
            self.cost[var] += coef

    def constrain(self, label: str, expr: Mapping[int, float], lo: float = -math.inf,
                  hi: float = math.inf) -> None:
        self.rows.append((label, dict(expr), lo, hi))

    def solve(self, time_limit_s: float):
        """HiGHS's raw answer (``scipy.optimize.OptimizeResult``), solver output on stderr."""
        import numpy as np
        from scipy.optimize import Bounds, LinearConstraint, milp
        from scipy.sparse import coo_array

        r, c, v = [], [], []
        for row, (_, expr, _, _) in enumerate(self.rows):
            for var, coef in expr.items():
                r.append(row), c.append(var), v.append(coef)
        shape = (len(self.rows), len(self.lower))
        constraints = []
        if self.rows:
            constraints.append(LinearConstraint(
                coo_array((v, (r, c)), shape=shape).tocsr(),
                np.array([row[2] for row in self.rows]), np.array([row[3] for row in self.rows])))
        with solver_chatter_to_stderr():  # every ILP: plan ... --json keeps stdout clean
            return milp(np.array(self.cost), integrality=np.array(self.integer),
                        bounds=Bounds(np.array(self.lower), np.array(self.upper)),
                        constraints=constraints,
                        options={"time_limit": max(time_limit_s, 0.01), "mip_rel_gap": 1e-7,
                                 "presolve": True})

    def solve_or_raise(self, time_limit_s: float, *, name: str, what: str,
                       infeasible: Callable[[], str], advice: str = ""):
        """``solve``, with the statuses that leave no answer turned into errors:
        infeasible -> InfeasiblePlanError(``infeasible()``, the caller's diagnosis, which
        may itself raise SolverError when the problem is not infeasible after all); no
        solution at the time limit -> NoSolutionInTime; anything else without a point ->
        SolverError. Both name the solver, ``what`` it was looking for and HiGHS's
        message, and say to raise the time limit (``advice`` appended)."""
        res = self.solve(time_limit_s)
        if res.status == STATUS_INFEASIBLE:
            raise InfeasiblePlanError(infeasible())
        if res.x is None:
            raise (NoSolutionInTime if res.status == STATUS_LIMIT else SolverError)(
                f"{name} found no {what} ({res.message}). Raise the time limit (it was "
                f"{time_limit_s:g} s){advice}.")
        return res


def pick_one(x, variables: Mapping[K, int], what: str) -> K:
    """The key whose 0/1 variable is set, among ``variables`` (key -> column) of a
    one-hot choice in the solution ``x``; SolverError "{what}: {values}." when any of
    them is fractional (beyond 1e-5). Ties go to the first key."""
    values = {k: float(x[var]) for k, var in variables.items()}
    if any(abs(v - round(v)) > 1e-5 for v in values.values()):
        raise SolverError(f"{what}: {values}.")
    return max(values, key=values.get)


def lin(*terms: Iterable[tuple[int, float]]) -> dict[int, float]:
    """Sum of (variable, coefficient) terms as one expression."""
    expr: dict[int, float] = {}
    for group in terms:
        for var, coef in group:
            expr[var] = expr.get(var, 0.0) + coef
    return expr


def size_text(nbytes: float) -> str:
    """A size as the solvers' infeasibility messages print it: GiB, MiB or bytes."""
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB" \
        if nbytes >= 2**20 else f"{nbytes:.0f} bytes"


@contextlib.contextmanager
def solver_chatter_to_stderr():
    """Send what C code prints to stdout while inside to stderr instead.

    HiGHS (scipy 1.x) prints some MIP diagnostics with printf even with its display
    off (e.g. "HighsMipSolverData::transformNewIntegerFeasibleSolution tmpSolver.run();"
    on this formulation); `plan ... --json` promises one JSON object on stdout and
    nothing else. File descriptor 1 points at stderr meanwhile; C's buffers are
    flushed before it is restored.
    """
    try:
        sys.stdout.flush()
        saved = os.dup(1)
    except (OSError, ValueError, AttributeError):  # no real stdout: nothing to protect
        yield
        return
    libc = None
    try:
        libc = ctypes.CDLL(None)
    except (OSError, TypeError):  # no C library by that name (not a POSIX system)
        pass
    try:
        os.dup2(2, 1)
        yield
    finally:
        if libc is not None:
            libc.fflush(None)
        os.dup2(saved, 1)
        os.close(saved)
