"""Static profile of a Keras model: per-layer params, bytes and FLOPs, and its layer graph.

Pipeline position: profiler stage. ``profile_source`` takes a ``ModelSource``
(``profiler.loader``), builds the model inside ``tf.Graph().as_default()`` --
where Keras allocates no weights, so models larger than this machine's memory
can be profiled -- and ``profile_model`` turns a built model into the
``ModelProfile`` the planner reads. Nothing here runs the model.

Per layer, for ``batch_size`` samples: variable bytes come from each variable's
own dtype (float32 under mixed precision); activation bytes are the layer's
output tensors in the layer's compute dtype (or the ``precision`` asked for);
FLOPs come from ``profiler.layer_flops``. Layers are walked along the
Functional graph (Sequential models use their inner Functional graph), which
gives the edges and each layer's inputs. A nested keras.Model is one layer
whose FLOPs and activation bytes are the sums over its own inner layers.
"""
from __future__ import annotations

import dataclasses
import warnings as _warnings
from dataclasses import dataclass, field
from typing import Any

from planner.errors import ModelLoadError, PlannerError
from profiler.layer_flops import layer_flops, prod
from profiler.loader import ModelSource, build
from profiler.model_profile import Edge, LayerProfile, ModelProfile
from profiler.optimizer_slots import DEFAULT_OPTIMIZER, optimizer_slots
from profiler.signature import profiled_layers

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16", "float64")


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype name or object (bfloat16 included)."""
    import tensorflow as tf

    return tf.as_dtype(getattr(dtype, "name", dtype)).size


def _is_float(dtype: Any) -> bool:
    import tensorflow as tf

    return tf.as_dtype(getattr(dtype, "name", dtype)).is_floating


# --- graph walk ---------------------------------------------------------------------------
@dataclass
class _Acc:
    """What the walk accumulates for one layer (over all its calls in the graph)."""

    flops_fwd: int = 0
    flops_bwd: int = 0
    activation_bytes: int = 0
    inputs: list[str] = field(default_factory=list)
    not_counted: list[str] = field(default_factory=list)
    seen: bool = False

    def note(self, what: str) -> None:
        if what not in self.not_counted:
            self.not_counted.append(what)


@dataclass(frozen=True)
class _Source:
    """A profiled layer's output tensor as it reaches a consumer."""

    layer: str
    tensor_id: int
    bytes: int


@dataclass
class _Walk:
    accs: dict[str, _Acc]
    edges: list[Edge]
    warnings: list[str]


def _graph(model: Any) -> Any | None:
    """The Functional graph of ``model`` (Sequential keeps one inside), or None if subclassed."""
    if hasattr(model, "_nodes_by_depth"):
        return model
    inner = getattr(model, "_functional", None)
    return inner if inner is not None and hasattr(inner, "_nodes_by_depth") else None


def _concrete(shape: Any, batch_size: int) -> tuple[int, ...] | None:
    """``shape`` with axis 0 set to ``batch_size``; None if another axis is unknown."""
    dims = list(shape)
    if dims:
        dims[0] = batch_size
    return None if any(d is None for d in dims) else tuple(int(d) for d in dims)


def _tensor_bytes(t: Any, batch_size: int, compute_dtype: str | None) -> int | None:
    shape = _concrete(t.shape, batch_size)
    if shape is None:
        return None
    dtype = compute_dtype if compute_dtype is not None and _is_float(t.dtype) else t.dtype
    return prod(shape) * dtype_bytes(dtype)


