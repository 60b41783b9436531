"""Measured profile: real training steps, captured by TensorFlow's profiler, timed per layer.

Pipeline position: profiler stage, next to the static profile
(``profiler.static``). ``measure_source`` builds a model file's model eagerly
(weights allocated) and ``measure_model`` trains it for a few steps on this
host's default device (GPU:0 if there is one, else the CPU), captures them with
``tf.profiler.experimental.start/stop`` into ``logdir`` (TensorBoard's Profile
tab opens ``logdir/plugins/profile/<run>/*.xplane.pb``), reads the capture back
with XProf (``profiler.xprof_reader``) and returns a ``MeasuredProfile``: per
layer forward and backward seconds per step, the step time, and peak memory.

What is measured, and how:

* The train step is a ``tf.function`` of our own (forward under
  ``tf.GradientTape``, the loss, ``tape.gradient``, ``optimizer.apply_gradients``;
  no XLA, so op names survive). The batch is put on the device once, before
  the steps: the input pipeline is not part of what is timed.
* Attribution by name scope. While the step is traced, each profiled layer
  (``profiler.signature.profiled_layers``) records the TensorFlow name scope
  its ``call`` runs in (e.g. ``mlp_1/dense_1_1``: Keras layers enter their
  scope once to build and once to call, so TensorFlow uniquifies the name;
  recording it is exact where parsing names would guess). An op named
  ``<scope>/...`` is that layer's forward; ``gradient_tape/<scope>/...`` (how
  TensorFlow names gradient ops) its backward. Layers of a nested model are
  profiled one by one under their qualified names (``outer/inner``, as in
  ``profiler.signature``); ops of the nested model outside them are not a
  layer's. Everything else -- the loss, the optimizer update,
  gradient sums (``AddN``) of tensors used twice -- is ``unattributed``.
* Fused kernels. Grappler and oneDNN run chains like ``MatMul -> BiasAdd ->
  Relu`` or ``Conv2D -> BiasAdd -> AddV2 -> Relu`` as one kernel named after
  the chain's last op, also across layers (a Dense without activation and an
  ``Activation`` layer; a convolution, a residual ``Add`` and its relu). From
  the traced graph and the kernel types in the trace,
  ``profiler.fused_kernels`` finds which ops each such kernel ran; its time is
  split among them in proportion to their FLOPs before the split by scope.
  Layers that share a kernel list each other in ``LayerTime.fused_with``, and
  ``warnings`` holds one line per such kernel with the shares.
* Op time. On the CPU, from XProf's ``trace_viewer``: the op events inside
  each step marker, with each instant split among the ops running at that
  instant (ops overlap on executor threads, so plain sums of op durations
  exceed the wall time). Then, per step,
  ``step_time_s == sum(layer fwd + bwd) + unattributed_time_s + idle_time_s``
  exactly, where idle is step time with no op running (Python and
  ``tf.function`` dispatch, executor scheduling, the final sync). On a GPU,
  from the ``Device`` rows of XProf's ``framework_op_stats`` (each op's
  kernel time on the GPU, which XProf maps from kernels to ops); idle is then
  step time minus GPU busy time (kernels on one stream do not overlap).
* ``step_time_s``: mean duration of the step markers in the trace, each
  ending after a device sync. ``step_time_unprofiled_s``: mean wall time of
  the same number of steps run just before, without the profiler (the
  profiler slows host ops; the difference shows by how much).
* Peak memory (``profiler.peak_memory``), with ``peak_memory_source`` saying
  which measure it is: on a GPU, ``tf.config.experimental.get_memory_info(
  'GPU:0')['peak']`` over the unprofiled steps (weights and optimizer slots
  included); on the CPU the same counter if the process started with
  ``TF_CPU_ALLOCATOR_USE_BFC=true``, else the process's peak-RSS growth over
  warm-up and steps (weights and slots, resident before, not included).

What is a convention or an estimate rather than a reading: splitting an
instant equally among concurrently running CPU ops (the trace says which ops
ran, not who used the cores); GPU idle time (step time minus summed kernel
time); splitting a fused kernel's time among the layers whose ops it ran
by FLOPs; gradient sums of tensors used twice (``AddN``, named outside every
scope) going to ``unattributed`` rather than to a layer. On the CPU the
profiler itself slows host ops, so profiled op and step times run above
``step_time_unprofiled_s``. FLOP- and byte-based predictions come from
``profiler.static`` and ``planner.cost_model``; ``benchmarks/gpu_check.py``
prints them beside these measurements.
"""
from __future__ import annotations

