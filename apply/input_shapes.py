"""Training batches against the input shapes a plan was made for.

Pipeline position: inside the wrapped models (``apply.planned_model``, ``apply.spmd``,
through ``InputShapeChecks``): every ``train_step``, ``test_step`` and ``predict_step``
of a wrapped model (so ``fit``, ``train_on_batch``, ``evaluate`` and
``predict`` in every mode) checks its batch here, once per trace. A plan records the
per-sample shape of each model input it was profiled for (``Plan.model_input_shapes``:
the model's own shape, dynamic dimensions filled by ``--input-shape`` or the model
file's ``sample_batch``); its predicted time and memory hold for those shapes only.
Where the model itself leaves a dimension dynamic, a batch of another size there is a
``PlanMismatchError`` naming the input, the planned and the received shape, and the
fix. Dimensions the model fixes are Keras' own business (it refuses them itself).

Static shapes are compared in Python when the step is traced (nothing runs per step);
only a dimension unknown until run time (a ``tf.data`` pipeline with
``padded_batch``, a generator) gets an assertion in the step, whose failure ``fit``
turns into the same error (``RUNTIME_SHAPE_CHECK``). A plan without input shapes (made
before they were recorded) checks nothing.
"""
from __future__ import annotations

import contextlib
import re
from typing import Any, Iterator, Mapping, Sequence

import keras
import tensorflow as tf

from tfplan.core.errors import PlanMismatchError
from tfplan.profiler.input_shapes import ModelInput, model_inputs, show_shape

RUNTIME_SHAPE_CHECK = "apply: input shape differs from the plan:"


def planned_inputs(model: Any, plan: Any) -> list[tuple[ModelInput, tuple[int, ...]]]:
    """(model input, planned per-sample dims) for each input of ``model`` that ``plan``
    records and that has a dynamic dimension: matched by name when every planned name
    is an input of the model (keras_hub's ``token_ids``), else by position (Keras
    generates input names per process). [] when the plan records no shapes, the model
    has no dynamic input, or the two cannot be matched."""
    recorded = tuple(getattr(plan, "model_input_shapes", ()) or ())
    if not recorded:
        return []
    try:
        _, inputs = model_inputs(model)
    except Exception:  # noqa: BLE001  (no symbolic inputs: nothing to match against)
        return []
    names = {i.name for i in inputs}
    if all(n in names for n, _ in recorded):
        dims_of = dict(recorded)
        pairs = [(i, tuple(dims_of[i.name])) for i in inputs if i.name in dims_of]
    elif len(recorded) == len(inputs):
        pairs = [(i, tuple(d)) for i, (_, d) in zip(inputs, recorded)]
    else:
        return []
    return [(i, d) for i, d in pairs if None in i.shape and len(d) == len(i.shape)]


def mismatch_error(plan_name: str, inp: ModelInput, planned: Sequence[int],
                   received: Sequence[Any], what: str) -> PlanMismatchError:
    fix = ",".join(str(d) for d in received)
    return PlanMismatchError(
        f"{what}: input {inp.name!r} has shape {show_shape(received)}, but plan "
        f"{plan_name!r} was made for {show_shape(planned)} (the model leaves "
        f"{show_shape(inp.shape)} open; its predicted time and memory hold for the planned "
        f"shape only). Feed batches of shape {show_shape(planned)} (pad or cut the "
        f"sequences), or re-plan for this shape with `plan analyze ... --input-shape "
        f"{inp.name}={fix}`.")


def check_input_shapes(model: Any, plan: Any, x: Any, what: str) -> list[Any]:
    """Check batch inputs ``x`` (arrays, tensors or TensorSpecs) against ``plan``'s input
    shapes where ``model`` leaves a dimension dynamic: PlanMismatchError for a static
    difference; for dimensions unknown until run time, the assertion ops to run before
    the step (empty in eager mode or when every dimension is known)."""
    inputs = planned_inputs(model, plan)
    if not inputs or x is None:
        return []
    _, every = model_inputs(model)
    position = {i.name: k for k, i in enumerate(every)}
    planned = dict((i.name, d) for i, d in inputs)
    if isinstance(x, Mapping):
        pairs = [(i, x[i.name]) for i, _ in inputs if i.name in x]
    else:
        leaves = keras.tree.flatten(x)
        pairs = [(i, leaves[position[i.name]]) for i, _ in inputs] \
            if len(leaves) == len(every) else []
    asserts = []
    for inp, tensor in pairs:
        shape = getattr(tensor, "shape", None)
        if shape is None:
            continue
        shape = tuple(None if d is None else int(d) for d in tuple(shape))
        if len(shape) != len(inp.shape) + 1:
            continue  # another rank: Keras refuses it with its own message
        want = planned[inp.name]
        received = shape[1:]
        for axis, (own, got, dim) in enumerate(zip(inp.shape, received, want)):
            if own is not None:
                continue
            if got is not None and got != dim:
                raise mismatch_error(getattr(plan, "name", ""), inp, want, received, what)
            if got is None and tf.is_tensor(tensor) and not tf.executing_eagerly():
                tag = "|".join([inp.name, _dims_text(inp.shape), _dims_text(want)])
                asserts.append(tf.debugging.Assert(
                    tf.equal(tf.shape(tensor)[axis + 1], dim),
                    [f"{RUNTIME_SHAPE_CHECK} {tag}", tf.shape(tensor)]))
    return asserts


