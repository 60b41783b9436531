"""Static profile of a Keras model: per-layer params, bytes and FLOPs, and its layer graph.

Pipeline position: profiler stage. ``profile_source`` takes a ``ModelSource``
(``profiler.loader``), builds the model inside ``tf.Graph().as_default()`` --
where Keras allocates no weights, so models larger than this machine's memory
can be profiled -- and ``profile_model`` turns a built model into the
``ModelProfile`` the planner reads. Nothing here runs the model.

The layers are ``profiler.signature.profiled_layer_paths`` (nested models
flattened to ``outer/inner``). Per layer, for ``batch_size`` samples:

* parameters and variable bytes come from the layer's variables, each in its
  own dtype (float32 master weights under mixed precision); gradients are one
  per trainable variable; optimizer state follows ``profiler.optimizer_slots``;
* everything else comes from one traced training step (``profiler.op_graph``):
  FLOPs of the forward ops the layer creates and of their gradient ops
  (``profiler.op_flops``), output/input/saved activation bytes, the weight
  copies cast for compute, and the edges between layers;
* a ``precision`` other than the model's own policy: ``profile_source`` builds
  the model under that policy (exact); ``profile_model`` on a model built
  otherwise prices float tensors in the policy's compute dtype and estimates
  the compute weight copies as Keras' autocast rule would make them (float
  variables with ``autocast`` on, of layers with ``autocast`` on), with a warning.

Big models: with ``repeat_blocks`` (default: automatically from
``REPEAT_BLOCKS_MIN_LAYERS`` profiled layers up) identical repeated blocks are
traced once per role and their numbers copied (``profiler.repeats``).
``progress(stage, done, total)`` is called with stages ``build``, ``trace``,
``gradients`` and ``count``; nothing here prints.
"""
from __future__ import annotations

import contextlib
import dataclasses
import warnings as _warnings
from typing import Any, Callable, Iterator, Mapping, Sequence

from tfplan import compat
from tfplan.core.errors import ModelLoadError, PlannerError
from tfplan.profiler.attention_blocks import attention_block
from tfplan.profiler.input_shapes import (model_inputs, resolve_input_shapes, sample_shapes,
                                          show_shape, unresolved)
from tfplan.profiler.loader import ModelSource, build
from tfplan.profiler.model_profile import Edge, LayerProfile, ModelProfile
from tfplan.profiler.moe import apply_moe, moe_layers, suspect_warnings
from tfplan.profiler.op_attribution import Trace
from tfplan.profiler.op_flops import prod
from tfplan.profiler.op_graph import InputSpec, model_input_specs, trace_training_step
from tfplan.profiler.optimizer_slots import DEFAULT_OPTIMIZER, OptimizerSlots, optimizer_slots
from tfplan.profiler.repeats import (find_repeats, replicate_edges, skip_map, source_of,
                                     with_block_entries)
from tfplan.profiler.signature import (block_of, is_block, keras_base_type, output_shape,
                                       own_weights, profiled_layer_paths)
from tfplan.profiler.split_rules import refused_splits

PRECISIONS = ("float32", "mixed_float16", "mixed_bfloat16", "float16", "bfloat16", "float64")
REPEAT_BLOCKS_MIN_LAYERS = 200
Progress = Callable[[str, int, int], None]


def dtype_bytes(dtype: Any) -> int:
    """Bytes per element of a dtype name or object (bfloat16 included)."""
    import tensorflow as tf

    return tf.as_dtype(getattr(dtype, "name", dtype)).size


def _is_float(dtype: Any) -> bool:
    import tensorflow as tf

    return tf.as_dtype(getattr(dtype, "name", dtype)).is_floating


# --- options ------------------------------------------------------------------------------
def _resolve_optimizer(optimizer: Any, model: Any, warnings: list[str]) -> OptimizerSlots:
    if optimizer is None:
        optimizer = getattr(model, "optimizer", None)
    if optimizer is None:
        optimizer = DEFAULT_OPTIMIZER
        warnings.append(f"no optimizer given and the model is not compiled: assuming "
                        f"{DEFAULT_OPTIMIZER} for optimizer-state bytes")
    slots = optimizer_slots(optimizer)
    if slots.warning:
        warnings.append(slots.warning)
    return slots


def _check_precision(precision: str | None) -> None:
    if precision is not None and precision not in PRECISIONS:
        raise PlannerError(
            f"precision {precision!r} is not a dtype policy the profiler knows; expected one "
            f"of {', '.join(PRECISIONS)} (or omit it to use the model's own policy).")