import contextlib
import os
import re
import time
from collections import defaultdict
from typing import Any, Callable, Iterator, Mapping, Sequence

from tfplan.core.errors import ModelLoadError, PlannerError
from tfplan.profiler import xprof_reader
from tfplan.profiler.fused_kernels import (FUSIBLE, GraphOp, find_fused_kernels, shared_kernels,
                                           spread_kernel_times)
from tfplan.profiler.loader import ModelSource, build
from tfplan.profiler.measured_profile import LayerTime, MeasuredProfile
from tfplan.profiler.op_attribution import op_info
from tfplan.profiler.op_flops import count_op
from tfplan.profiler.peak_memory import MemoryProbe
from tfplan.profiler.signature import profiled_layers

try:  # qualified names ("outer/inner") for the layers of nested models
    from tfplan.profiler.signature import profiled_layer_paths
except ImportError:  # a signature module without nested-model paths: top-level layers
    def profiled_layer_paths(model: Any) -> list[tuple[str, Any]]:
        return [(layer.name, layer) for layer in profiled_layers(model)]

STEP_MARKER = "measured_train_step"
GRADIENT_PREFIX = "gradient_tape/"


# --- attribution (pure) ---------------------------------------------------------------------
def _scope_index(scopes: Mapping[str, Sequence[str]]) -> list[tuple[str, str]]:
    """(scope, layer) pairs, longest scope first."""
    return sorted(((s, layer) for layer, ss in scopes.items() for s in set(ss) if s),
                  key=lambda p: -len(p[0]))


def _owner(name: str, by_scope: Sequence[tuple[str, str]]) -> tuple[str | None, bool, str]:
    """(layer or None, backward?, the name without ``gradient_tape/``) of an op name."""
    backward = name.startswith(GRADIENT_PREFIX)
    bare = name[len(GRADIENT_PREFIX):] if backward else name
    owner = next((layer for s, layer in by_scope
                  if bare == s or bare.startswith(s + "/")), None)
    return owner, backward, bare


def attribute_ops(op_time_s: Mapping[str, float], scopes: Mapping[str, Sequence[str]]
                  ) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Split op times among layers by name scope.

    ``scopes[layer]``: the name scopes the layer's calls ran in. Returns
    ``({layer: [fwd_s, bwd_s]}, {group: seconds})``: an op ``<scope>/...`` is
    forward, ``gradient_tape/<scope>/...`` backward (the longest matching scope
    wins); other ops go to a group named by their first scope component
    (``gradient_tape/`` kept, a trailing ``_<n>`` dropped).
    """
    by_scope = _scope_index(scopes)
    layers: dict[str, list[float]] = {layer: [0.0, 0.0] for layer in scopes}
    other: dict[str, float] = defaultdict(float)
    for name, seconds in op_time_s.items():
        owner, backward, bare = _owner(name, by_scope)
        if owner is not None:
            layers[owner][int(backward)] += seconds
        else:
            group = re.sub(r"_\d+$", "", bare.split("/", 1)[0])
            other[(GRADIENT_PREFIX if backward else "") + group] += seconds
    return layers, dict(other)


def attribute_kernels(op_time_s: Mapping[str, float], timed_types: Mapping[str, str],
                      graph_ops: Sequence[GraphOp], scopes: Mapping[str, Sequence[str]]
                      ) -> tuple[dict[str, list[float]], dict[str, float],
                                 dict[str, tuple[str, ...]], list[str]]:
    """``attribute_ops`` after splitting fused kernels' times among the ops they ran.

    ``op_time_s``: time per timed op name; ``timed_types``: its kernel type in
    the trace; ``graph_ops``: the traced step's graph. A kernel that ran ops of
    several layers (``profiler.fused_kernels``: which ops, and the rule -- in
    proportion to the ops' FLOPs) gives each layer its ops' share. Returns
    ``attribute_ops``'s pair, then ``{layer: layers it shares a fused kernel
    with}`` and one note per such kernel. Time is conserved: layer times plus
    the groups' sum to ``sum(op_time_s.values())``.
    """
    kernels = find_fused_kernels(graph_ops, timed_types)
    per_layer, other = attribute_ops(spread_kernel_times(op_time_s, kernels), scopes)
    by_scope = _scope_index(scopes)
    shared, notes = shared_kernels(kernels, op_time_s, lambda n: _owner(n, by_scope)[0],
                                   list(scopes))
    return per_layer, other, shared, notes


# --- running the steps ------------------------------------------------------------------------
@contextlib.contextmanager
def _recording_scopes(layers: Sequence[tuple[str, Any]],
                      scopes: dict[str, list[str]]) -> Iterator[None]:
    """Make each (name, layer)'s ``call`` note the TensorFlow name scope it runs in."""
    import tensorflow as tf

    patched = []
    for name, layer in layers:
        original = layer.call

        def call(*args: Any, __original: Callable = original, __name: str = name,
                 **kwargs: Any) -> Any:
            scopes.setdefault(__name, []).append(tf.get_current_name_scope())
            return __original(*args, **kwargs)

        object.__setattr__(layer, "call", call)
        patched.append(layer)
    try:
        yield
    finally:
        for layer in patched:
            with contextlib.suppress(AttributeError):
                object.__delattr__(layer, "call")


