"""Tracing one training step of a Keras model into TensorFlow ops, each attributed to a layer.

Pipeline position: called by ``profiler.static`` on a built model (inside
``tf.Graph().as_default()`` or eagerly: tracing never runs anything, so no
weights or activations are allocated either way). ``trace_training_step``
returns a ``Trace`` (``profiler.op_attribution``) -- per-layer FLOPs, bytes,
edges and what could not be counted -- that ``profiler.static`` turns into the
``ModelProfile``.

How (TensorFlow 2.21 / Keras 3.15):

1. ``tf.function(step).get_concrete_function(specs)`` traces ``step`` into a
   FuncGraph: the model is called on placeholders of the requested batch size
   with ``training=True``, the scalar loss is the sum of every float output
   (cast to float32), and ``tf.gradients(loss, trainable_variables)`` adds the
   backward ops. Captured variables become placeholders; nothing is run.
2. Forward ops are attributed by *when* they are created: while tracing,
   ``keras.Layer.__call__`` and ``keras.Operation.__call__`` are wrapped so that
   every call records the graph's op counter (``Graph.version``, which is the
   index of the next op in ``get_operations()``) on entry and exit. An op
   belongs to the innermost profiled layer whose call was open when it was
   created; sub-layers (MultiHeadAttention's projections) belong to their
   profiled parent; ops created by a nested model itself or by ``keras.ops``
   calls between layers belong to no layer ("outside", reported in a
   warning). This is exact where name scopes are not: Keras' scopes are
   uniquified by TensorFlow (a shared layer "dense" opens "dense_1",
   "dense_3"...), and a layer may be named like another's uniquified scope.
3. ``profiler.op_attribution`` turns the traced ops into per-layer numbers:
   gradient ops to layers, FLOPs, bytes, edges.

``skip`` lets ``profiler.repeats`` leave out identical repeated blocks: a
skipped layer's call returns its stand-in layer's outputs and creates no op.
"""
from __future__ import annotations

import bisect
import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

from tfplan.core.errors import ModelLoadError, PlannerError
from tfplan.profiler.input_shapes import model_inputs, resolve_input_shapes
from tfplan.profiler.op_attribution import LOSS, Accounting, Trace

Progress = Callable[[str, int, int], None]


