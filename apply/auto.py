"""``auto(model, global_batch)``: plan for this process's devices and wrap, in one line.

Pipeline position: the whole pipeline inside a training script. Instead of
``plan analyze`` + ``load_plan`` + ``apply.wrap``, ``apply.auto``

1. describes the devices this process sees as a ``ClusterSpec``
   (``local_cluster``): its GPUs if it has any (a preset's datasheet figures when
   the GPU is a known one), else its logical CPU devices (``cpu:N`` where the
   process configured N of them; one CPU device plans a single-device run);
2. profiles the model symbolically (``profiler.static.profile_model`` at batch
   size 1, as ``plan analyze`` does; nothing runs, no weight is copied), with the
   given optimizer, else the model's compiled one, else adam;
3. searches (``planner.search.search``) and takes the chosen plan, or, when
   ``apply.wrap`` cannot run that plan from inside the script (a replica spanning
   worker processes, which needs ``PLAN_FILE``; a plan that leaves a worker idle) or
   would warn that part of it is not applied, the fastest fitting candidate that it
   runs in full (``runnable``), and says so;
4. wraps the model (``apply.wrap``) and prints to stderr which plan it chose and
   why (the plan's ``reason``).

``PLAN_FILE=plan.json`` in the environment: that plan is loaded instead of
searching (no profile, no search), and ``apply.wrap`` still checks it against
the model and the devices. Either way the global batch must split into the
plan's ``dp * num_microbatches`` parts, checked here before any training.

Multi-worker jobs (``TF_CONFIG`` naming more than one worker, e.g. under ``plan
launch --workers W``): ``auto_devices`` makes the MultiWorkerMirroredStrategy (and
this worker's logical CPUs) before the runtime starts, and ``auto`` plans for W
workers of this worker's devices (``multi_worker_cluster``). Every worker plans the
same model for the same cluster with the same deterministic search, so they choose
the same plan; ``auto`` checks that they did (a collective over the plan's hash)
before training; a replica's pipeline stages may lie on several workers (one program
per worker, its activations crossing between them).
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
import warnings
from typing import Any

from tfplan.apply.batches import nearest_multiples
from tfplan.apply.device_names import logical_cpus, short_name
from tfplan.apply.devices import ensure_devices
from tfplan.apply.dimensions import unapplied, unapplied_dimensions
from tfplan.apply.mode import execution_mode
from tfplan.apply.workers import ensure_strategy, get_strategy, local_devices
from tfplan.apply.wrap import wrap
from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import ClusterSpecError, PlanMismatchError, PlannerError
from tfplan.core.presets import cpu_cluster, known_presets, parse_cluster, preset_cluster
from tfplan.planner.plan import Plan, load_plan

PLAN_FILE_ENV = "PLAN_FILE"
DEFAULT_TIME_LIMIT_S = 10.0  # planner.search's default ILP budget
PROFILE_BATCH_SIZE = 1  # as `plan analyze`: the cost model scales per sample


def auto(model: Any, global_batch: int, *, optimizer: Any = None, precision: str | None = None,
         logdir: str | os.PathLike | None = None, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
         cluster: ClusterSpec | str | None = None, batch_norm: str = "global",
         input_shapes: Any = None) -> Any:
    """Plan ``model`` for this process's devices and return it wrapped (see the module doc).

    ``model``: the user's model, or the function that builds it (``build_model``): it is
    then built once here to plan, and ``apply.wrap`` gets the function, so each device
    builds its own copy (custom layers need no ``get_config``: the SPMD engine).

    ``global_batch``: samples per training step (every batch given to ``fit``
    must be a multiple of the plan's ``dp * num_microbatches``). ``optimizer``:
    a name or Keras optimizer for the optimizer-state memory (default: the
    model's compiled optimizer, else adam); it does not compile the model.
    ``precision``: a dtype policy name (default: the model's own). ``logdir``:
    passed to ``apply.wrap`` (writes plan.json and placement.json there).
    ``time_limit_s``: the search's ILP budget. ``cluster``: plan for this
    ClusterSpec or ``parse_cluster`` text instead of the devices found
    (``local_cluster()``); the plan's devices must still exist here. ``batch_norm``:
    BatchNormalization statistics, "global" (equal to one device) or "local" (per
    replica and micro-batch; ``planner.batch_stats``). ``input_shapes``: {input name:
    per-sample dims} for inputs with dynamic dimensions (a keras_hub backbone's sequence
    length: ``{"token_ids": (2048,), "padding_mask": (2048,)}``; ``"*"`` for every such
    input), as ``plan analyze --input-shape``; the wrapped model refuses other shapes.
    """
    _check_global_batch_value(global_batch)
    builder = None if _is_model(model) else model
    if builder is not None:
        if not callable(builder):
            raise PlannerError(f"apply.auto received {type(model).__name__}; expected a "
                               "keras.Model or the function that builds one (build_model).")
        model = builder()
    plan_file = os.environ.get(PLAN_FILE_ENV)
    if plan_file:
        plan = load_plan(plan_file)
        _say(f"loaded plan {plan.name!r} from {PLAN_FILE_ENV}={plan_file} (no search). "
             f"{plan.reason}".rstrip())
        if plan.global_batch != global_batch:
            _say(f"note: the plan was made for global batch {plan.global_batch}; training "
                 f"with {global_batch}.")
    else:
        workers = tf_config_workers()
        if cluster is None:
            cluster = multi_worker_cluster(workers) if len(workers) > 1 else local_cluster()
        elif isinstance(cluster, str):
            cluster = parse_cluster(cluster)
        plan = plan_for(model, cluster, global_batch, optimizer=optimizer,
                        precision=precision, time_limit_s=time_limit_s,
                        batch_norm=batch_norm, input_shapes=input_shapes)
        if len(workers) > 1:
            check_same_plan(plan)
    check_global_batch(plan, global_batch)
    return wrap(builder or model, plan, logdir=logdir)


def _is_model(model: Any) -> bool:
    import keras

    return isinstance(model, keras.Model)


def auto_devices(cpus: int | None = None) -> tuple[str, ...]:
    """Make the devices ``auto`` will plan for exist; call it before building the model.

    Logical CPU devices can only be configured before TensorFlow's runtime starts
    (``apply.devices``). With ``PLAN_FILE`` set: that plan's devices
    (``apply.ensure_devices``). Else, ``cpus``: that many logical CPU devices
    (for planning on a machine without GPUs; ignored when GPUs exist). Returns the
    names of the devices ``auto`` will see. Raises PlanMismatchError when the
    runtime has already started with other devices.
    """
    import tensorflow as tf

    plan_file = os.environ.get(PLAN_FILE_ENV)
    if plan_file:
        return ensure_devices(load_plan(plan_file))
    if len(tf_config_workers()) > 1:  # a multi-worker job: its strategy, before the runtime
        if cpus is not None and (isinstance(cpus, bool) or not isinstance(cpus, int)
                                 or cpus < 1):
            raise PlannerError(f"cpus={cpus!r}; expected a number of logical CPU devices >= 1.")
        gpu = bool(tf.config.list_physical_devices("GPU"))
        ensure_strategy("GPU" if gpu else "CPU", cpus or 1)
        return tuple(short_name(d) for d in local_devices("GPU" if gpu else "CPU"))
    if cpus is not None:
        if isinstance(cpus, bool) or not isinstance(cpus, int) or cpus < 1:
            raise PlannerError(f"cpus={cpus!r}; expected a number of logical CPU devices >= 1.")
        if not tf.config.list_physical_devices("GPU"):
            logical_cpus(cpus, exact=True, error=lambda have: PlanMismatchError(
                f"{cpus} logical CPU devices were asked for, but TensorFlow's runtime "
                f"has already started with {have}. Call apply.auto_devices() before "
                "building the model or running any TensorFlow op."))
    gpus = tf.config.list_logical_devices("GPU")
    return tuple(short_name(d.name) for d in gpus or tf.config.list_logical_devices("CPU"))


def plan_for(model: Any, cluster: ClusterSpec, global_batch: int, *, optimizer: Any = None,
             precision: str | None = None, time_limit_s: float = DEFAULT_TIME_LIMIT_S,
             batch_norm: str = "global", input_shapes: Any = None) -> Plan:
    """Profile ``model``, search ``cluster`` and return the plan ``apply.wrap`` will run.

    Prints the choice and its reason to stderr.
    """
    from tfplan.planner.search import search
    from tfplan.profiler.static import profile_model

    if optimizer is None and getattr(model, "compiled", False):
        optimizer = getattr(model, "optimizer", None)
    profile = profile_model(model, PROFILE_BATCH_SIZE, precision=precision,
                            optimizer=optimizer, input_shapes=input_shapes)
    result = search(profile, cluster, global_batch, time_limit_s=time_limit_s,
                    batch_norm=batch_norm,  # only strategies apply.wrap has engines for
                    admissible=lambda c: not unapplied_dimensions(c))
    chosen = result.chosen
    where = f"{cluster.name} ({cluster.num_devices} device(s)), global batch {global_batch}"
    if runnable(chosen):
        _say(f"plan {chosen.name!r} for {where}: {chosen.reason}")
        return chosen
    why = not_runnable_reason(chosen)
    fallback = next((p for p in result.candidates if p.predicted.fits and runnable(p)), None)
    if fallback is None:
        raise PlannerError(
            f"The search for {where} chose {chosen.name!r}, which apply.wrap cannot run yet "
            f"({why}), and none of the {len(result.candidates)} candidates that fit is one it "
            "runs. Run `plan analyze` with --fix (e.g. --fix dp=1) to pick a plan by hand "
            f"and set {PLAN_FILE_ENV}=plan.json, or plan for fewer devices.")
    ratio = fallback.predicted.step_time_s / chosen.predicted.step_time_s
    _say(f"plan {fallback.name!r} for {where}: the search chose {chosen.name!r}, which "
         f"apply.wrap cannot run yet ({why}); {fallback.name!r} is the fastest candidate that "
         f"fits and that it runs (predicted step time {ratio:.2f}x the search's choice).")
    return fallback.with_reason(
        f"{fallback.name} is the fastest candidate that fits and that apply.wrap runs; the "
        f"search chose {chosen.name} ({why}): {chosen.reason}")


def check_same_plan(plan: Plan) -> None:
    """PlanMismatchError unless every worker of the multi-worker job chose ``plan``: the
    sum over the workers of a 31-bit hash of the plan's JSON must be W times this
    worker's (a collective of the MultiWorkerMirroredStrategy)."""
    import tensorflow as tf

    text = json.dumps(plan.to_dict(), sort_keys=True)
    digest = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big") >> 1
    strategy = get_strategy()
    mine = strategy.experimental_distribute_values_from_function(
        lambda ctx: tf.constant(digest, tf.int64))
    total = int(strategy.reduce(tf.distribute.ReduceOp.SUM, mine, axis=None))
    if total != digest * strategy.num_replicas_in_sync:
        raise PlanMismatchError(
            f"The workers of this multi-worker job planned differently (this worker chose "
            f"{plan.name!r}). Plan once with `plan analyze` for the cluster and set "
            f"{PLAN_FILE_ENV}=plan.json on every worker.")


def runnable(plan: Plan) -> bool:
    """Whether ``apply.wrap`` runs every part of ``plan`` (no error, nothing left unapplied)."""
    return not_runnable_reason(plan) is None


def not_runnable_reason(plan: Plan) -> str | None:
    """Why ``apply.wrap`` cannot run ``plan`` in full (None if it can)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            mode = execution_mode(plan)
        except PlannerError as e:
            return _first_clause(str(e), plan)
    missing = unapplied(plan, mode)  # a strategy dimension without an engine here
    if missing:
        return missing[0]
    if caught:
        return _first_clause(str(caught[0].message), plan)
    return None


def _first_clause(message: str, plan: Plan) -> str:
    """``Plan 'x': apply.wrap does not apply y yet; ...`` -> ``apply.wrap does not apply y yet``."""
    text = message.split(";", 1)[0]
    prefix = f"Plan {plan.name!r}"
    if text.startswith(prefix):
        text = text[len(prefix):].lstrip(": ")
    return text


def check_global_batch(plan: Plan, global_batch: int) -> None:
    """PlanMismatchError unless ``global_batch`` splits into ``dp * num_microbatches`` parts."""
    s = plan.strategy
    parts = s.dp * s.num_microbatches
    if global_batch % parts:
        options = nearest_multiples(global_batch, parts)
        raise PlanMismatchError(
            f"Global batch {global_batch} does not split into plan {plan.name!r}'s "
            f"{s.dp} data-parallel replica(s) x {s.num_microbatches} micro-batch(es) = {parts} "
            f"equal parts. Use a global batch of {options}, or make a plan for "
            f"{global_batch} (unset {PLAN_FILE_ENV} to let apply.auto plan it).")


def _check_global_batch_value(global_batch: Any) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlannerError(f"apply.auto received global_batch={global_batch!r}; expected the "
                           "number of samples per training step, a whole number >= 1.")


# --- the devices of this process ---------------------------------------------------------

def tf_config_workers() -> list[str]:
    """The worker addresses ``TF_CONFIG`` names (empty when it is unset or names none)."""
    text = os.environ.get("TF_CONFIG")
    if not text:
        return []
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise PlannerError(f"TF_CONFIG is not JSON ({e}); expected "
                           '{"cluster": {"worker": [...]}, "task": {...}}.') from None
    workers = (doc.get("cluster") or {}).get("worker") or [] if isinstance(doc, dict) else []
    return list(workers)


def multi_worker_cluster(workers: list[str]) -> ClusterSpec:
    """The ClusterSpec of a multi-worker job (TF_CONFIG with several workers): this
    worker's devices (``apply.auto_devices`` made them and the MultiWorkerMirroredStrategy)
    on each of the ``len(workers)`` workers, joined by a network.

    CPUs: ``Wxcpu:N`` (``planner.presets``, nominal figures). GPUs: this host's GPU
    preset (``gpu_cluster``) on W nodes, with the preset's inter-node network (when the
    preset has none, a 100 Gb/s InfiniBand-class link is assumed, and said).
    """
    try:
        get_strategy()
    except PlannerError:
        raise PlannerError(
            f"TF_CONFIG names {len(workers)} workers, so apply.auto plans a multi-worker job, "
            "whose strategy must exist before TensorFlow's runtime starts: call "
            "apply.auto_devices() at the top of the script, before building the model.") from None
    gpus = local_devices("GPU")
    if not gpus:
        return parse_cluster(f"{len(workers)}xcpu:{len(local_devices('CPU'))}")
    base = gpu_cluster(len(gpus))
    inter = base.inter_node_link
    if inter is None:
        inter = preset_cluster("8xA100-80GB").inter_node_link
        _say("note: no inter-node network is known for this GPU; assuming the DGX A100's.")
    return dataclasses.replace(base, name=f"{len(workers)}x{base.name}",
                               num_nodes=len(workers), inter_node_link=inter)


def local_cluster() -> ClusterSpec:
    """The devices this process sees: its GPUs if any, else its logical CPU devices."""
    import tensorflow as tf

    gpus = tf.config.list_logical_devices("GPU")
    if gpus:
        return gpu_cluster(len(gpus))
    return cpu_cluster(len(tf.config.list_logical_devices("CPU")))


def gpu_cluster(n: int) -> ClusterSpec:
    """``n`` GPUs of this host: the matching preset's figures (``planner.presets``).

    A GPU no preset names is described with the nearest preset of its
    generation (H100 figures for Hopper and later, A100 for Ampere, V100 before)
    and the memory TensorFlow reports for it, with a note on stderr.
    """
    import tensorflow as tf

    if n < 1:
        raise ClusterSpecError(f"gpu_cluster({n}): expected at least one GPU.")
    physical = tf.config.list_physical_devices("GPU")
    details = tf.config.experimental.get_device_details(physical[0]) if physical else {}
    name = str(details.get("device_name", "GPU"))
    memory = _gpu_memory_bytes()
    presets = {preset_cluster(p).device.kind: p for p in known_presets()}
    upper = name.upper().replace(" ", "")
    matches = [p for kind, p in presets.items() if kind.split("-")[0] in upper]
    if matches and memory:  # the preset whose memory is closest (A100 40 vs 80 GB)
        preset = min(matches, key=lambda p: abs(preset_cluster(p).device.memory_bytes - memory))
    elif matches:
        preset = matches[0]
    else:
        major = int((details.get("compute_capability") or (9, 0))[0])
        kind = "H100" if major >= 9 else "A100" if major >= 8 else "V100"
        preset = next(p for k, p in presets.items() if k.startswith(kind))
        _say(f"note: no cluster preset names GPU {name!r}; planning with {preset}'s "
             f"figures{' and the memory TensorFlow reports' if memory else ''}. Measure it "
             "with `plan profile-hardware --out cluster.json` and pass "
             "cluster='cluster.json' for measured figures.")
    base = preset_cluster(preset)
    device = base.device
    if memory and not matches:
        device = dataclasses.replace(device, kind=name.replace(" ", "-"), memory_bytes=memory)
    return dataclasses.replace(base, name=f"{n}x{device.kind}", devices_per_node=n,
                               device=device)


def _gpu_memory_bytes() -> int | None:
    try:
        from tfplan.compat import local_devices

        limits = [d.memory_limit_bytes for d in local_devices()
                  if d.device_type == "GPU" and d.memory_limit_bytes]
    except Exception:  # noqa: BLE001  (an internal API: no figure rather than no plan)
        return None
    return min(limits) if limits else None


def _say(text: str) -> None:
    print(f"apply.auto: {text}", file=sys.stderr, flush=True)