def _resolve_optimizer(spec: Any, model: Any) -> Any:
    import keras

    if spec is None:
        spec = "adam"
    if isinstance(spec, keras.optimizers.Optimizer):
        opt = spec
    elif isinstance(spec, str):
        opt = keras.optimizers.get(spec)
    elif callable(spec):
        opt = spec()
    else:
        opt = spec
    if not isinstance(opt, keras.optimizers.Optimizer):
        raise PlannerError(f"optimizer is {spec!r}; expected a Keras optimizer, its name "
                           "(e.g. 'adam') or a no-argument function returning one.")
    policy = getattr(getattr(model, "dtype_policy", None), "name", "")
    if policy == "mixed_float16" and not isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = keras.optimizers.LossScaleOptimizer(opt)
    return opt


def _resolve_batch(sample_batch: Any, batch_size: int) -> tuple[Any, Any]:
    batch = sample_batch(batch_size) if callable(sample_batch) else sample_batch
    if not isinstance(batch, (tuple, list)) or len(batch) != 2:
        raise PlannerError(
            f"sample_batch gave {type(batch).__name__}; expected a pair (x, y) of inputs and "
            "targets. Make sample_batch(batch_size) return (x, y).")
    return batch[0], batch[1]


def _default_device() -> tuple[str, str | None]:
    """("GPU:0 (name)" or "CPU:0", the memory-info device name or None)."""
    import tensorflow as tf

    gpus = tf.config.list_physical_devices("GPU")
    if gpus:
        details = tf.config.experimental.get_device_details(gpus[0])
        name = details.get("device_name")
        return (f"GPU:0 ({name})" if name else "GPU:0"), "GPU:0"
    return "CPU:0", None


def graph_ops(graph: Any) -> tuple[GraphOp, ...]:
    """The ops of a traced step's graph as ``GraphOp`` records (FLOPs of the fusible ones)."""
    return tuple(GraphOp(op.name, op.type, tuple(t.op.name for t in op.inputs),
                         count_op(op_info(op)).flops if op.type in FUSIBLE else 0)
                 for op in graph.get_operations())


def _sync() -> None:
    import tensorflow as tf

    tf.test.experimental.sync_devices()


