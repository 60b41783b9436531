"""apply.spmd: the SPMD engine. Every device runs its own part of the step and talks
through TensorFlow's collective ops in the plan's groups.

Pipeline position: under ``apply.wrap``, which hands it the plans ``wrap.spmd_refusal`` accepts.
The parts, in the order they run: ``run`` (the run description, derived once from the
plan), ``copies`` (each device's copy of the model, split layers swapped for their
rank's twin from ``rank_layers``, which call ``megatron``'s operators, BatchNormalization
for ``batch_norm``'s twin under dp; under pipeline parallelism each column copy's graph
cut by chunk in ``stages``, its weights on their chunks' devices) and ``model`` (``SpmdModel``: the steps, the weights
as the user's model's), whose gradients meet in ``reduction`` (all-reduce) or ``zero``
(ZeRO-1/2: reduce-scatter, sharded update, all-gather; ZeRO-3's layers gather their
weights from the shards in ``zero3``), and whose optimizer state reads
and writes as one device's in ``optimizer_state``. A pipeline plan's step runs each
column's slots in the schedule's order through ``pipeline``. Across workers each worker's
program runs its own devices' columns (``RunDescription.local``), and ``across`` sums the
metrics, gathers the outputs and syncs files over the workers.
"""
from __future__ import annotations

from typing import Any, Callable

from tfplan.apply.spmd.batch_norm import has_batch_norm
from tfplan.apply.spmd.copies import build_copies
from tfplan.apply.expert_parallel import check_expert_parallel
from tfplan.apply.spmd.model import SpmdModel
from tfplan.apply.spmd.run import RunDescription, describe
from tfplan.apply.spmd.stages import placement_segments
from tfplan.planner.plan import Plan
from tfplan.profiler.signature import profiled_layer_paths


def wrap_spmd(builder: Callable[[], Any], plan: Plan, template: Any,
              recomputed: tuple[str, ...] = (), name: str | None = None,
              logdir: str | None = None) -> SpmdModel:
    """The SPMD model of ``plan``: ``builder`` (the user's
    ``build_model``) builds each device's copy, every copy starting from the weights of
    ``template`` (the model built first, on the host), which also serves weight files.
    ``recomputed``: the top-level layers the plan recomputes (``apply.recompute``);
    ``logdir``: where ``fit`` writes predicted against measured step times
    (``apply.monitor``)."""
    if plan.strategy.ep > 1:  # a MixtureOfExperts to split, E divisible by ep
        check_expert_parallel(plan, template)
    run = describe(plan, recomputed, batch_norm=has_batch_norm(template),
                   segments=_segments(plan, template), task=_task(plan))
    return SpmdModel(build_copies(builder, run, template), template, plan,
                     name=name, logdir=logdir)


def _task(plan: Plan) -> int | None:
    """This process's worker (TF_CONFIG's index) for a plan across workers (one program
    per worker: it runs that worker's devices), None on one host."""
    from tfplan.apply.mode import plan_tasks
    from tfplan.apply.workers import read_tf_config

    return read_tf_config()[1] if len(plan_tasks(plan)) > 1 else None


def _segments(plan: Plan, template: Any) -> tuple[tuple[tuple[str, int], ...], tuple[str, ...]]:
    """A general placement's chunks on the template's graph (``describe``'s ``segments``)."""
    if plan.placement != "general":
        return (), ()
    device_of = plan.device_of_layer()
    paths = [(path, layer) for path, layer in profiled_layer_paths(template)
             if path in device_of]
    chunk_of, devices = placement_segments(
        template, {id(layer): device_of[path] for path, layer in paths}, plan.name)
    return tuple((path, chunk_of[id(layer)]) for path, layer in paths
                 if id(layer) in chunk_of), devices


__all__ = ["RunDescription", "SpmdModel", "describe", "wrap_spmd"]