def _walk(model: Any, batch_size: int, compute_dtype: str | None,
          input_needs_grad: list[bool] | None = None) -> _Walk:
    """Walk ``model``'s layer graph in topological order, accumulating per-layer numbers.

    ``input_needs_grad``: for a nested model, whether each of its inputs depends on a
    trainable weight of the outer model (model inputs of the outer model do not).
    """
    layers = profiled_layers(model)
    ids = {id(layer) for layer in layers}
    walk = _Walk({layer.name: _Acc() for layer in layers}, [], [])
    graph = _graph(model)
    if graph is None:
        for layer in layers:
            walk.accs[layer.name].note(
                "no layer graph (subclassed model): output shapes, activation bytes, FLOPs "
                "and inputs unknown")
        walk.warnings.append(
            f"model {model.name} is a subclassed keras.Model: only parameters and variable "
            "bytes are profiled; rewrite it as a Functional model for FLOPs and the layer graph")
        return walk
    # tensor id -> (profiled layers it comes from, whether it needs a gradient)
    info: dict[int, tuple[tuple[_Source, ...], bool]] = {}
    for i, t in enumerate(graph.inputs):
        info[id(t)] = ((), bool(input_needs_grad[i]) if input_needs_grad else False)
    outside_ops: list[str] = []
    edge_keys: set[tuple[int, str]] = set()
    for depth in sorted(graph._nodes_by_depth, reverse=True):
        for node in graph._nodes_by_depth[depth]:
            op = node.operation
            if op is None or node.is_input:
                continue
            ins = list(node.input_tensors)
            sources = tuple(s for t in ins for s in info.get(id(t), ((), False))[0])
            needs = any(info.get(id(t), ((), False))[1] for t in ins)
            out_needs = needs or bool(getattr(op, "trainable_weights", None))
            outs = list(node.outputs)
            if id(op) not in ids:  # a keras.ops call in the graph, not a layer
                outside_ops.append(getattr(op, "name", type(op).__name__))
                for t in outs:
                    info[id(t)] = (sources, needs)
                continue
            acc = walk.accs[op.name]
            acc.seen = True
            for s in sources:
                if s.layer not in acc.inputs:
                    acc.inputs.append(s.layer)
                if (s.tensor_id, op.name) not in edge_keys:
                    edge_keys.add((s.tensor_id, op.name))
                    walk.edges.append(Edge(s.layer, op.name, s.bytes))
            for t in outs:
                b = _tensor_bytes(t, batch_size, compute_dtype)
                info[id(t)] = ((_Source(op.name, id(t), b or 0),), out_needs)
            _count_call(op, ins, outs, batch_size, compute_dtype, needs, acc,
                        [info.get(id(t), ((), False))[1] for t in ins], walk.warnings)
    if outside_ops:
        walk.warnings.append(
            f"{len(outside_ops)} operation(s) called on tensors outside any layer are not "
            f"counted (FLOPs, activations): {', '.join(sorted(set(outside_ops)))}. Wrap them "
            "in a layer (e.g. keras.layers.Lambda or a custom Layer) to see them per layer.")
    return walk


def _count_call(layer: Any, ins: list[Any], outs: list[Any], batch_size: int,
                compute_dtype: str | None, needs: bool, acc: _Acc,
                per_input_needs: list[bool], warnings: list[str]) -> None:
    """Add one call of ``layer`` (one graph node) to ``acc``."""
    import keras

    out_bytes = [_tensor_bytes(t, batch_size, compute_dtype) for t in outs]
    if isinstance(layer, keras.Model):  # nested model: the sum over its own layers
        inner = _walk(layer, batch_size, compute_dtype, per_input_needs)
        warnings.extend(f"in nested model {layer.name}: {w}" for w in inner.warnings)
        for name, sub in inner.accs.items():
            acc.flops_fwd += sub.flops_fwd
            acc.flops_bwd += sub.flops_bwd
            acc.activation_bytes += sub.activation_bytes
            for what in sub.not_counted:
                acc.note(f"{name}: {what}")
        return
    if any(b is None for b in out_bytes):
        acc.note("an output shape has unknown dimensions besides the batch: activation "
                 "bytes not counted")
    acc.activation_bytes += sum(b for b in out_bytes if b is not None)
    in_shapes = [_concrete(t.shape, batch_size) for t in ins]
    out_shapes = [_concrete(t.shape, batch_size) for t in outs]
    if any(s is None for s in in_shapes + out_shapes):
        acc.note("shapes with unknown dimensions besides the batch: FLOPs not counted")
        return
    flops = layer_flops(layer, in_shapes, out_shapes, input_needs_grad=needs)
    acc.flops_fwd += flops.fwd
    acc.flops_bwd += flops.bwd
    for what in flops.not_counted:
        acc.note(what)


# --- profile ------------------------------------------------------------------------------
def _weights_bytes(weights: list[Any], per_element_factor: int = 1) -> int:
    return sum(prod(w.shape) * dtype_bytes(w.dtype) * per_element_factor for w in weights)


def _resolve_optimizer(optimizer: Any, model: Any, warnings: list[str]) -> tuple[str, int]:
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        optimizer = DEFAULT_OPTIMIZER
        warnings.append(f"no optimizer given and the model is not compiled: assuming "
                        f"{DEFAULT_OPTIMIZER} for optimizer-state bytes")
    slots = optimizer_slots(optimizer)
    if slots.warning:
        warnings.append(slots.warning)
    return slots.name, slots.slots_per_param


