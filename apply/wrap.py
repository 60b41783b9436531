"""``wrap(model, plan)``: the one line in a training script that applies a plan.

Pipeline position: after ``planner.load_plan`` (a plan.json from ``plan
analyze``) and the user's own model; returns a ``keras.Model`` that trains
with the plan through the usual ``compile``/``fit``/``evaluate``/``predict``/
``save_weights``/``load_weights``. Steps:

1. the plan is matched to the model by structure (``Plan.for_model`` on
   ``profiler.signature.model_signature`` and ``output_shapes``: layer types,
   parameter counts and output shapes in the profile's order, not Keras's generated
   names; PlanMismatchError naming the first differing layer) and its layer names
   replaced by the model's (``wrapped.plan`` is that plan), against itself (stages cover each layer once; ``dp``/``pp``
   agree with the stages), and against this process's devices
   (``apply.ensure_devices``);
2. the plan's shape picks the mode, once (``apply.mode.execution_mode``: a ``Mode``
   and the ``Processes`` that run it). Every plan the SPMD engine runs (``apply.spmd``:
   single device, dp, tp, pp, cp, ep and their hybrids, general placements, ZeRO-1/2/3,
   recomputation, offload, BatchNormalization; on one host, or across workers one
   program per worker, each running its own devices' columns: ``spmd_refusal`` says why
   not) goes there, each device building its copy with ``build_model`` or, for a built model, re-creating it from its
   layers' configs (``apply.cloning.clone_graph``). On one host the older engines
   below run only what ``spmd_refusal`` names (BatchNormalization subclasses or
   ``renorm`` under dp, context parallelism over sequences of a length known only as
   they run, a hand-made plan's split the SPMD twins refuse): ``apply.pipeline`` (one
   stage, pipelines, general placements), ``apply.data_parallel``,
   ``apply.tensor_parallel`` (with ``apply.zero``, ``apply.zero3``,
   ``apply.expert_parallel``) and ``apply.context_parallel`` (cp x dp). Across workers
   (``/job:worker/task:w/...`` names, a ``Wxcpu:N`` or multi-node cluster; start the
   workers with ``plan launch --workers W``), a plan the SPMD engine refuses is refused,
   with the reason;

3. the model is re-created with the plan's placement and the user's current
   weights (a block whole on its stage, its split sub-layers swapped in place, a
   nested model's layers on their own stages: ``apply.blocks``); if the user's model was compiled, the wrapped one is compiled from
   its compile config (a fresh optimizer; optimizer state is not carried over).
   Compiling the wrapped model again later works as usual;
4. a plan's ``recompute`` is applied in every mode (``apply.recompute``: the
   recomputed layers, or under ``"selective"`` only their attention cores, run under
   ``tf.recompute_grad``, in each replica under data parallelism); layers with state
   (attention with dropout, under ``"selective"``) keep their activations (a warning
   says so);
5. a plan's ``offload`` puts the optimizer slots and update math (``"optimizer"``),
   and the weights (``"optimizer+weights"``), on each device's host CPU
   (``apply.offload``; one host only; a data-parallel plan then runs its replicas as
   copies, ``apply.tensor_parallel``).

Every training batch must split into ``dp * num_microbatches`` equal parts
(checked before training starts; ``apply.planned_model``).
"""
from __future__ import annotations

import os
import warnings
from typing import Any, Sequence

from tfplan.apply.batch_stats import batch_norm_layers
from tfplan.apply.cloning import is_graph_model, to_functional
from tfplan.apply.context_parallel import wrap_context_parallel
from tfplan.apply.data_parallel import wrap_data_parallel
from tfplan.apply.devices import ensure_devices
from tfplan.apply.dimensions import check_applicable, older_expert_clashes
from tfplan.apply.expert_parallel import moe_group_warning, wrap_expert_parallel
from tfplan.apply.mode import Mode, Processes, execution_mode
from tfplan.apply.offload import offload_state, weights_device
from tfplan.apply.pipeline import wrap_placed
from tfplan.apply.placement import top_level_devices, variable_devices
from tfplan.apply.recompute import (recompute_attention_cores, recomputed_layers,
                                     split_recompute)
from tfplan.apply.schedule import SCHEDULED, schedule_of
from tfplan.apply.tensor_parallel import wrap_tensor_parallel
from tfplan.core.atomic import write_json
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan, load_plan, save_plan
from tfplan.planner.validate import validate_plan
from tfplan.profiler.signature import model_signature, output_shapes