def _resolve_precision(model: Any, precision: str | None) -> tuple[str, str | None]:
    """(policy name for the profile, compute dtype to impose on float tensors, or None)."""
    _check_precision(precision)
    model_policy = getattr(getattr(model, "dtype_policy", None), "name", None) or "float32"
    if precision is None or precision == model_policy:
        return model_policy, None
    import keras

    return precision, keras.DTypePolicy(precision).compute_dtype


def _input_specs(model: Any, batch_size: int, given: Any,
                 input_shapes: Mapping[str, Sequence[int]] | None = None
                 ) -> tuple[Any, list[InputSpec]]:
    if given is None:
        return model_input_specs(model, batch_size, input_shapes)
    if input_shapes:
        raise PlannerError(
            f"input_shapes {dict(input_shapes)!r} were given for model {model.name!r}, which "
            "has no symbolic inputs (a subclassed model): its input shapes come from the "
            "input example (the model file's sample_batch). Drop --input-shape / "
            "input_shapes, or make the sample batch of the shape you want.")
    import keras
    import numpy as np

    specs = []
    for i, x in enumerate(keras.tree.flatten(given)):
        shape = (batch_size,) + tuple(int(d) for d in np.shape(x)[1:])
        specs.append(InputSpec(f"input_{i}" if i else "input", shape,
                               keras.backend.standardize_dtype(getattr(x, "dtype", "float32"))))
    return given, specs


# --- profile ------------------------------------------------------------------------------
def profile_model(model: Any, batch_size: int = 1, *, precision: str | None = None,
                  optimizer: Any = None, name: str | None = None,
                  progress: Progress | None = None, input_example: Any = None,
                  repeat_blocks: bool | None = None,
                  input_shapes: Mapping[str, Sequence[int]] | None = None) -> ModelProfile:
    """Profile a built keras.Model for ``batch_size`` samples (see the module docstring).

    ``precision``: a dtype policy name (float32, mixed_float16, mixed_bfloat16);
    default the model's own. ``optimizer``: a name or Keras optimizer; default the
    compiled optimizer, else adam (with a warning). ``name``: the profile's
    model_name (default ``model.name``). ``input_example``: a batch of inputs (any
    batch size) giving the input structure, shapes and dtypes of a model that
    has no symbolic inputs (a subclassed model). ``repeat_blocks``: trace
    identical repeated blocks once (None: only for models of at least
    ``REPEAT_BLOCKS_MIN_LAYERS`` layers). ``input_shapes``: ``{input name: per-sample
    dims}`` for inputs with dynamic dimensions (``"*"``: every such input of that rank;
    ``profiler.input_shapes``); recorded as ``ModelProfile.input_shapes``.
    """
    return profile_and_trace(model, batch_size, precision=precision, optimizer=optimizer,
                             name=name, progress=progress, input_example=input_example,
                             repeat_blocks=repeat_blocks, input_shapes=input_shapes)[0]


