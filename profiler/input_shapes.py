"""The model's inputs and the shapes the user states for their dynamic dimensions.

Pipeline position: the first step of ``profiler.op_graph.model_input_specs`` (the shapes
a training step is traced with), and of ``profiler.static.profile_source``'s fallback
to the model file's ``sample_batch``. Counting FLOPs and bytes exactly needs every
dimension but the batch one; keras_hub backbones (and any ``keras.Input(shape=(None,))``)
leave the sequence length open. ``resolve_input_shapes`` fills those dimensions from
``input_shapes`` -- ``{input name: per-sample dims}`` (``plan ... --input-shape
NAME=D1,D2``), ``"*"`` meaning every input still dynamic whose rank matches -- and
refuses what cannot be right (an unknown name, a wrong rank, a dimension that
contradicts the model's own, a dimension below 1, a dynamic input left open) with a
``PlannerError`` that lists the model's inputs. The resolved shapes are recorded in the
profile (``ModelProfile.input_shapes``) and the plan, and ``apply`` checks training
batches against them. Imports no TensorFlow at module level.
"""
from __future__ import annotations

import numbers
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from tfplan import compat
from tfplan.core.errors import ModelLoadError, PlannerError

WILDCARD = "*"  # input_shapes key: every input still dynamic whose rank matches
Dims = tuple  # per-sample dimensions (the batch one dropped): ints, None for dynamic


@dataclass(frozen=True)
class ModelInput:
    """One symbolic input of a model: its name (the InputLayer's), per-sample shape
    (None for a dynamic dimension) and dtype name."""

    name: str
    shape: Dims
    dtype: str


def show_shape(shape: Sequence[Any], batch: bool = True) -> str:
    """``(batch, None, 16)``: a shape as the messages write it."""
    dims = [str(d) for d in shape]
    return "(" + ", ".join((["batch"] if batch else []) + dims) + \
        ("," if len(dims) == 1 and not batch else "") + ")"


def flag_for(inp: ModelInput) -> str:
    """The ``--input-shape`` flag that fills ``inp``'s dynamic dimensions (a placeholder
    ``N`` for each, the model's fixed dimensions as they are)."""
    dims = ",".join("N" if d is None else str(d) for d in inp.shape)
    return f"--input-shape {inp.name}={dims}"


def model_inputs(model: Any) -> tuple[Any, list[ModelInput]]:
    """(input structure, one ``ModelInput`` per flattened input) of a Functional or
    Sequential model; ModelLoadError for a model with no symbolic inputs."""
    import keras

    structure = None
    for holder in (compat.inner_functional(model), model):  # Sequential keeps one inside
        try:
            structure = holder.input if holder is not None else None
        except (AttributeError, ValueError):
            structure = None
        if structure is not None:
            break
    if structure is None:
        raise ModelLoadError(
            f"Model {model.name!r} has no symbolic inputs (a subclassed model built by calling "
            "it), so the profiler cannot tell its input shapes. Pass input_example (a batch "
            "of inputs) to profile_model, or profile it with profile_source from a model file "
            "that defines sample_batch(batch_size).")
    inputs = []
    for i, t in enumerate(keras.tree.flatten(structure)):
        history = compat.keras_history(t)  # the InputLayer names the input
        name = getattr(getattr(history, "operation", None), "name", None) or \
            getattr(t, "name", None) or f"input_{i}"
        shape = tuple(None if d is None else int(d) for d in tuple(t.shape)[1:])
        inputs.append(ModelInput(name, shape, keras.backend.standardize_dtype(t.dtype)))
    return structure, inputs


def listing(inputs: Sequence[ModelInput]) -> str:
    """The model's inputs for an error message: ``token_ids (batch, None)``, ..."""
    return ", ".join(f"{i.name} {show_shape(i.shape)}" for i in inputs)


