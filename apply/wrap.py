"""``wrap(model, plan)``: the one line in a training script that applies a plan.

Pipeline position: after ``planner.load_plan`` (a plan.json from ``plan
analyze``) and the user's own model; returns a ``keras.Model`` that trains
with the plan through the usual ``compile``/``fit``/``evaluate``/``predict``/
``save_weights``/``load_weights``. Steps:

1. the plan is checked against the model (``Plan.check_model`` on
   ``profiler.signature.model_signature``: PlanMismatchError naming the first
   differing layer), against itself (stages cover each layer once; ``dp``/``pp``
   agree with the stages), and against this process's devices
   (``apply.ensure_devices``);
2. the plan's shape picks the mode (new modes such as tensor parallel, hybrid
   or multi-worker plug in here):

   * one stage, one device: single device (``apply.pipeline``, one stage);
   * one stage, ``dp`` devices: data parallel (``apply.data_parallel``);
   * ``pp`` stages of one device each: pipeline (``apply.pipeline``);
   * a general placement (``plan.placement == "general"``: each stage is one
     device's layers, in any pattern, one micro-batch): placement
     (``apply.pipeline`` too; independent branches run at the same time);
   * ``tp > 1`` (any ``dp`` on one host, any ``pp``), dp x pp, or dp > 1 with
     ZeRO-1: tensor parallel (``apply.tensor_parallel``: ``plan.tp_splits``' layers
     sharded over their stage's tp devices, one copy per data-parallel replica;
     ZeRO-1 keeps each weight's optimizer state on one replica, ``apply.zero``);
   * one stage on one device of each of several workers (``/job:worker/task:w/...``,
     a ``Wxcpu:N`` or multi-node cluster): multi-worker data parallel
     (``apply.multi_worker``, MultiWorkerMirroredStrategy from TF_CONFIG; start
     the workers with ``plan launch --workers W``);
   * anything more on several workers, each data-parallel replica inside one
     worker, or ZeRO-1 across workers: a multi-worker hybrid
     (``apply.multi_worker_hybrid``: the strategy between the workers, the placed
     modes within each; ZeRO-1 over the job, ``apply.zero_workers``);
   * a replica spanning workers (pipeline stages or tp ranks on several workers),
     or a general placement across workers: worker 0 drives every worker's devices
     (``apply.remote``) and the mode is the one-host mode above for the plan's shape;

3. the model is re-created with the plan's placement and the user's current
   weights; if the user's model was compiled, the wrapped one is compiled from
   its compile config (a fresh optimizer; optimizer state is not carried over).
   Compiling the wrapped model again later works as usual;
4. a plan's ``recompute`` is applied in every mode (``apply.recompute``: the
   recomputed layers run under ``tf.recompute_grad``, in each replica under data
   parallelism); layers with state keep their activations (a warning says so).

Every training batch must split into ``dp * num_microbatches`` equal parts
(checked before training starts; ``apply.planned_model``).
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Any

from tfplan.apply.cloning import to_functional
from tfplan.apply.devices import ensure_devices
from tfplan.apply.placement import variable_devices
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan, load_plan, save_plan
from tfplan.planner.validate import validate_plan
from tfplan.profiler.signature import model_signature


def wrap(model: Any, plan: Plan | str | os.PathLike, *, logdir: str | os.PathLike | None = None
         ) -> Any:
    """Return a keras.Model that trains ``model`` as ``plan`` says (see the module docstring).

    ``plan``: a Plan or the path of a plan.json. ``logdir``: if given, the plan and
    where each model variable was placed are written there (plan.json,
    placement.json); optimizer slots exist only after ``compile()``, see
    ``apply.variable_devices(model)`` for them.
    """
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    view = to_functional(model)
    signature = model_signature(view)
    plan.check_model(signature)
    mode = plan_mode(plan)
    validate_plan(plan, signature)  # stages cover the layers once, in order; devices once
    ensure_devices(plan)
    m = plan.strategy.num_microbatches
    from tfplan.apply.recompute import recomputed_layers

    recompute, stateful = recomputed_layers(plan, view)
    if stateful:
        warnings.warn(
            f"Plan {plan.name!r} recomputes ({plan.strategy.recompute}) layers "
            f"{list(stateful)}, which hold state a second forward pass would change "
            "(moving statistics, random seeds); they keep their activations instead "
            "(apply.recompute).", stacklevel=2)
    if mode == "multi_worker_hybrid":
        from tfplan.apply.multi_worker_hybrid import wrap_multi_worker_hybrid

        wrapped = wrap_multi_worker_hybrid(view, plan, recompute_layers=recompute)
    elif mode == "multi_worker":
        from tfplan.apply.multi_worker import wrap_multi_worker

        wrapped = wrap_multi_worker(view, plan_name=plan.name, dp=plan.strategy.dp,
                                    num_microbatches=m, recompute_layers=recompute)
    elif mode == "data_parallel":
        from tfplan.apply.data_parallel import wrap_data_parallel

        wrapped = wrap_data_parallel(view, plan.stages[0].devices, plan_name=plan.name,
                                     num_microbatches=m, recompute_layers=recompute)
    elif mode == "tensor_parallel":
        from tfplan.apply.tensor_parallel import wrap_tensor_parallel

        wrapped = wrap_tensor_parallel(view, plan, top_level_devices(plan),
                                       recompute_layers=recompute)
    else:  # single device, pipeline, general placement: placed layers
        from tfplan.apply.pipeline import wrap_placed
        from tfplan.apply.schedule import schedule_of

        wrapped = wrap_placed(view, top_level_devices(plan), plan_name=plan.name,
                              num_microbatches=m, recompute_layers=recompute,
                              schedule=schedule_of(plan))  # 1F1B/interleaved order
    wrapped.plan = plan
    if getattr(model, "compiled", False):
        _compile_like(model, wrapped)
    if logdir is not None:
        _write_logdir(plan, wrapped, logdir)
        # fit() then writes predicted vs measured step times there (reports.training)
        wrapped.plan_logdir = os.fspath(logdir)
    return wrapped


def plan_mode(plan: Plan) -> str:
    """``single_device``, ``data_parallel``, ``multi_worker``, ``multi_worker_hybrid``,
    ``pipeline``, ``placement`` (a general placement) or ``tensor_parallel``; PlannerError
    for plans apply cannot run."""
    from tfplan.apply.multi_worker import spans_workers

    from tfplan.apply.remote import needs_remote

    s = plan.strategy
    replicas = {len(stage.devices) for stage in plan.stages}
    if not plan.stages or replicas == {0}:
        raise PlanMismatchError(f"Plan {plan.name!r} has no stages or no devices. "
                                "Regenerate the plan.")
    if len(replicas) != 1:
        raise PlanMismatchError(
            f"Plan {plan.name!r} has stages with different numbers of replicas "
            f"({sorted(replicas)}); every stage needs one device per data-parallel replica. "
            "Regenerate the plan.")
    # an interleaved pipeline has virtual_stages model chunks per device
    # (a stage lists dp * tp devices, tensor rank innermost: planner.plan)
    dp, pp = replicas.pop() // max(1, s.tp), len(plan.stages) // max(1, s.virtual_stages)
    if (s.dp, s.pp) != (dp, pp):
        raise PlanMismatchError(
            f"Plan {plan.name!r} says dp={s.dp}, pp={s.pp}, but its stages describe "
            f"dp={dp} (devices per stage / tp) and pp={pp} (stages). Regenerate the plan.")
    from tfplan.apply.multi_worker import plan_tasks

    tasks = plan_tasks(plan)
    if tasks and len(tasks) < plan.cluster.num_nodes:
        raise PlannerError(
            f"Plan {plan.name!r} uses {len(tasks)} of its cluster's {plan.cluster.num_nodes} "
            "workers; apply runs a multi-worker job on every worker, so the plan must use "
            "them all. Re-plan for fewer workers (plan launch --workers "
            f"{len(tasks)}) or with a strategy over every worker (e.g. --fix "
            f"dp={plan.cluster.num_nodes}).")
    if spans_workers(plan) and not needs_remote(plan):  # one program per worker
        from tfplan.apply.multi_worker_hybrid import is_hybrid, plan_replica_tasks

        if is_hybrid(plan) or s.optimizer_sharding:  # pp / tp / local replicas / ZeRO-1
            plan_replica_tasks(plan)  # PlannerError when a replica spans workers
            return "multi_worker_hybrid"
        return "multi_worker"
    # below: one process drives every device (one host, or worker 0 of a cluster whose
    # replicas span workers: apply.remote), with the plan's device names
    if s.tp > 1 or (dp > 1 and pp > 1) or (dp > 1 and s.optimizer_sharding):
        # apply.tensor_parallel: any dp (one host) and pp; with tp = 1 and dp x pp it is a
        # pipeline replicated dp times, the gradients summed across the replicas; ZeRO-1
        # (optimizer_sharding) runs there too, each replica updating its share
        # (apply.zero)
        return "tensor_parallel"
    if plan.placement == "general":
        if dp > 1 or s.num_microbatches != 1:
            raise PlanMismatchError(
                f"Plan {plan.name!r} is a general placement with dp={dp} and "
                f"num_microbatches={s.num_microbatches}; a general placement runs one batch "
                "with one device per stage (dp=1, num_microbatches=1). Regenerate the plan.")
        return "placement"
    if dp > 1:
        return "data_parallel"
    return "pipeline" if pp > 1 else "single_device"


def top_level_devices(plan: Plan) -> dict[str, str]:
    """Device of each top-level layer of the model (replica 0).

    Plans name a nested model's layers ``outer/inner`` (``profiler.signature``);
    ``apply`` places whole top-level operations, so a nested model goes where all
    its layers are planned. A stage boundary inside a nested model cannot be
    applied yet and is refused rather than silently placed elsewhere.
    """
    devices: dict[str, set[str]] = {}
    for name, device in plan.device_of_layer().items():
        devices.setdefault(name.split("/", 1)[0], set()).add(device)
    split = {top: sorted(d) for top, d in devices.items() if len(d) > 1}
    if split:
        top, where = next(iter(split.items()))
        raise PlannerError(
            f"Plan {plan.name!r} splits nested model {top!r} across devices {where}; apply "
            "places a nested model as a whole, so a stage boundary inside it cannot be "
            "applied yet. Re-plan with the pipeline cut outside it (e.g. --fix with fewer "
            "stages) or flatten the model.")
    return {top: d.pop() for top, d in devices.items()}


def _compile_like(model: Any, wrapped: Any) -> None:
    try:
        config = model.get_compile_config()
        wrapped.compile_from_config(config)
    except Exception as e:  # a loss or metric Keras cannot serialize (e.g. a lambda)
        warnings.warn(
            f"apply.wrap could not compile the wrapped model like the original ({e}); call "
            "compile() on the model wrap returns before training it.", stacklevel=3)


def _write_logdir(plan: Plan, wrapped: Any, logdir: str | os.PathLike) -> None:
    os.makedirs(logdir, exist_ok=True)
    save_plan(plan, os.path.join(logdir, "plan.json"))
    with open(os.path.join(logdir, "placement.json"), "w", encoding="utf-8") as f:
        json.dump(variable_devices(wrapped), f, indent=2)
        f.write("\n")
