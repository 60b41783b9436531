"""Hand-made plans and training loops for the apply tests (no planner search involved)."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Any, Sequence

import numpy as np

from tfplan.core.cluster import ClusterSpec, DeviceSpec, LinkSpec
from tfplan.planner.plan import Breakdown, Plan, Prediction, Stage, Strategy
from tfplan.profiler.signature import model_signature

HERE = os.path.dirname(os.path.abspath(__file__))


def cpu_cluster(n: int) -> ClusterSpec:
    device = DeviceSpec(kind="CPU", device_type="CPU", memory_bytes=8 << 30,
                        peak_flops_per_s=(("float32", 1e11),),
                        memory_bandwidth_bytes_per_s=1e10, matmul_efficiency=0.5,
                        source="test")
    return ClusterSpec(name=f"cpu:{n}", num_nodes=1, devices_per_node=n, device=device,
                       intra_node_link=LinkSpec(bandwidth_bytes_per_s=1e10, latency_s=1e-6))


def make_plan(model: Any, stage_devices: Sequence[Sequence[str]], *, global_batch: int = 16,
              num_microbatches: int = 1, stage_layers: Sequence[Sequence[str]] | None = None,
              cluster_size: int = 8, name: str | None = None,
              signature: tuple[tuple[str, str, int], ...] | None = None) -> Plan:
    """A Plan for ``model``: stage ``s`` on devices ``stage_devices[s]`` (one per replica).

    Layers are split into contiguous, nearly equal stages unless ``stage_layers`` says.
    """
    signature = signature or model_signature(model)
    layers = [row[0] for row in signature]
    pp, dp = len(stage_devices), len(stage_devices[0])
    if stage_layers is None:
        bounds = np.linspace(0, len(layers), pp + 1).round().astype(int)
        stage_layers = [layers[bounds[i]:bounds[i + 1]] for i in range(pp)]
    strategy = Strategy(dp=dp, tp=1, pp=pp, num_microbatches=num_microbatches,
                        microbatch_size=global_batch // (dp * num_microbatches),
                        schedule="gpipe" if pp > 1 else "none")
    stages = tuple(Stage(layers=tuple(ls), devices=tuple(ds))
                   for ls, ds in zip(stage_layers, stage_devices))
    devices = [d for ds in stage_devices for d in ds]
    predicted = Prediction(step_time_s=0.01, breakdown=Breakdown(0.01, 0.0, 0.0, 0.0, 0.0),
                           peak_memory_bytes_per_device=tuple((d, 1 << 20) for d in devices),
                           memory_capacity_bytes=8 << 30, samples_per_s=1600.0,
                           model_tflops_per_device=0.001)
    return Plan(name=name or f"test dp={dp} pp={pp} m={num_microbatches}",
                model_name=getattr(model, "name", "model"), model_fingerprint="test",
                model_signature=signature, cluster=cpu_cluster(cluster_size),
                global_batch=global_batch, precision="float32", optimizer="adam",
                strategy=strategy, stages=stages, predicted=predicted, reason="hand-made",
                solver="test")


def tp_plan(model: Any, stage_devices: Sequence[Sequence[str]], splits: Sequence[Any] = (), *,
            dp: int = 1, zero: bool | int = False, num_microbatches: int = 1,
            global_batch: int = 16, cluster_size: int = 8, name: str | None = None) -> Plan:
    """``make_plan`` with tensor parallelism: stage s lists dp x tp devices (tensor rank
    innermost), ``splits`` the plan's ``tp_splits``; ``zero``: the ZeRO stage over the dp replicas (True: 1)."""
    plan = make_plan(model, stage_devices, num_microbatches=num_microbatches,
                     global_batch=global_batch, cluster_size=cluster_size)
    tp = len(stage_devices[0]) // dp
    strategy = dataclasses.replace(plan.strategy, dp=dp, tp=tp, zero_stage=int(zero),
                                   microbatch_size=global_batch // (dp * num_microbatches))
    return dataclasses.replace(plan, strategy=strategy, tp_splits=tuple(splits),
                               name=name or f"test dp={dp} tp={tp} pp={len(stage_devices)}"
                               + (f" zero{int(zero)}" if zero else ""))


def cpus(*indices: int) -> list[str]:
    return [f"/device:CPU:{i}" for i in indices]


def load_model_file(name: str) -> Any:
    """Import tests/apply/<name>.py as a module (build_model, loss, optimizer, sample_batch)."""
    path = os.path.join(HERE, f"{name}.py")
    spec = importlib.util.spec_from_file_location(f"_apply_test_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fresh_optimizer(module: Any) -> Any:
    opt = module.optimizer
    return type(opt).from_config(opt.get_config())


def step_losses(model: Any, batches: Sequence[tuple[Any, Any]]) -> list[float]:
    """Per-step training losses (train_on_batch resets the loss mean every call)."""
    return [float(model.train_on_batch(x, y, return_dict=True)["loss"]) for x, y in batches]


def batches_of(module: Any, steps: int, batch: int) -> list[tuple[Any, Any]]:
    x, y = module.sample_batch(steps * batch)
    return [(rows(x, i * batch, (i + 1) * batch), y[i * batch:(i + 1) * batch])
            for i in range(steps)]


def rows(x: Any, lo: int, hi: int) -> Any:
    """Rows [lo, hi) of an array or of each array of a dict (a model's named inputs)."""
    return {k: v[lo:hi] for k, v in x.items()} if isinstance(x, dict) else x[lo:hi]


STEPS = 5
GLOBAL_BATCH = 16
_CACHE: dict[str, Any] = {}


def base_model(name: str) -> tuple[Any, Any]:
    """(module, model) for tests/apply/<name>.py, built once with seed 0 (never trained)."""
    if name not in _CACHE:
        import keras

        module = load_model_file(name)
        keras.utils.set_random_seed(0)
        _CACHE[name] = (module, module.build_model())
    return _CACHE[name]


def single_device_copy(name: str) -> tuple[Any, Any]:
    """(module, a compiled one-device copy of ``base_model(name)``, same weights: built
    again by the module's ``build_model``, as custom layers without ``get_config`` cannot
    be cloned)."""
    module, model = base_model(name)
    copy = module.build_model()
    copy.set_weights(model.get_weights())
    copy.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    return module, copy


def reference_losses(name: str, steps: int = STEPS) -> list[float]:
    """Single-device per-step losses of a copy of ``base_model(name)`` (the ground truth),
    ``steps`` steps on ``batches_of(module, steps, GLOBAL_BATCH)``."""
    key = f"{name}/reference/{steps}"
    if key not in _CACHE:
        module, copy = single_device_copy(name)
        _CACHE[key] = step_losses(copy, batches_of(module, steps, GLOBAL_BATCH))
    return _CACHE[key]


def assert_losses_match(losses: Sequence[float], reference: Sequence[float],
                        rtol: float = 1e-4) -> None:
    assert len(losses) == len(reference)
    np.testing.assert_allclose(losses, reference, rtol=rtol)


def spmd_planned_devices(wrapped: Any, plan: Plan) -> dict[int, str]:
    """``{id(variable): the device plan names}`` for every variable of every device's copy
    of an SpmdModel (apply.spmd): copy i is tensor rank t of replica q (i = q tp + t), and
    each layer's variables sit on its stage's device q tp + t (a nested Functional model's
    layers on their own stages where the plan lists them)."""
    from tfplan.apply.cloning import is_graph_model

    stage_of = {name: stage for stage in plan.stages for name in stage.layers}
    tp = plan.strategy.tp
    out: dict[int, str] = {}

    def visit(layers: Any, prefix: str, column: int) -> None:
        for layer in layers:
            path = prefix + layer.name
            if path in stage_of:
                for v in layer.weights:
                    out[id(v)] = stage_of[path].devices[column]
            elif is_graph_model(layer):
                visit(layer.layers, path + "/", column)

    for i, copy in enumerate(wrapped.device_models):
        q, t = divmod(i, tp)
        visit(copy.layers, "", q * tp + t)
    return out


def slots_by_variable(optimizer: Any) -> dict[int, list[Any]]:
    """``{id(trainable variable): its optimizer slots}``, through the optimizer's own index.

    Keras optimizers keep each kind of slot in a list indexed like the variables they
    were built for (``SGD.momentums``, ``Adam._momentums``/``_velocities``, ...) and look
    a variable's slot up with ``_get_variable_index(variable)`` in ``update_step``; every
    such list is found here by its length and contents, and every optimizer variable
    other than the step counter and the learning rate must belong to one.
    """
    import keras

    inner = getattr(optimizer, "inner_optimizer", optimizer)
    variables = list(inner._trainable_variables)
    own = {id(v) for v in variables}
    slot_lists = [value for key, value in vars(inner).items()
                  if key != "_trainable_variables" and isinstance(value, list)
                  and len(value) == len(variables) and value
                  and all(isinstance(x, keras.Variable) and id(x) not in own for x in value)]
    out: dict[int, list[Any]] = {id(v): [] for v in variables}
    for v in variables:
        i = inner._get_variable_index(v)
        out[id(v)].extend(slots[i] for slots in slot_lists)
    counters = {id(inner.iterations), id(getattr(inner, "_learning_rate", None))}
    found = {id(s) for slots in out.values() for s in slots}
    strays = [v.path for v in inner.variables if id(v) not in found | counters]
    assert not strays, f"optimizer variables not matched to a model variable: {strays}"
    return out


def assert_state_where_planned(wrapped: Any, plan: Plan) -> None:
    """Every variable of an SpmdModel's copies on the device plan names for it
    (``spmd_planned_devices``), each optimizer slot beside its variable (the host's CPU
    under ``offload="optimizer"``), and every device of the plan holding state."""
    import tensorflow as tf

    def short(device: str) -> tuple[str, int]:
        spec = tf.DeviceSpec.from_string(device)
        return spec.device_type, spec.device_index

    def where(v: Any) -> tuple[str, int]:
        return short(getattr(v, "value", v).device)

    planned = spmd_planned_devices(wrapped, plan)
    for copy in wrapped.device_models:
        for v in copy.weights:
            assert id(v) in planned, v.path
            assert where(v) == short(planned[id(v)]), (v.path, planned[id(v)])
    assert set(planned.values()) == set(plan.devices)
    if getattr(wrapped, "optimizer", None) is None or not wrapped.optimizer.built:
        return
    host = plan.strategy.offload == "optimizer"
    by_variable = slots_by_variable(wrapped.optimizer)
    for v in wrapped.trainable_variables:
        slots = by_variable[id(v)]
        assert slots, f"no optimizer slot for {v.path}"
        for slot in slots:
            assert tuple(slot.shape) == tuple(v.shape), (slot.path, v.path)
            assert where(slot) == (("CPU", 0) if host else where(v)), (slot.path, v.path)