def profile_and_trace(model: Any, batch_size: int = 1, *, precision: str | None = None,
                      optimizer: Any = None, name: str | None = None,
                      progress: Progress | None = None, input_example: Any = None,
                      repeat_blocks: bool | None = None,
                      input_shapes: Mapping[str, Sequence[int]] | None = None
                      ) -> tuple[ModelProfile, Trace]:
    """``profile_model``, plus the ``Trace`` it was made from (every op, its layer and count).

    For tests and tools that compare op by op (e.g. with TensorFlow's own profiler on
    ``trace.graph``).
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
    policy, override = _resolve_precision(model, precision)
    slots = _resolve_optimizer(optimizer, model, warnings)
    paths = profiled_layer_paths(model, warnings)
    layer_of = {key: layer for key, layer in paths}
    functional = _has_graph(model)
    if not functional:
        warnings.append(
            f"model {model.name} is a subclassed keras.Model with no layer graph: its layers "
            "are its tracked sub-layers in attribute order, each op is charged to the "
            "sub-layer whose call created it, and ops its own call() makes between them are "
            "counted nowhere (see the next warnings); edges that point backwards in that "
            "order are left out. Write it as a Functional model for a plannable graph.")
    runs = []
    if repeat_blocks or (repeat_blocks is None and len(paths) >= REPEAT_BLOCKS_MIN_LAYERS):
        runs = with_block_entries(find_repeats(model), [key for key, _ in paths])
    structure, specs = _input_specs(model, batch_size, input_example, input_shapes)
    total_calls = sum(max(1, len(compat.inbound_nodes(layer))) for _, layer in paths)
    trace = trace_training_step(
        model, {id(layer): key for key, layer in paths}, structure, specs,
        compute_dtype=override, skip=skip_map(runs, layer_of), progress=progress,
        total_calls=total_calls)
    if runs:
        warnings.append(
            "repeated blocks traced once: " + "; ".join(
                f"{len(r.blocks)} identical blocks of {len(r.blocks[0])} layers "
                f"({r.blocks[0][0]}..{r.blocks[-1][-1]}): the first 3 traced, the other "
                f"{len(r.blocks) - 3} take the numbers of the 2nd (middle blocks) and the 3rd "
                "(the last block)" for r in runs))
    warnings.extend(_trace_warnings(trace))
    if override is not None:
        warnings.append(
            f"precision {precision} differs from the policy model {model.name} was built with "
            f"({getattr(model.dtype_policy, 'name', '?')}): activations are priced in "
            f"{override} and the compute weight copies estimated; build the model under that "
            "policy (profile_source does) for exact numbers.")
    sources = source_of(runs)
    blocks = block_of(paths)
    layers = []
    for key, layer in paths:
        src = sources.get(key, key)
        got = trace.layers[src]
        not_counted = [f"(as {src}) {w}" if src != key else w for w in got.not_counted]
        if got.calls == 0:
            not_counted.append("not called in the model's training step: no activations or "
                               "FLOPs")
        layers.append(_layer_profile(key, layer, got, not_counted, slots, override,
                                     blocks.get(key, "")))
    layers = _with_moe(layers, paths, trace, sources, override, warnings)
    names = [key for key, _ in paths]
    edges = _edges(replicate_edges(runs, trace.edges), names, functional)
    inputs = {key: [] for key in names}
    for e in edges:
        if e.src in inputs and e.src not in inputs[e.dst]:
            inputs[e.dst].append(e.src)
    layers = [dataclasses.replace(l, inputs=tuple(inputs[l.name])) for l in layers]
    return ModelProfile(
        model_name=name or model.name, batch_size=batch_size, precision=policy,
        optimizer=slots.name, optimizer_slots_per_param=slots.slots_per_param,
        layers=tuple(layers), edges=tuple(edges), warnings=tuple(warnings),
        input_shapes=tuple((s.name, tuple(s.shape[1:])) for s in specs)), trace


def _with_moe(layers: list[LayerProfile], paths: list[tuple[str, Any]], trace: Trace,
              sources: Mapping[str, str], override: str | None, warnings: list[str]
              ) -> list[LayerProfile]:
    """``layers`` with the mixtures of experts priced by their routed work
    (``profiler.moe``); its warnings go to ``warnings``."""
    found, missing = moe_layers(paths)
    if not (found or missing):
        return layers
    by_key, notes = apply_moe({l.name: l for l in layers}, found, trace, sources,
                              dtype_bytes(override) if override else None)
    warnings.extend(notes + suspect_warnings(missing, trace, sources))
    return [by_key[l.name] for l in layers]


def _has_graph(model: Any) -> bool:
    return compat.has_layer_graph(model)


def _layer_profile(key: str, layer: Any, got: Any, not_counted: list[str],
                   slots: OptimizerSlots, override: str | None, block: str = ""
                   ) -> LayerProfile:
    attention = attention_block(layer)
    weights = own_weights(layer)  # a block's sub-layers have entries of their own
    trainable_ids = {id(w) for w in layer.trainable_weights}
    trainable = [w for w in weights if id(w) in trainable_ids]
    compute = got.compute_weight_bytes
    if override is not None:  # Keras' autocast rule, as if the model had been built so
        compute = 0
        if getattr(layer, "autocast", True):
            compute = sum(prod(w.shape) * dtype_bytes(override) for w in weights
                          if _is_float(w.dtype) and getattr(w, "autocast", True)
                          and dtype_bytes(w.dtype) != dtype_bytes(override))
    return LayerProfile(
        name=key, type=type(layer).__name__, params=sum(prod(w.shape) for w in weights),
        trainable_params=sum(prod(w.shape) for w in trainable),
        param_bytes=sum(prod(w.shape) * dtype_bytes(w.dtype) for w in weights),
        trainable_param_bytes=sum(prod(w.shape) * dtype_bytes(w.dtype) for w in trainable),
        grad_bytes=sum(prod(w.shape) * dtype_bytes(w.dtype) for w in trainable),
        optimizer_bytes=sum(slots.state_bytes(w.shape, dtype_bytes(w.dtype)) for w in trainable),
        compute_weight_bytes=compute, activation_bytes=got.output_bytes,
        activation_saved_bytes=got.saved_bytes, input_bytes=got.input_bytes,
        float_input_bytes=got.float_input_bytes,
        flops_fwd=got.flops_fwd, flops_bwd=got.flops_bwd, not_counted=tuple(not_counted),
        calls=got.calls, matmul_flops_fwd=got.matmul_flops_fwd,
        matmul_flops_bwd=got.matmul_flops_bwd, memory_traffic_bytes_fwd=got.traffic_bytes_fwd,
        memory_traffic_bytes_bwd=got.traffic_bytes_bwd, groups=_groups(layer),
        output_shape=output_shape(layer),
        attention_core_flops_fwd=got.attention_core_flops_fwd,
        attention_core_saved_bytes=got.attention_core_saved_bytes,
        attention_kv_bytes=got.attention_kv_bytes, attention_kv_heads=_kv_heads(layer),
        attention_heads=attention.query_heads if attention else 0,
        refused_splits=refused_splits(layer, attention_block=attention is not None),
        base_type=_base_type(layer), block=block, opaque=_opaque(layer, weights, got))


def _base_type(layer: Any) -> str:
    base = keras_base_type(layer)
    return base if base and base != type(layer).__name__ else ""


def _opaque(layer: Any, weights: Sequence[Any], got: Any) -> str:
    """Why the planner cannot see into ``layer`` ("" if it can): a layer that is not
    Keras' own and multiplies weights it holds itself (not through sub-layers)."""
    if keras_base_type(layer) is not None:
        return ""
    matrices = [w for w in weights if len(w.shape) >= 2]
    if not matrices or not (got.matmul_flops_fwd or got.matmul_flops_bwd):
        return ""
    kind = "block" if is_block(layer) else "layer"
    return (f"custom {kind} {type(layer).__name__} multiplies weights it holds itself "
            f"({', '.join(getattr(w, 'path', w.name) for w in matrices[:3])}) instead of "
            "through Keras layers (Dense, EinsumDense, MultiHeadAttention, Embedding, Conv): "
            "no tensor-parallel split is known for them, so it stays whole (replicated)")