# --- measuring --------------------------------------------------------------------------------
def _check_positive(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PlannerError(f"{name} must be an integer >= {minimum}; received {value!r}.")


def measure_model(model: Any, sample_batch: Any, *, batch_size: int, loss: Any,
                  optimizer: Any = "adam", steps: int = 5, warmup_steps: int = 2,
                  logdir: str, name: str | None = None) -> MeasuredProfile:
    """Train ``model`` for ``warmup_steps + 2 * steps`` steps and measure it.

    The model's weights and the optimizer's state change (it really trains).

    ``sample_batch``: a function ``sample_batch(batch_size) -> (x, y)`` or the
    pair itself. ``loss``: anything ``keras.losses.get`` accepts (a name, a
    loss object, a function ``loss(y_true, y_pred)``). ``optimizer``: a name, a
    Keras optimizer (its state changes: pass a fresh one) or a factory.
    ``logdir``: where the capture goes (``logdir/plugins/profile/<run>/``).
    """
    import keras
    import tensorflow as tf

    if not isinstance(model, keras.Model):
        raise ModelLoadError(f"measure_model needs a keras.Model; received "
                             f"{type(model).__module__}.{type(model).__qualname__}.")
    _check_positive("batch_size", batch_size, 1)
    _check_positive("steps", steps, 1)
    _check_positive("warmup_steps", warmup_steps, 0)
    if loss is None:
        raise PlannerError("measure_model needs a loss to train with; received None. Pass "
                           "loss= (e.g. 'mse') or define `loss` in the model file.")
    if not logdir:
        raise PlannerError("measure_model needs a logdir for the profiler capture; received "
                           f"{logdir!r}.")
    loss_fn = keras.losses.get(loss)
    opt = _resolve_optimizer(optimizer, model)
    device, memory_device = _default_device()
    to_device = lambda a: tf.identity(tf.convert_to_tensor(a))  # noqa: E731
    x, y = (tf.nest.map_structure(to_device, part) for part in _resolve_batch(sample_batch,
                                                                            batch_size))
    layers = profiled_layer_paths(model)
    scopes: dict[str, list[str]] = {}

    def train_step(x: Any, y: Any) -> Any:
        scopes.clear()  # Python side effect: runs only while tracing; keep the last trace
        with tf.GradientTape() as tape:
            y_pred = model(x, training=True)
            loss_value = loss_fn(y, y_pred)
            if loss_value.shape.rank:  # a plain loss function gives one value per sample
                loss_value = tf.reduce_mean(loss_value)
            if model.losses:
                loss_value = loss_value + tf.add_n(model.losses)
            scaled = opt.scale_loss(loss_value)  # loss scaling (mixed_float16), else as is
        grads = tape.gradient(scaled, model.trainable_variables)
        opt.apply_gradients(zip(grads, model.trainable_variables))
        return loss_value

    step = tf.function(train_step)
    if not opt.built:
        opt.build(model.trainable_variables)
    try:
        with _recording_scopes(layers, scopes):
            traced = step.get_concrete_function(x, y)
    except PlannerError:
        raise
    except Exception as e:
        raise PlannerError(
            f"Tracing a training step of {model.name} failed: {type(e).__name__}: {e}. "
            "Check that sample_batch(batch_size) returns (x, y) matching the model's inputs "
            "and the loss.") from e

    def run_step() -> None:
        traced(x, y)  # the concrete function: no retracing, so the recorded scopes hold
        _sync()

    memory = MemoryProbe(memory_device)
    memory.before_first_step()
    for _ in range(warmup_steps):
        run_step()
    memory.before_measured_steps()
    start = time.perf_counter()
    for _ in range(steps):
        run_step()
    unprofiled_s = (time.perf_counter() - start) / steps
    peak_bytes, peak_source = memory.peak()

    os.makedirs(logdir, exist_ok=True)
    before = set(xprof_reader.xplane_files(logdir))
    capture_start = time.time()
    try:
        tf.profiler.experimental.start(logdir)
    except Exception as e:
        raise PlannerError(f"Could not start TensorFlow's profiler into {logdir}: {e}. Only "
                           "one profiler session can run at a time; stop the other one "
                           "(tf.profiler.experimental.stop()) and try again.") from e
    try:
        for i in range(steps):
            with tf.profiler.experimental.Trace(STEP_MARKER, step_num=i, _r=1):
                run_step()
    finally:
        tf.profiler.experimental.stop()
    after = xprof_reader.xplane_files(logdir)
    files = [p for p in after if p not in before or os.path.getmtime(p) >= capture_start - 1]
    if not files:
        raise PlannerError(f"The profiler wrote no *.xplane.pb under {logdir}/plugins/profile/; "
                           "expected one per capture. Check that logdir is writable.")
    files = files[-1:]
    return _from_capture(layers, scopes, files, graph=graph_ops(traced.graph),
                         batch_size=batch_size, steps=steps, warmup_steps=warmup_steps,
                         device=device,
                         step_time_unprofiled_s=unprofiled_s, peak_memory_bytes=peak_bytes,
                         peak_memory_source=peak_source, logdir=logdir,
                         name=name or model.name)


def _from_capture(layers: Sequence[tuple[str, Any]], scopes: Mapping[str, Sequence[str]],
                  files: Sequence[str], *, graph: Sequence[GraphOp] = (), batch_size: int,
                  steps: int, warmup_steps: int, device: str, step_time_unprofiled_s: float,
                  peak_memory_bytes: int, peak_memory_source: str, logdir: str,
                  name: str) -> MeasuredProfile:
    events = xprof_reader.trace_events(files)
    windows = xprof_reader.step_windows(events, STEP_MARKER)
    warnings: list[str] = []
    if len(windows) != steps:
        raise PlannerError(
            f"The capture {files[0]} holds {len(windows)} step marker(s) named "
            f"{STEP_MARKER!r}; expected {steps}. The profiler may have dropped events (a "
            "buffer limit); try fewer steps.")
    step_time_s = sum(w.duration_s for w in windows) / steps
    device_times, op_types = (xprof_reader.device_op_stats(files) if device != "CPU:0"
                              else ({}, {}))
    if device_times:
        op_times = {op: t / steps for op, t in device_times.items()}
        time_source = ("GPU kernel time per op: Device rows of XProf framework_op_stats "
                       "(self time), per step")
    else:
        host = xprof_reader.host_op_wall_times(events, windows)
        op_times = {op: t / steps for op, t in host.op_time_s.items()}
        op_types = xprof_reader.host_op_types(events)
        time_source = ("host op events of XProf trace_viewer inside the step markers, each "
                       "instant split among the ops running at it, per step")
        if device != "CPU:0":
            warnings.append(f"the capture has no GPU op times although {device} exists; "
                            "host op times used")
    per_layer, other, shared, notes = attribute_kernels(
        op_times, op_types, graph, {n: scopes.get(n, ()) for n, _ in layers})
    warnings.extend(notes)
    for n, _ in layers:
        if not scopes.get(n):
            warnings.append(f"layer {n} was not called in the training step: no time")
    layer_times = tuple(LayerTime(n, type(l).__name__, per_layer[n][0], per_layer[n][1],
                                  tuple(dict.fromkeys(scopes.get(n, ()))), shared.get(n, ()))
                        for n, l in layers)
    unattributed_s = sum(other.values())
    idle_s = step_time_s - sum(t.time_s for t in layer_times) - unattributed_s
    if idle_s < -1e-9 * step_time_s:  # only summed GPU kernel times can overlap
        warnings.append(f"op times exceed the step time by {-idle_s * 1e3:.3f} ms per step "
                        "(kernels overlapped on several streams); idle set to 0")
    idle_s = max(idle_s, 0.0)
    return MeasuredProfile(
        model_name=name, batch_size=batch_size, steps=steps, warmup_steps=warmup_steps,
        device=device, time_source=time_source, step_time_s=step_time_s,
        step_time_unprofiled_s=step_time_unprofiled_s, layers=layer_times,
        unattributed_time_s=unattributed_s, idle_time_s=idle_s,
        peak_memory_bytes=int(peak_memory_bytes), peak_memory_source=peak_memory_source,
        logdir=os.path.abspath(logdir), trace_files=tuple(os.path.abspath(f) for f in files),
        unattributed=tuple(sorted(other.items(), key=lambda kv: -kv[1])),
        warnings=tuple(warnings))


def measure_source(source: ModelSource, batch_size: int, *, logdir: str, steps: int = 5,
                   warmup_steps: int = 2, loss: Any = None,
                   optimizer: Any = None) -> MeasuredProfile:
    """Build ``source`` eagerly (weights allocated) and ``measure_model`` it.

    Uses the model file's ``loss``, ``optimizer`` (default adam) and
    ``sample_batch(batch_size)``; ``loss``/``optimizer`` arguments override them.
    """
    if source.sample_batch is None:
        raise ModelLoadError(
            f"Measuring {source.origin} needs data, but it defines no sample_batch. Define "
            "sample_batch(batch_size) returning a deterministic (x, y) batch in the model file "
            "(see examples/mlp.py); the measured steps train on it.")
    model = build(source)
    if loss is None:
        loss = source.loss if source.loss is not None else getattr(model, "loss", None)
    if loss is None:
        raise ModelLoadError(
            f"Measuring {source.origin} needs a loss to train with; the model file defines no "
            "`loss` and the model is not compiled with one. Add e.g. "
            "loss = 'sparse_categorical_crossentropy' next to build_model().")
    if optimizer is None:
        optimizer = source.optimizer or getattr(model, "optimizer", None) or "adam"
    return measure_model(model, source.sample_batch, batch_size=batch_size, loss=loss,
                         optimizer=optimizer, steps=steps, warmup_steps=warmup_steps,
                         logdir=logdir, name=source.name)
