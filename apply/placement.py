"""Device placement for ops and optimizer state, and a report of where variables live.

Pipeline position: used by ``apply.pipeline`` (single-device and pipeline
plans, which place by hand with ``tf.device``; ``top_level_devices`` says where each
top-level layer of a plan goes) and by anyone who wants to see
where a wrapped model's state ended up (``variable_devices``: examples/train.py
``--json``, the tests).

What TensorFlow/Keras do by themselves, and what is done here (verified on
TF 2.21 / Keras 3.15):

* Variables live where their layer was built (``apply.cloning`` handles that).
* Ops run where the op was *created* under ``tf.device``; an op created with no
  device goes to the default device (CPU:0 / GPU:0) when the graph is placed,
  not next to its inputs. So every operation of the functional graph gets a
  device here (``operation_devices``): a planned layer its stage's device, any
  other operation (``keras.ops`` calls, ``InputLayer``) the device of the
  operation that produced its first input.
* ``tf.GradientTape`` creates backward ops with no device (TensorFlow's
  ``backprop._gradient_function`` does not colocate); ``tf.gradients`` in a
  graph colocates every gradient op with its forward op. Placed models use
  ``tf.gradients`` inside ``tf.function`` (see ``apply.pipeline``).
* Keras builds optimizer slots inside the first traced train step when no
  ``tf.distribute`` strategy is set, and ``tf.init_scope`` puts them on the
  default device. ``build_optimizer_on_devices`` builds them eagerly instead,
  each under ``tf.device`` of its variable.
* The optimizer's update math (``optimizer.update_step(grad, var, lr)``, called
  once per variable by the TF backend optimizer) has no device either;
  ``updates_on_variable_devices`` runs each call under its variable's device.

Both take ``state_device``, a function from a variable to the device of its optimizer
state (None: the variable's own). ``apply.offload`` passes the host's CPU there
(ZeRO-Offload): slots and update math on the host, the gradient copied there first,
each variable's own assign on its device.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Mapping

from tfplan import compat
from tfplan.apply.device_names import short_name
from tfplan.core.errors import PlannerError
from tfplan.planner.plan import Plan


HOST_SCOPE = "tfplan_host"  # the name scope of offload's copies to and from the host


def operation_devices(functional: Any, device_of_layer: Mapping[str, str],
                      default: str) -> dict[int, str]:
    """``{id(operation): device}`` for every operation in ``functional``'s graph."""
    return operation_values(functional, device_of_layer, default)


def operation_values(functional: Any, value_of_layer: Mapping[str, Any],
                     default: Any) -> dict[int, Any]:
    """``{id(operation): value}``: a named layer its value, any other operation the value
    of the operation that produced its first placed input, else ``default``."""
    values: dict[int, Any] = {}
    graph = compat.nodes_by_depth(functional)
    for depth in sorted(graph, reverse=True):  # inputs first
        for node in graph[depth]:
            op = node.operation
            if op is None or id(op) in values:
                continue
            if getattr(op, "name", None) in value_of_layer:
                values[id(op)] = value_of_layer[op.name]
                continue
            producers = [p for p in map(compat.producer, node.input_tensors) if p is not None]
            placed = [values[id(p)] for p in producers if id(p) in values]
            values[id(op)] = placed[0] if placed else default
    return values


def inner_optimizer(optimizer: Any) -> Any:
    """The optimizer that owns the slots (a LossScaleOptimizer wraps another one)."""
    return getattr(optimizer, "inner_optimizer", optimizer)


def tf_variable(variable: Any) -> Any:
    """The tf.Variable (or distributed variable) behind a keras.Variable."""
    import keras

    return variable.value if isinstance(variable, keras.Variable) else variable


def _device(variable: Any) -> str:
    return tf_variable(variable).device


def on_variable_device(variable: Any) -> Any:
    """``tf.device`` of ``variable``'s device, for work that belongs with it (its gradient
    sums, its moving-statistics update); no scope for a distributed variable, whose
    components tf.distribute places per replica."""
    import tensorflow as tf

    value = tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return contextlib.nullcontext()
    return tf.device(value.device)


StateDevice = Callable[[Any], str]  # a variable -> the device of its optimizer state


def build_optimizer_on_devices(optimizer: Any, variables: list[Any],
                               state_device: StateDevice | None = None
                               ) -> list[tuple[Any, Any]]:
    """Build ``optimizer`` for ``variables`` now, each slot on its variable's device
    (``state_device(variable)`` when given). Returns (slot, the variable it is made for) of
    every slot, in the order made ([] when the optimizer was built already).

    Runs eagerly (``tf.init_scope``) even when called while a tf.function traces.
    """
    import tensorflow as tf

    made: list[tuple[Any, Any]] = []
    if optimizer is None or optimizer.built:
        return made
    target = inner_optimizer(optimizer)
    original, original_add = target.add_variable_from_reference, target.add_variable
    where = state_device or _device
    device = [None]  # the device of the slot being made

    def placed(reference_variable: Any, *args: Any, **kwargs: Any) -> Any:
        device[0] = where(reference_variable)
        try:
            with tf.device(device[0]):
                slot = original(reference_variable, *args, **kwargs)
            made.append((slot, reference_variable))
            return slot
        finally:
            device[0] = None

    def add_placed(*args: Any, **kwargs: Any) -> Any:
        # the TF backend's add_variable_from_reference colocates the slot with its
        # variable (tf.distribute's colocate_vars_with: a device scope when eager); the
        # slot's own device scope goes inside it
        if device[0] is None:
            return original_add(*args, **kwargs)
        with tf.device(device[0]):
            return original_add(*args, **kwargs)

    with tf.init_scope():
        target.add_variable_from_reference = placed
        target.add_variable = add_placed
        try:
            optimizer.build(variables)
        finally:
            del target.add_variable_from_reference  # back to the class's methods
            del target.add_variable
    return made