def wrap(model: Any, plan: Plan | str | os.PathLike, *, logdir: str | os.PathLike | None = None
         ) -> Any:
    """Return a keras.Model that trains ``model`` as ``plan`` says (see the module docstring).

    ``model``: the user's model, or the function that builds it (``build_model``, called
    with no arguments): each device then builds its own copy with the user's code, so
    custom layers need no ``get_config``; a built model's copies are re-created from its
    layers' configs (the SPMD engine, ``apply.spmd``, either way). ``plan``: a
    Plan or the path of a plan.json. ``logdir``: if given, the plan and
    where each model variable was placed are written there (plan.json,
    placement.json); optimizer slots exist only after ``compile()``, see
    ``apply.variable_devices(model)`` for them.
    """
    if not isinstance(plan, Plan):
        plan = load_plan(plan)
    builder = _builder(model)
    if builder is not None:  # the devices first: building starts TensorFlow's runtime
        ensure_devices(plan, mode=execution_mode(plan))
        model = _built(builder)
    view = to_functional(model) if builder is None or is_graph_model(model) else model
    signature = model_signature(view)
    # matched by structure, renamed to this model's layer names: every lookup below
    # (placement, tp_splits, stages, recompute, ZeRO) then finds the model's layers
    plan = plan.for_model(signature, output_shapes(view))
    mode = execution_mode(plan)  # how it runs, decided once (apply.mode)
    check_applicable(plan, mode)  # every strategy dimension has an engine here
    validate_plan(plan, signature)  # stages cover the layers once, in order; devices once
    top_level_devices(plan)  # a block is placed whole: a stage boundary inside it is refused
    ensure_devices(plan, mode=mode)
    # every plan the SPMD engine runs goes there (apply.spmd), a built model's copies
    # re-created from its layers' configs; the engines below run the rest (they move to
    # apply.spmd mode by mode: issue 25)
    recompute, stateful = recomputed_layers(plan, view)
    if stateful:
        warnings.warn(
            f"Plan {plan.name!r} recomputes ({plan.strategy.recompute}) layers "
            f"{list(stateful)}, which hold state a second forward pass would change "
            "(moving statistics, random seeds, as attention dropout draws); they keep their "
            "activations instead (apply.recompute).", stacklevel=2)
    why_not = spmd_refusal(plan, mode, view)
    grouped = moe_group_warning(plan, view)  # MoE capacity / aux loss per token group
    if grouped:
        warnings.warn(grouped, stacklevel=2)
    if not why_not:
        if builder is None:  # a built model: each device's copy re-created from its config
            builder, template = _cloner(view)
        else:
            template = model
        wrapped = _wrap_spmd(builder, template, plan, recompute, logdir)
        if batch_norm_layers(view):
            _warn_local_statistics(plan, stacklevel=3)
        if wrapped.run_description.joined_microbatches > 1:
            _warn_joined(plan, stacklevel=3)
        if getattr(model, "compiled", False):
            _compile_like(model, wrapped)
        if logdir is not None:
            _write_logdir(plan, wrapped, logdir)
        return wrapped
    s = plan.strategy
    if s.cp > 1 and (s.tp > 1 or s.zero_stage or s.pp > 1 or s.ep > 1):  # older: cp x dp
        raise PlanMismatchError(
            f"Plan {plan.name!r} runs context parallelism with tp={s.tp}, pp={s.pp}, "
            f"ep={s.ep}, zero_stage={s.zero_stage}, which only the SPMD engine (apply.spmd) "
            f"runs, and it does not run this plan: {why_not}. Re-plan with cp=1, or with "
            "tp=pp=ep=1 and zero_stage=0.")
    clashes = older_expert_clashes(s) if s.ep > 1 else []
    if clashes:  # the older engine: ep without tp, ZeRO-3 or offload
        raise PlanMismatchError(
            f"Plan {plan.name!r} runs expert parallelism with {', '.join(clashes)}, which "
            f"only the SPMD engine (apply.spmd) runs, and it does not run this plan: "
            f"{why_not}. Re-plan with ep=1, or with tp=1, zero_stage at most 2 and offload "
            "'none'.")
    if builder is not None and not is_graph_model(model):
        raise PlannerError(
            f"apply.wrap received a function that builds a {type(model).__name__}; plan "
            f"{plan.name!r} needs an engine that re-creates the model's graph ({why_not}), "
            "which a subclassed model does not have. Build the model with the Functional "
            "API or keras.Sequential, or re-plan without that dimension.")
    if mode.processes is Processes.PER_WORKER:  # one program per worker: the SPMD engine
        raise PlanMismatchError(
            f"Plan {plan.name!r} runs on several workers, one program per worker, which only "
            f"the SPMD engine (apply.spmd) does, and it does not run this plan: {why_not}. "
            "Change that (or train it on one host).")
    m = plan.strategy.num_microbatches
    recompute, cores = split_recompute(plan, recompute)  # whole layers / attention cores
    if mode.mode is Mode.DATA_PARALLEL and (plan.strategy.offload != "none" or (
            plan.strategy.batch_norm == "global" and batch_norm_layers(view))):
        # offload: the copies' updates are placed by hand (apply.offload)
        # replicas as copies in one graph (apply.tensor_parallel), not MirroredStrategy:
        # its cross-replica sums (one per BatchNormalization statistic, and their
        # gradients) each cost a thread rendezvous when traced, and tracing grew
        # quadratically with the layers (20 layers on 4 CPUs: 70 s first step against 12 s
        # as copies, steps alike)
        wrapped = wrap_tensor_parallel(view, plan, top_level_devices(plan),
                                       recompute_layers=recompute)
    elif mode.mode is Mode.DATA_PARALLEL:
        wrapped = wrap_data_parallel(view, plan.stages[0].devices, plan_name=plan.name,
                                     num_microbatches=m, recompute_layers=recompute)
    elif mode.mode is Mode.CONTEXT_PARALLEL:
        wrapped = wrap_context_parallel(view, plan, top_level_devices(plan),
                                        recompute_layers=recompute)
    elif mode.mode is Mode.TENSOR_PARALLEL and plan.strategy.ep > 1:
        wrapped = wrap_expert_parallel(view, plan, top_level_devices(plan),
                                       recompute_layers=recompute)
    elif mode.mode is Mode.TENSOR_PARALLEL:
        wrapped = wrap_tensor_parallel(view, plan, top_level_devices(plan),
                                       recompute_layers=recompute)
    else:  # single device, pipeline, general placement: placed layers
        wrapped = wrap_placed(view, top_level_devices(plan), plan_name=plan.name,
                              num_microbatches=m, recompute_layers=recompute,
                              schedule=schedule_of(plan),  # 1F1B/interleaved order
                              weights_device=weights_device(plan),  # apply.offload
                              device_of_entry=plan.device_of_layer())  # nested models
    wrapped.plan = plan
    recompute_attention_cores(wrapped, cores)  # "selective" (apply.recompute)
    offload_state(wrapped, plan)  # optimizer state on the host (apply.offload)
    _apply_batch_norm(plan, wrapped)
    if getattr(model, "compiled", False):
        _compile_like(model, wrapped)
    if logdir is not None:
        _write_logdir(plan, wrapped, logdir)
        # fit() then writes predicted vs measured step times there (apply.monitor)
        wrapped.plan_logdir = os.fspath(logdir)
    return wrapped