@dataclass(frozen=True)
class InputSpec:
    """One model input: its name (for input edges), full shape and dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str


# --- call recording --------------------------------------------------------------------------
@dataclass
class _Call:
    key: str
    inputs: list[Any]
    outputs: list[Any]


class _Recorder:
    """Keeps the stack of open layer calls and the op-index segments they own."""

    def __init__(self, keys: Mapping[int, str], skip: Mapping[int, int],
                 progress: Progress | None, total_calls: int):
        self.keys, self.skip = keys, skip
        self.graph: Any = None
        self.stack: list[tuple[str | None, str]] = [(None, "")]
        self.segments: list[tuple[int, str | None, str]] = []
        self.calls: list[_Call] = []
        self.outputs_of: dict[int, Any] = {}
        self.progress, self.total_calls = progress, total_calls

    def _mark(self) -> None:
        owner, label = self.stack[-1]
        self.segments.append((self.graph.version, owner, label))

    def set_region(self, owner: str | None, label: str) -> None:
        self.stack = [(owner, label)]
        self._mark()

    @contextlib.contextmanager
    def call(self, operation: Any) -> Iterator[str | None]:
        key = self.keys.get(id(operation))
        top_owner, top_label = self.stack[-1]
        if key is not None:
            entry = (key, key)
        elif top_owner is not None:
            entry = (top_owner, top_label)  # a sub-layer of a profiled layer
        else:
            entry = (None, getattr(operation, "name", type(operation).__name__))
        self.stack.append(entry)
        self._mark()
        try:
            yield key
        finally:
            self.stack.pop()
            self._mark()

    def owner_of_index(self) -> Callable[[int], tuple[str | None, str]]:
        starts = [s[0] for s in self.segments]

        def lookup(index: int) -> tuple[str | None, str]:
            i = bisect.bisect_right(starts, index) - 1
            return (None, "") if i < 0 else self.segments[i][1:]
        return lookup


def _flat_tensors(structure: Any) -> list[Any]:
    import keras
    import tensorflow as tf

    return [t for t in keras.tree.flatten(structure)
            if tf.is_tensor(t) and not isinstance(t, tf.Variable)]


@contextlib.contextmanager
def _recording(rec: _Recorder) -> Iterator[None]:
    """Wrap ``Layer.__call__`` and ``Operation.__call__`` while ``rec`` traces (restored after)."""
    from keras import Layer, Operation

    layer_call, op_call = Layer.__call__, Operation.__call__

    def run(original: Callable, self: Any, args: tuple, kwargs: dict) -> Any:
        import tensorflow as tf

        if rec.graph is None or tf.compat.v1.get_default_graph() is not rec.graph:
            return original(self, *args, **kwargs)
        stand_in = rec.skip.get(id(self))
        if stand_in is not None:
            return rec.outputs_of[stand_in]
        with rec.call(self) as key:
            outputs = original(self, *args, **kwargs)
        if key is not None:
            rec.outputs_of[id(self)] = outputs  # a stand-in for skipped copies of this layer
            rec.calls.append(_Call(key, _flat_tensors((args, kwargs)), _flat_tensors(outputs)))
            if rec.progress is not None:
                rec.progress("trace", len(rec.calls), max(rec.total_calls, len(rec.calls)))
        return outputs

    def wrapped_layer_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        return run(layer_call, self, args, kwargs)

    def wrapped_op_call(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, Layer):  # Layer.__call__ reaches here through super(): recorded
            return op_call(self, *args, **kwargs)
        return run(op_call, self, args, kwargs)

    Layer.__call__, Operation.__call__ = wrapped_layer_call, wrapped_op_call
    try:
        yield
    finally:
        Layer.__call__, Operation.__call__ = layer_call, op_call


# --- tracing ---------------------------------------------------------------------------------
def model_input_specs(model: Any, batch_size: int,
                      input_shapes: Mapping[str, Sequence[int]] | None = None,
                      fallback: Mapping[str, Sequence[int]] | None = None,
                      fallback_label: str = "") -> tuple[Any, list[InputSpec]]:
    """(input structure, specs) of a Functional/Sequential model, batch axis set.

    Dynamic dimensions (None after the batch one) are filled from ``input_shapes``
    (``{input name: per-sample dims}``, ``"*"`` for every dynamic input of that rank),
    then from ``fallback`` (``profiler.input_shapes.resolve_input_shapes``). Raises
    PlannerError naming an input whose other dimensions stay unknown (and the
    ``--input-shape NAME=...`` that fills them), or a shape that does not fit the input.
    """
    structure, inputs = model_inputs(model)
    dims = resolve_input_shapes(inputs, input_shapes, fallback, fallback_label)
    return structure, [InputSpec(i.name, (batch_size,) + d, i.dtype)
                       for i, d in zip(inputs, dims)]


def trace_training_step(model: Any, keys: Mapping[int, str], structure: Any,
                        specs: Sequence[InputSpec], *, compute_dtype: str | None = None,
                        skip: Mapping[int, int] | None = None, progress: Progress | None = None,
                        total_calls: int = 0) -> Trace:
    """Trace one training step of ``model`` (see the module docstring).

    ``keys``: ``id(layer) -> name`` of the profiled layers. ``structure``/``specs``:
    the model's input structure and one spec per flattened input.
    ``compute_dtype``: if given, float tensors are priced in this dtype (a
    precision asked for that the model was not built with).
    """
    import keras
    import tensorflow as tf

    rec = _Recorder(keys, skip or {}, progress, total_calls)
    marks: dict[str, int] = {}
    holder: dict[str, Any] = {}

    def step(*flat: Any) -> None:
        graph = tf.compat.v1.get_default_graph()
        rec.graph = graph
        holder["inputs"] = list(flat)
        rec.set_region(None, "model")
        marks["fwd"] = graph.version
        with _recording(rec):
            outputs = model(keras.tree.pack_sequence_as(structure, list(flat)), training=True)
        holder["outputs"] = _flat_tensors(outputs)
        rec.set_region(LOSS, LOSS)
        marks["loss"] = graph.version
        floats = [o for o in _flat_tensors(outputs) if o.dtype.is_floating]
        loss = tf.add_n([tf.reduce_sum(tf.cast(o, tf.float32)) for o in floats]) \
            if floats else None
        marks["grad"] = graph.version
        variables = [getattr(v, "value", v) for v in model.trainable_variables]
        if loss is not None and variables:
            if progress is not None:
                progress("gradients", 0, 1)
            holder["grads"] = [g for g in tf.gradients(loss, variables) if g is not None]
            if progress is not None:
                progress("gradients", 1, 1)
        marks["end"] = graph.version

    tf_specs = [tf.TensorSpec(s.shape, s.dtype, name=_safe(s.name)) for s in specs]
    try:
        concrete = tf.function(step, autograph=False).get_concrete_function(*tf_specs)
    except PlannerError:
        raise
    except Exception as exc:
        raise ModelLoadError(
            f"Tracing a training step of model {model.name!r} on inputs "
            f"{[(s.name, s.shape, s.dtype) for s in specs]} failed with "
            f"{type(exc).__name__}: {exc}. The profiler calls the model on symbolic tensors "
            "of the batch size asked for (training=True) and differentiates it; make the "
            "model's call work on such tensors (no .numpy(), no Python branching on "
            "tensor values).") from exc
    graph = concrete.graph
    ops = graph.get_operations()
    if len(ops) != graph.version:
        raise PlannerError(
            f"internal: graph.version ({graph.version}) is not the op count ({len(ops)}); "
            "this TensorFlow version creates ops differently, so ops cannot be attributed "
            "to layers. Please report it with your TensorFlow version.")
    return Accounting(rec, ops, marks, holder["inputs"], specs, compute_dtype, progress,
                    loss_present=marks["end"] > marks["grad"],
                    outputs=holder["outputs"]).run(graph, holder.get("grads", []))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "._-" else "_" for c in name) or "input"