def _kv_heads(layer: Any) -> int:
    """Key/value heads of Keras' attention layers (and their subclasses) and of custom
    attention blocks (``profiler.attention_blocks``); 0 elsewhere."""
    import keras

    attention = attention_block(layer)
    if attention is not None:
        return attention.kv_heads
    if isinstance(layer, keras.layers.GroupQueryAttention):
        return int(layer.num_key_value_heads)
    if isinstance(layer, keras.layers.MultiHeadAttention):
        return int(layer.num_heads)
    return 0


def _groups(layer: Any) -> int:
    """A convolution's ``groups`` (Keras' Conv1D/2D/3D and transposes); 1 otherwise."""
    groups = getattr(layer, "groups", 1) if hasattr(layer, "kernel_size") else 1
    return groups if isinstance(groups, int) and groups >= 1 else 1


def _edges(raw: Sequence[tuple[str, str, int]], names: list[str], functional: bool
           ) -> list[Edge]:
    position = {n: i for i, n in enumerate(names)}
    edges = [Edge(src, dst, nbytes) for src, dst, nbytes in raw
             if functional or src not in position or position[src] < position[dst]]
    return sorted(edges, key=lambda e: (position[e.dst], position.get(e.src, -1)))


def _trace_warnings(trace: Trace) -> list[str]:
    out = []
    if trace.outside:
        parts = [f"{label}: " + ", ".join(what[:3]) + (f" and {len(what) - 3} more"
                                                       if len(what) > 3 else "")
                 for label, what in sorted(trace.outside.items())]
        out.append(
            f"{sum(len(w) for w in trace.outside.values())} op(s) created outside any layer "
            "(by keras.ops calls between layers or a model's own call) are not counted in any "
            "layer: " + "; ".join(parts) + ". Wrap them in a layer (e.g. a custom Layer) to "
            "see them per layer.")
    for name, owner, why in trace.unknown_loops:
        out.append(f"While loop {name} ({'layer ' + owner if owner else 'outside any layer'}):"
                   f" {why}; its FLOPs are not counted (listed under not_counted). Give the "
                   "loop a static length (a fixed sequence length, maximum_iterations with a "
                   "counter condition) to count it.")
    if not trace.has_backward:
        out.append("the model has no float output or no trainable weight: no backward pass "
                   "was traced (flops_bwd and saved activations are 0)")
    return out