def _builder(model: Any) -> Any:
    """``model`` when it is a function that builds the model, else None."""
    import keras

    return model if callable(model) and not isinstance(model, keras.layers.Layer) else None


def _built(builder: Any) -> Any:
    """The builder's model, on the host (it holds the weights every copy starts from, and
    serves weight files: ``apply.spmd.model``)."""
    import keras
    import tensorflow as tf

    from tfplan.apply.spmd.model import HOST

    with tf.device(HOST):
        model = builder()
    if not isinstance(model, keras.Model):
        raise PlannerError(f"apply.wrap called {getattr(builder, '__name__', builder)!r} to "
                           f"build the model and received a {type(model).__name__}; the "
                           "function must return a keras.Model.")
    return model


def _cloner(view: Any) -> tuple[Any, Any]:
    """For a built model (``view``, Functional): the function that builds a copy of it from
    its layers' configs (``apply.cloning.clone_graph``), and the host's copy holding its
    current weights (the template every device's copy starts from; the user's model is
    left as it is). A layer that cannot be re-created raises here, before anything runs,
    with the builder form to use instead (``apply.cloning.clone_layer``)."""
    from tfplan.apply.cloning import clone_graph, copy_weights

    def builder() -> Any:
        return clone_graph(view)

    template = _built(builder)
    copy_weights(view, template)
    return builder, template