@contextlib.contextmanager
def updates_on_variable_devices(optimizer: Any, state_device: StateDevice | None = None
                                ) -> Iterator[None]:
    """While tracing ``apply_gradients``: run each variable's update on its device.

    With ``state_device``, each update runs on ``state_device(variable)`` instead: its
    gradient is copied there first (an explicit ``tf.identity``), the optimizer's
    arithmetic and slot writes run there, and the write to the variable itself (the
    optimizer's ``assign``/``assign_add``/``assign_sub``) on the variable's device, so
    the step computed on the state device travels back to the variable.
    """
    import tensorflow as tf

    target = inner_optimizer(optimizer)
    original = target.update_step
    where = state_device or _device

    def placed(gradient: Any, variable: Any, learning_rate: Any) -> Any:
        device = where(variable)
        if device != _device(variable) and gradient is not None:
            # the gradient, copied to the state device (named: apply.audit counts it as a
            # host transfer, not a send between the plan's devices)
            with _sent_from(_device(variable)):
                gradient = tf.identity(gradient)
        with tf.device(device):
            return original(gradient, variable, learning_rate)

    writes = {}
    if state_device is not None:
        for name in ("assign", "assign_add", "assign_sub"):
            writes[name] = getattr(target, name)

    def write_on_its_device(name: str) -> Any:
        method = writes[name]

        def write(variable: Any, value: Any) -> Any:
            if tf.is_tensor(value):  # computed on the state device, copied back (named)
                with _sent_from(where(variable)):
                    value = tf.identity(value)
            with tf.device(_device(variable)):  # a variable is written where it lives
                return method(variable, value)
        return write

    target.update_step = placed
    for name in writes:
        setattr(target, name, write_on_its_device(name))
    try:
        yield
    finally:
        del target.update_step
        for name in writes:
            delattr(target, name)


@contextlib.contextmanager
def _sent_from(device: str) -> Iterator[None]:
    """Ops made here run on ``device``, under ``HOST_SCOPE``: the tensor an offloaded update
    sends between a device and its host is one of them, by name (``apply.audit``)."""
    import tensorflow as tf

    with tf.device(device), tf.name_scope(HOST_SCOPE):
        yield


def devices_of(variable: Any) -> list[str]:
    """Where a variable lives: one device (``/device:CPU:1``) per copy, in replica order.

    A list even for a plain variable (one entry), like ``Stage.devices`` in a plan.
    """
    import tensorflow as tf

    value = tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):  # MirroredVariable, SyncOnRead...
        return [short_name(v.device) for v in value.values]
    return [short_name(value.device)]


def variable_devices(model: Any) -> dict[str, list[str]]:
    """``{variable path: [device, ...]}`` for the model's variables and its optimizer's; a
    path held by several variables (each device's copy of the model, ``apply.spmd``)
    lists every device holding it, in order."""
    out: dict[str, list[str]] = {}
    optimizer = getattr(model, "optimizer", None)
    for v in (*model.variables, *(optimizer.variables if optimizer is not None else ())):
        where = out.setdefault(v.path, [])
        where.extend(d for d in devices_of(v) if d not in where)
    return out


def top_level_devices(plan: Plan) -> dict[str, str]:
    """Device of each top-level layer of the model (replica 0).

    Plans name a nested model's layers ``outer/inner`` and a block's sub-layers
    ``block/sub`` (``profiler.signature``). A block (an entry of its own) is placed
    whole: its sub-layers on another device than the block are refused. A nested model
    goes where its first layer is planned; its layers on other stages are placed there
    when it is re-created (``apply.blocks.place_nested``).
    """
    entries = plan.device_of_layer()
    devices: dict[str, list[str]] = {}
    for name, device in entries.items():
        devices.setdefault(name.split("/", 1)[0], []).append(device)
        parts = name.split("/")
        for i in range(1, len(parts)):  # a block (an entry of its own) holding this one
            block = "/".join(parts[:i])
            if block in entries and entries[block] != device:
                raise PlannerError(
                    f"Plan {plan.name!r} puts block {block!r} (a layer with sub-layers) on "
                    f"{entries[block]} and its sub-layer {name!r} on {device}; apply places "
                    "a block whole on one stage (its own code calls its sub-layers). "
                    "Re-plan with the stage boundary before or after the block.")
    return {top: where[0] for top, where in devices.items()}