def _resolve_precision(model: Any, precision: str | None) -> tuple[str, str | None]:
    """(policy name for the profile, compute dtype to impose on float outputs or None)."""
    model_policy = getattr(getattr(model, "dtype_policy", None), "name", None) or "float32"
    if precision is None or precision == model_policy:
        return model_policy, None
    if precision not in PRECISIONS:
        raise PlannerError(
            f"precision {precision!r} is not a dtype policy the profiler knows; expected one "
            f"of {', '.join(PRECISIONS)} (or omit it to use the model's own policy, "
            f"{model_policy}).")
    import keras

    return precision, keras.DTypePolicy(precision).compute_dtype


def profile_model(model: Any, batch_size: int = 1, *, precision: str | None = None,
                  optimizer: Any = None, name: str | None = None) -> ModelProfile:
    """Profile a built keras.Model for ``batch_size`` samples.

    ``precision``: a dtype policy name (float32, mixed_float16, mixed_bfloat16);
    it changes activation bytes (compute dtype) but not variable bytes. Default:
    the model's own policy. ``optimizer``: a name or Keras optimizer; default the
    compiled optimizer, else adam (with a warning). ``name``: the profile's
    model_name (default ``model.name``).
    """
    import keras

    if not isinstance(model, keras.Model):
        raise ModelLoadError(f"profile_model needs a keras.Model; received "
                             f"{type(model).__module__}.{type(model).__qualname__}.")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise PlannerError(f"batch_size must be a positive integer; received {batch_size!r}.")
    if not model.built:
        raise ModelLoadError(
            f"Model {model.name} is not built, so its sizes are unknown. Give it a "
            "keras.Input, call it once on data, or use profile_source with a sample_batch.")
    warnings: list[str] = []
    policy, compute_dtype = _resolve_precision(model, precision)
    opt_name, slots = _resolve_optimizer(optimizer, model, warnings)
    walk = _walk(model, batch_size, compute_dtype)
    warnings.extend(walk.warnings)
    layers = []
    for layer in profiled_layers(model):
        acc = walk.accs[layer.name]
        if not acc.seen and _graph(model) is not None:
            acc.note("not called in the model's graph: no activations or FLOPs")
        trainable = list(layer.trainable_weights)
        layers.append(LayerProfile(
            name=layer.name, type=type(layer).__name__, params=int(layer.count_params()),
            trainable_params=sum(prod(w.shape) for w in trainable),
            param_bytes=_weights_bytes(list(layer.weights)),
            grad_bytes=_weights_bytes(trainable),
            optimizer_bytes=_weights_bytes(trainable, slots),
            activation_bytes=acc.activation_bytes, flops_fwd=acc.flops_fwd,
            flops_bwd=acc.flops_bwd, inputs=tuple(acc.inputs),
            not_counted=tuple(acc.not_counted)))
    return ModelProfile(
        model_name=name or model.name, batch_size=batch_size, precision=policy,
        optimizer=opt_name, optimizer_slots_per_param=slots, layers=tuple(layers),
        edges=tuple(walk.edges), warnings=tuple(warnings))


def profile_source(source: ModelSource, batch_size: int = 1, *, precision: str | None = None,
                   optimizer: Any = None) -> ModelProfile:
    """Build ``source`` in a fresh ``tf.Graph`` (no weights allocated) and profile it.

    ``optimizer`` defaults to the source's module-level ``optimizer``. If the
    model cannot be built in graph mode (some user code needs eager tensors),
    it is built eagerly instead and the profile carries a warning saying so.
    """
    import tensorflow as tf

    if optimizer is None:
        optimizer = source.optimizer
    try:
        with tf.Graph().as_default():
            model = build(source)
            return profile_model(model, batch_size, precision=precision, optimizer=optimizer,
                                 name=source.name)
    except PlannerError as graph_error:
        if graph_error.__cause__ is None:  # our own check (not built, bad precision...)
            raise
        reason = str(graph_error).split("\n", 1)[0]
    except Exception as graph_error:  # graph mode itself broke something: try eagerly
        reason = f"{type(graph_error).__name__}: {graph_error}"
    model = build(source)  # raises the eager error, if there is one
    profile = profile_model(model, batch_size, precision=precision, optimizer=optimizer,
                            name=source.name)
    note = (f"built eagerly (weights allocated) because building in graph mode failed: "
            f"{reason}")
    _warnings.warn(note, RuntimeWarning, stacklevel=2)
    return dataclasses.replace(profile, warnings=profile.warnings + (note,))