def spmd_refusal(plan: Plan, mode: Any, view: Any) -> str:
    """Why the SPMD engine (``apply.spmd``) does not run ``plan`` yet ("" when it does)."""
    import keras

    from tfplan.apply.spmd.batch_norm import is_batch_norm
    from tfplan.apply.spmd.rank_layers import split_problem
    from tfplan.profiler.signature import profiled_layer_paths

    if mode.mode not in (Mode.SINGLE_DEVICE, Mode.PIPELINE, Mode.PLACEMENT,
                         Mode.DATA_PARALLEL, Mode.TENSOR_PARALLEL, Mode.CONTEXT_PARALLEL):
        return f"the {mode.mode.value} mode"
    s = plan.strategy
    norms = [(path, layer) for path, layer in profiled_layer_paths(view)
             if isinstance(layer, keras.layers.BatchNormalization)]
    if norms and (s.dp > 1 or (s.batch_norm == "local" and s.num_microbatches > 1)):
        if s.batch_norm not in ("global", "local"):
            return f"{s.batch_norm} BatchNormalization statistics"
        if any(not is_batch_norm(layer) or getattr(layer, "renorm", False)
               for _, layer in norms):
            return "a BatchNormalization subclass or renorm"
        nested = {path.rsplit("/", 1)[0] for path, _ in norms if "/" in path}
        entries = dict(profiled_layer_paths(view))
        if any(entries.get(p) is not None and is_graph_model(entries[p]) for p in nested):
            return "BatchNormalization inside a nested model"
    if s.cp > 1 and any(len(x.shape) > 1 and x.shape[1] is None for x in view.inputs):
        return "context parallelism over sequences of a length known only as they run"
    if s.tp > 1:
        entries = dict(profiled_layer_paths(view))
        for name, split in plan.tp_splits:
            problem = split_problem(entries[name], split, s.tp) if name in entries else ""
            if problem:
                return f"a split it does not run ({name!r}: {problem})"
    return ""


def _wrap_spmd(builder: Any, model: Any, plan: Plan, recomputed: Sequence[str],
               logdir: str | os.PathLike | None) -> Any:
    """The SPMD model (``apply.spmd``): ``builder`` builds each device's copy, starting
    from the weights of ``model`` (its first build, on the host), which also serves weight
    files; ``recomputed``: the top-level layers the plan recomputes (``apply.recompute``)."""
    from tfplan.apply.spmd import wrap_spmd

    return wrap_spmd(builder, plan, model, recomputed=tuple(recomputed), name=model.name,
                     logdir=None if logdir is None else os.fspath(logdir))


def _apply_batch_norm(plan: Plan, wrapped: Any) -> None:
    """The plan's rule for BatchNormalization statistics (``apply.batch_stats``), and a
    warning where it is not one device's or the plan's schedule cannot hold."""
    s = plan.strategy
    if not wrapped.set_batch_norm(s.batch_norm):
        return
    _warn_local_statistics(plan, stacklevel=4)
    if s.batch_norm == "global" and s.num_microbatches > 1 and s.schedule in SCHEDULED:
        warnings.warn(
            f"Plan {plan.name!r} has a {s.schedule} schedule, but global batch statistics "
            "need every micro-batch at each BatchNormalization layer before any continues, "
            "so the micro-batches run in GPipe order (all forwards, then all backwards). "
            "Make the plan with --schedule gpipe, or with --batch-norm local to keep "
            f"{s.schedule}.", stacklevel=3)


def _warn_joined(plan: Plan, stacklevel: int) -> None:
    """Where global batch statistics make a pipeline schedule run in another order."""
    s = plan.strategy
    if s.schedule in SCHEDULED:
        warnings.warn(
            f"Plan {plan.name!r} has a {s.schedule} schedule, but global batch statistics "
            "need every micro-batch at each BatchNormalization layer before any continues, "
            f"so each replica's {s.num_microbatches} micro-batches run as one, stage after "
            "stage (GPipe order with the barrier planner.batch_stats prices). Make the plan "
            f"with --schedule gpipe, or with --batch-norm local to keep {s.schedule}.",
            stacklevel=stacklevel)


def _warn_local_statistics(plan: Plan, stacklevel: int) -> None:
    """Where the plan's ``local`` rule makes BatchNormalization differ from one device."""
    s = plan.strategy
    parts = s.dp * s.num_microbatches
    if s.batch_norm == "local" and parts > 1:
        warnings.warn(
            f"Plan {plan.name!r} computes BatchNormalization statistics per replica and "
            f"micro-batch (batch_norm 'local': {s.dp} x {s.num_microbatches} parts of "
            f"{plan.global_batch // parts} samples), so the losses differ from one device's; "
            "the moving statistics get one update per step, the mean over the parts. "
            "plan analyze --batch-norm global makes them equal to one device.",
            stacklevel=stacklevel)


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
    save_plan(plan, os.path.join(logdir, "plan.json"))  # both atomic (core.atomic)
    write_json(os.path.join(logdir, "placement.json"), variable_devices(wrapped))