def _dims_text(dims: Sequence[Any]) -> str:
    return ",".join(str(d) for d in dims)


def _dims_from(text: str) -> tuple[Any, ...]:
    return tuple(None if d == "None" else int(d) for d in text.split(",") if d)


def runtime_error(plan_name: str, message: str) -> PlanMismatchError:
    """``fit``'s PlanMismatchError for a failed run-time assertion of ``check_input_shapes``
    (TensorFlow's message: ``[<RUNTIME_SHAPE_CHECK> name|model dims|planned dims] [shape]``)."""
    match = re.search(re.escape(RUNTIME_SHAPE_CHECK) + r" ([^|\]]+)\|([^|\]]*)\|([^|\]]*)\]"
                      r"\s*\[([-\d ]*)\]", message)
    if match is None:
        return PlanMismatchError(
            f"A training batch does not have the input shape plan {plan_name!r} was made for "
            f"({message.splitlines()[0][:300]}). Feed batches of the planned shape, or re-plan "
            "for this shape with `plan analyze ... --input-shape NAME=D1,...`.")
    name, own, planned, shape = match.groups()
    received = tuple(int(d) for d in shape.split())[1:]
    return mismatch_error(plan_name, ModelInput(name, _dims_from(own), ""), _dims_from(planned),
                          received, "A batch (its shape known only at run time)")


class InputShapeChecks:
    """What a wrapped keras.Model (with ``plan``) mixes in to check its batches here:
    ``_check_input_shapes`` before data reaches a step, ``_shape_checked`` around a step,
    ``_runtime_shape_errors`` around a call that runs steps (``_checked``: both; so
    ``evaluate`` and ``predict`` here). ``_shape_model()``: the model
    whose inputs the plan's shapes are matched to (the wrapped model itself by default)."""

    def _shape_model(self) -> Any:
        return self

    def _check_input_shapes(self, x: Any, what: str) -> list[Any]:
        """PlanMismatchError if inputs ``x`` (arrays, tensors, a dataset) differ from the
        plan's input shapes where the model leaves a dimension dynamic; the run-time
        assertions for dimensions not known yet (traced steps only)."""
        if isinstance(x, tf.data.Dataset):
            x = keras.utils.unpack_x_y_sample_weight(x.element_spec)[0]
        return check_input_shapes(self._shape_model(), getattr(self, "plan", None), x, what)

    @contextlib.contextmanager
    def _shape_checked(self, data: Any, what: str) -> Iterator[None]:
        """Around a step: its batch checked first (``_check_input_shapes``)."""
        x = keras.utils.unpack_x_y_sample_weight(data)[0]
        checks = self._check_input_shapes(x, what)
        with tf.control_dependencies(checks) if checks else contextlib.nullcontext():
            yield

    @contextlib.contextmanager
    def _runtime_shape_errors(self) -> Iterator[None]:
        """A failed run-time input-shape assertion as the PlanMismatchError it stands for."""
        try:
            yield
        except tf.errors.InvalidArgumentError as e:
            if RUNTIME_SHAPE_CHECK not in str(e):
                raise
            name = getattr(self, "plan_name", "") or getattr(getattr(self, "plan", None),
                                                             "name", "")
            raise runtime_error(name, str(e)) from None

    def _checked(self, x: Any, what: str, run: Any) -> Any:
        """``run()`` (a Keras entry point that runs steps) once inputs ``x`` passed
        ``_check_input_shapes``, a failed run-time check raised as its PlanMismatchError."""
        self._check_input_shapes(x, what)
        with self._runtime_shape_errors():
            return run()

    def evaluate(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        return self._checked(x, "The data given to evaluate",
                             lambda: super(InputShapeChecks, self).evaluate(x, *args, **kwargs))

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._checked(x, "The data given to predict",
                             lambda: super(InputShapeChecks, self).predict(x, *args, **kwargs))