def _dims(value: Any, what: str, inputs: Sequence[ModelInput]) -> tuple[int, ...]:
    try:
        dims = tuple(value)
    except TypeError:
        dims = (value,)
    if not dims or not all(isinstance(d, numbers.Integral) and not isinstance(d, bool)
                           and d >= 1 for d in dims):
        raise PlannerError(
            f"{what} has dimensions {dims!r}; expected one or more whole numbers >= 1, the "
            "input's dimensions after the batch one (e.g. --input-shape token_ids=128). "
            f"The model's inputs: {listing(inputs)}.")
    return tuple(int(d) for d in dims)


def _fill(inp: ModelInput, dims: tuple[int, ...], what: str,
          inputs: Sequence[ModelInput]) -> tuple[int, ...]:
    """``dims`` checked against ``inp``: the same rank, the model's fixed dimensions kept."""
    if len(dims) != len(inp.shape):
        example = ",".join("N" if d is None else str(d) for d in inp.shape) or "(none)"
        raise PlannerError(
            f"{what} gives {len(dims)} dimension(s) {show_shape(dims, batch=False)}, but "
            f"input {inp.name!r} has shape {show_shape(inp.shape)}: {len(inp.shape)} "
            f"dimension(s) after the batch one. Give exactly those, e.g. --input-shape "
            f"{inp.name}={example} (N for your size). The model's inputs: {listing(inputs)}.")
    for axis, (have, want) in enumerate(zip(inp.shape, dims)):
        if have is not None and have != want:
            fixed = ",".join(str(g if d is None else d) for d, g in zip(inp.shape, dims))
            raise PlannerError(
                f"{what} sets dimension {axis + 1} of input {inp.name!r} to {want}, but the "
                f"model fixes it to {have} (shape {show_shape(inp.shape)}). Only dynamic "
                f"(None) dimensions can be chosen; keep the fixed ones, e.g. --input-shape "
                f"{inp.name}={fixed}.")
    return dims


def resolve_input_shapes(inputs: Sequence[ModelInput],
                         input_shapes: Mapping[str, Sequence[int]] | None = None,
                         fallback: Mapping[str, Sequence[int]] | None = None,
                         fallback_label: str = "") -> tuple[tuple[int, ...], ...]:
    """Per input (in ``inputs``' order), its per-sample dimensions, every one known.

    ``input_shapes``: ``{name: dims}`` the user stated (``"*"``: every input still
    dynamic whose rank matches); ``fallback``: ``{name: dims}`` to take the remaining
    dynamic dimensions from (``profile_source``: the model file's ``sample_batch``),
    described as ``fallback_label`` in messages. PlannerError (see the module
    docstring) when a name is unknown, a rank or a fixed dimension disagrees, a
    dimension is below 1, ``"*"`` matches nothing, or an input stays dynamic.
    """
    given = dict(input_shapes or {})
    names = {i.name for i in inputs}
    unknown = [n for n in given if n != WILDCARD and n not in names]
    if unknown:
        raise PlannerError(
            f"--input-shape names input {unknown[0]!r}, which the model does not have. Its "
            f"inputs are: {listing(inputs)}. Name one of those (or use "
            f"--input-shape '*=D1,...' for every dynamic input of that rank).")
    resolved: list[Any] = []
    for inp in inputs:
        if inp.name in given:
            what = f"--input-shape {inp.name}=" + ",".join(map(str, _as_list(given[inp.name])))
            resolved.append(_fill(inp, _dims(given[inp.name], what, inputs), what, inputs))
        else:
            resolved.append(None)
    if WILDCARD in given:
        dims = _dims(given[WILDCARD], f"--input-shape '*='", inputs)
        what = "--input-shape '*=" + ",".join(map(str, dims)) + "'"
        matched = [k for k, inp in enumerate(inputs) if resolved[k] is None
                   and None in inp.shape and len(inp.shape) == len(dims)]
        if not matched:
            raise PlannerError(
                f"{what} matches no input: it fills the inputs left dynamic (None) whose "
                f"rank is {len(dims)}, and there are none. The model's inputs: "
                f"{listing(inputs)}. Name the input instead (--input-shape NAME=D1,...).")
        for k in matched:
            resolved[k] = _fill(inputs[k], dims, what, inputs)
    for k, inp in enumerate(inputs):
        if resolved[k] is None and None in inp.shape and fallback and inp.name in fallback:
            what = f"{fallback_label or 'the fallback shape'} for input {inp.name!r}"
            resolved[k] = _fill(inp, _dims(fallback[inp.name], what, inputs), what, inputs)
    for k, inp in enumerate(inputs):
        if resolved[k] is None:
            if None in inp.shape:
                raise PlannerError(
                    f"Model input {inp.name!r} has shape {(None,) + tuple(inp.shape)}: the "
                    "profiler needs every dimension but the batch to count FLOPs and bytes "
                    "exactly, and no shape was given for it. Add `" + flag_for(inp) + "` (N: "
                    "the size you train with, e.g. the sequence length; '*=N' fills every such "
                    "input), "
                    f"pass input_shapes={{{inp.name!r}: {_template(inp)}}} to profile_model / "
                    "profile_source, define sample_batch(batch_size) in the model file, or "
                    "give keras.Input a fixed shape. The model's inputs: "
                    f"{listing(inputs)}.")
            resolved[k] = tuple(inp.shape)
    return tuple(tuple(int(d) for d in dims) for dims in resolved)