# --- from a model source ------------------------------------------------------------------
@contextlib.contextmanager
def _global_policy(precision: str | None) -> Iterator[None]:
    if precision is None:
        yield
        return
    import keras

    before = keras.config.dtype_policy()
    keras.config.set_dtype_policy(precision)
    try:
        yield
    finally:
        keras.config.set_dtype_policy(before)


def profile_source(source: ModelSource, batch_size: int = 1, *, precision: str | None = None,
                   optimizer: Any = None, progress: Progress | None = None,
                   repeat_blocks: bool | None = None,
                   input_shapes: Mapping[str, Sequence[int]] | None = None) -> ModelProfile:
    """Build ``source`` in a fresh ``tf.Graph`` (no weights allocated) and profile it.

    ``precision``: the model is built under that Keras dtype policy, so its
    casts and activation dtypes are the real ones. ``optimizer`` defaults to the
    source's module-level ``optimizer``. If the model cannot be built in graph
    mode (some user code needs eager tensors), it is built eagerly instead and
    the profile carries a warning saying so. ``input_shapes``: as ``profile_model``'s;
    a dynamic input it leaves open takes its dimensions from the source's
    ``sample_batch`` (by name for a dict batch, by position otherwise), with a warning.
    """
    import tensorflow as tf

    _check_precision(precision)
    if optimizer is None:
        optimizer = source.optimizer

    def sample_x() -> Any:
        try:
            batch = source.sample_batch(1)
        except Exception as exc:
            raise ModelLoadError(
                f"sample_batch(1) of {source.origin} raised {type(exc).__name__}: {exc}. Fix "
                "it, or give the input shapes with --input-shape NAME=D1,... (input_shapes) "
                "instead.") from exc
        return batch[0] if isinstance(batch, (tuple, list)) else batch

    def example() -> Any:
        if source.sample_batch is None:
            return None
        return sample_x()

    def built() -> Any:
        if progress is not None:
            progress("build", 0, 1)
        with _global_policy(precision):
            model = build(source)
        if progress is not None:
            progress("build", 1, 1)
        return model

    def shapes_for(model: Any) -> tuple[Mapping[str, Sequence[int]] | None, str | None]:
        """(input shapes to profile with, a warning if some came from sample_batch)."""
        _, inputs = model_inputs(model)
        missing = unresolved(inputs, input_shapes)
        if not missing or source.sample_batch is None:
            return input_shapes, None
        sampled = sample_shapes(inputs, sample_x())
        fallback = {i.name: sampled[i.name] for i in missing if i.name in sampled}
        if not fallback:
            return input_shapes, None
        label = "sample_batch(1)[0]"
        dims = resolve_input_shapes(inputs, input_shapes, fallback, label)
        note = ("input shapes taken from the model file's sample_batch (no --input-shape / "
                "input_shapes for them): " + ", ".join(
                    f"{n} {show_shape(fallback[n])}" for n in fallback)
                + "; the profile and plan are for these shapes. Give --input-shape "
                "NAME=D1,... to plan for others.")
        return {i.name: d for i, d in zip(inputs, dims)}, note

    def profiled(model: Any) -> ModelProfile:
        has_inputs = _has_inputs(model)
        given = None if has_inputs else example()
        shapes, note = shapes_for(model) if has_inputs else (input_shapes, None)
        profile = profile_model(model, batch_size, precision=precision, optimizer=optimizer,
                                name=source.name, progress=progress, input_example=given,
                                repeat_blocks=repeat_blocks, input_shapes=shapes)
        if note is None:
            return profile
        return dataclasses.replace(profile, warnings=profile.warnings + (note,))

    with tf.Graph().as_default():
        try:
            model = built()
        except PlannerError as graph_error:
            if graph_error.__cause__ is None:  # our own check (not built...)
                raise
            reason = str(graph_error).split("\n", 1)[0]
        except Exception as graph_error:  # graph mode itself broke something: try eagerly
            reason = f"{type(graph_error).__name__}: {graph_error}"
        else:  # built without weights: profile it here (errors from now on are real)
            return profiled(model)
    profile = profiled(built())  # eagerly; raises the eager error, if there is one
    note = (f"built eagerly (weights allocated) because building in graph mode failed: "
            f"{reason}")
    _warnings.warn(note, RuntimeWarning, stacklevel=2)
    return dataclasses.replace(profile, warnings=profile.warnings + (note,))


def _has_inputs(model: Any) -> bool:
    for holder in (compat.inner_functional(model), model):
        try:
            if holder is not None and holder.input is not None:
                return True
        except (AttributeError, ValueError):
            continue
    return False