def _template(inp: ModelInput) -> str:
    return show_shape(["N" if d is None else d for d in inp.shape], batch=False)


def _as_list(value: Any) -> list[Any]:
    try:
        return list(value)
    except TypeError:
        return [value]


def sample_shapes(inputs: Sequence[ModelInput], x: Any) -> dict[str, tuple[int, ...]]:
    """``{input name: per-sample dims}`` of a sample batch's inputs ``x``: by input name
    for a dict, by position otherwise (the model's flattened input order). Inputs the
    batch does not give, or gives with an unknown dimension, are left out."""
    import keras
    import numpy as np

    if isinstance(x, Mapping):
        by_name = {str(k): v for k, v in x.items()}
        pairs = [(i.name, by_name[i.name]) for i in inputs if i.name in by_name]
    else:
        leaves = keras.tree.flatten(x)
        if len(leaves) != len(inputs):
            return {}
        pairs = [(i.name, leaf) for i, leaf in zip(inputs, leaves)]
    out = {}
    for name, array in pairs:
        shape = getattr(array, "shape", None)
        shape = tuple(shape) if shape is not None else np.shape(array)
        dims = tuple(shape)[1:]
        if all(isinstance(d, (int, np.integer)) and d >= 1 for d in dims) and len(shape) >= 1:
            out[name] = tuple(int(d) for d in dims)
    return out


def unresolved(inputs: Sequence[ModelInput],
               input_shapes: Mapping[str, Sequence[int]] | None) -> list[ModelInput]:
    """The inputs with a dynamic dimension that ``input_shapes`` leaves open (neither
    named nor matched by ``"*"``)."""
    given = dict(input_shapes or {})
    wildcard = given.get(WILDCARD)
    rank = len(_as_list(wildcard)) if wildcard is not None else None
    return [i for i in inputs if None in i.shape and i.name not in given
            and len(i.shape) != rank]


def check_sample_batch(input_shapes: Sequence[tuple[str, Sequence[int]]], batch: Any,
                       why: str) -> None:
    """PlannerError when ``batch`` (``sample_batch``'s ``(x, y)`` or ``x``) has other
    per-sample input shapes than ``input_shapes`` (``ModelProfile.input_shapes``): its
    inputs by name for a dict, by position otherwise. ``why``: what uses the batch."""
    if not input_shapes:
        return
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    inputs = [ModelInput(n, tuple(d), "") for n, d in input_shapes]
    got = sample_shapes(inputs, x)
    wrong = [(i.name, i.shape, got[i.name]) for i in inputs
             if i.name in got and tuple(got[i.name]) != tuple(i.shape)]
    if wrong:
        name, want, have = wrong[0]
        raise PlannerError(
            f"{why}, whose input {name!r} has shape {show_shape(have)}, but the profile is for "
            f"{show_shape(want)} (--input-shape): the measured times would be for other "
            f"shapes. Make sample_batch return {show_shape(want)} for {name!r}, or drop "
            "--input-shape to profile the sample batch's shapes.")
