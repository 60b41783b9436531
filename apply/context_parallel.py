"""Context-parallel plans: every sample's sequence cut over ``cp`` ranks holding the same
weights, attention exchanging keys and values between them.

Pipeline position: ``apply.wrap`` calls ``wrap_context_parallel`` for a plan with
``strategy.cp > 1`` (``apply.mode``: mode ``context_parallel``, one host, tp = pp = 1).
The stage lists ``dp * cp`` devices, ``devices[r * cp + c]`` being context rank c of
data-parallel replica r (``planner.plan``: ``devices[(r * cp + c) * tp + t]``).

* The model is checked first (``apply.context_layers``): only layers that act on each
  position alone, and attention, run on a chunk of the sequence; anything else (Flatten,
  pooling, Conv1D, a position embedding, an output without the sequence axis) is refused
  naming the layer. A static sequence length must be a multiple of cp.
* Copies: one copy of the model per (replica r, rank c), built and run on its device
  ``devices[r * cp + c]``, all with the user's weights (``apply.tensor_parallel``'s
  ``TensorParallelModel`` holds them: copy 0 is the model returned, the others ride
  along out of Keras' sight).
* Forward: each (micro-)batch is cut in dp parts along the batch axis and each part in
  cp chunks along axis 1 of every input; the copies run layer by layer together
  (``compat.run_graph`` with one value per copy), each operation of copy (r, c) on its
  chunk and device, each attention layer over its replica's group
  (``context_layers.group_attention``: an all-gather of the projected keys and values
  with the causal mask at global positions).
* Loss: each copy computes the compiled loss of its chunk (targets and per-position
  sample weights cut the same way) on its device; the step's loss is their mean
  weighted by positions (every chunk holds the same number; with a Keras padding mask
  on the output, its unmasked positions), which is the whole batch's per-position mean
  (Keras' ``sum_over_batch_size`` reduction: other reductions are refused at
  ``compile``). Metrics see the outputs joined back, with their mask.
* Gradients: every copy's weights get the sum of all dp * cp copies' gradients
  (``TensorParallelModel._apply_gradients``: a placed ``add_n`` on each copy's device),
  so the copies stay equal and train as one device.
* ``model(x)``, ``predict``, ``evaluate``: replica 0's cp copies run the whole batch,
  each on its chunk (the same context-parallel forward pass).
* Recomputation (``strategy.recompute``): the chosen layers run under
  ``tf.recompute_grad`` per chunk; for attention, each rank's local part (query
  projection, attention over the gathered keys and values, output projection).
* Batches: every sequence length must be a multiple of cp (PlanMismatchError before a
  step, or from ``fit`` when the length is known only as it runs).

Not applied (refused with what to change): cp with tp, pp or ZeRO, cp across worker
processes (``apply.dimensions``), ``GroupedQueryAttention`` and an explicit
``attention_mask`` (``apply.context_layers``).
"""
from __future__ import annotations

from typing import Any, Collection, Sequence

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.apply.cloning import clone_graph, copy_weights
from tfplan.apply.context_layers import ATTENTION, check_context_parallel_model, group_attention
from tfplan.apply.joint_forward import Parts
from tfplan.apply.recompute import recompute_call
from tfplan.apply.tensor_parallel import TensorParallelModel
from tfplan.core.errors import PlanMismatchError, PlannerError
from tfplan.planner.plan import Plan

PER_POSITION_REDUCTIONS = ("sum_over_batch_size", "mean")  # mean: Keras 2's name
SEQUENCE_CHECK = "apply: sequence length not a multiple of cp:"


@keras.saving.register_keras_serializable(package="tfplan")
class ContextParallelModel(TensorParallelModel):
    """Copy (0, 0) of a context-parallel model, holding the other dp * cp - 1 copies (see
    the module docstring)."""

    def __init__(self, inputs: Any, outputs: Any, name: str | None = None,
                 **kwargs: Any) -> None:
        super().__init__(inputs, outputs, name=name, **kwargs)
        self.cp = 1  # copy 0 gets the plan's cp (wrap_context_parallel); the others run chunks

    # --- forward --------------------------------------------------------------------------
    def call(self, inputs: Any, training: Any = None, mask: Any = None, **kwargs: Any) -> Any:
        if len(self.replica_models()) < self.cp or mask is not None or kwargs:
            return super().call(inputs, training=training, mask=mask, **kwargs)
        with tf.control_dependencies(self._length_checks(inputs)):
            outputs = self._copies_forward(self._chunks(inputs, 1), training)
        with tf.device(self.output_device):  # the whole sequence, where copy 0 is
            return _join(outputs)

    def _length_checks(self, x: Any) -> list[Any]:
        """PlanMismatchError for a batch whose static sequence length cp does not divide;
        for an unknown length, the assertion to run before cutting it."""
        first = compat.standardize_functional_inputs(self, x)[0]
        seq = first.shape[1]
        if seq is not None:
            if seq % self.cp:
                raise self._sequence_error(int(seq))
            return []
        n = tf.shape(first)[1]
        return [tf.debugging.Assert(tf.equal(n % self.cp, 0), [SEQUENCE_CHECK, n])]

    def _chunks(self, x: Any, dp: int) -> list[Any]:
        """``x`` (one batch, flat in ``self.inputs`` order) in dp x cp parts: part
        ``r * cp + c`` is replica r's slice of the batch, chunk c of the sequence."""
        pieces = [[c for r in tf.split(t, dp, axis=0) for c in tf.split(r, self.cp, axis=1)]
                  for t in compat.standardize_functional_inputs(self, x)]
        return [[piece[p] for piece in pieces] for p in range(dp * self.cp)]

    # --- every batch's sequence length must be a multiple of cp -----------------------------
    def _check_sequence(self, x: Any) -> None:
        if isinstance(x, tf.data.Dataset):
            x = x.element_spec
        try:
            leaves = keras.tree.flatten(x)
        except (TypeError, ValueError):  # a generator or PyDataset: checked when traced
            return
        for leaf in leaves:
            shape = getattr(leaf, "shape", None)
            if shape is not None and len(shape) >= 2 and shape[1] is not None \
                    and int(shape[1]) % self.cp:
                raise self._sequence_error(int(shape[1]))

    def _check_fit_input(self, x: Any, *args: Any) -> None:
        super()._check_fit_input(x, *args)
        self._check_sequence(x)

    def fit(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().fit(x, y, *args, **kwargs)
        except tf.errors.InvalidArgumentError as e:  # the step's check (unknown lengths)
            if SEQUENCE_CHECK not in str(e):
                raise
            raise PlanMismatchError(
                f"A training batch from {type(x).__name__} input has a sequence length that "
                f"is not a multiple of cp={self.cp} (plan {self.plan_name!r}); no update was "
                "applied for it. Pad or crop the sequences to a multiple of "
                f"{self.cp}. TensorFlow said: {str(e).splitlines()[0][:300]}") from None

    def train_on_batch(self, x: Any, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._check_sequence((x, y))
        return super().train_on_batch(x, y, *args, **kwargs)

    def test_on_batch(self, x: Any, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._check_sequence((x, y))
        return super().test_on_batch(x, y, *args, **kwargs)

    def predict_on_batch(self, x: Any) -> Any:
        self._check_sequence(x)
        return super().predict_on_batch(x)

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        self._check_sequence(x)
        return super().predict(x, *args, **kwargs)

    def evaluate(self, x: Any = None, y: Any = None, *args: Any, **kwargs: Any) -> Any:
        self._check_sequence((x, y))
        return super().evaluate(x, y, *args, **kwargs)

    def _sequence_error(self, seq: int) -> PlanMismatchError:
        return PlanMismatchError(
            f"A batch has sequences of {seq} positions, but plan {self.plan_name!r} cuts "
            f"every sequence into cp={self.cp} equal chunks, so its length must be a "
            f"multiple of {self.cp}. Pad or crop the sequences to a multiple of {self.cp}, "
            "or re-plan with a cp that divides the length.")

    def _copies_forward(self, parts: Sequence[list[Any]], training: Any) -> list[Any]:
        """Each part's outputs, part p run by copy p (part p of ``_chunks``), layer by
        layer, attention over each group of cp consecutive copies."""
        models = self.replica_models()[:len(parts)]
        by_name = [{op.name: op for op in m.operations} for m in models]
        inputs = [Parts([part[j] for part in parts]) for j in range(len(parts[0]))]

        def operation_fn(op: Any) -> Any:
            copies = [names[op.name] for names in by_name]
            if isinstance(op, ATTENTION):
                return self._attention(models, copies, training)
            calls = [m.wrap_operation(c, compat.functional_operation(c, training=training))
                     for m, c in zip(models, copies)]

            def run(*args: Any, **kwargs: Any) -> Any:
                outs = [call(*_part(args, p), **_part(kwargs, p))
                        for p, call in enumerate(calls)]
                return keras.tree.map_structure(lambda *vs: Parts(vs), *outs)
            return run

        out = compat.unpack_singleton(compat.run_graph(models[0], inputs, operation_fn))
        return [_part(out, p) for p in range(len(parts))]

    def _attention(self, models: Sequence[Any], copies: Sequence[Any], training: Any) -> Any:
        cp = self.cp

        def run(*args: Any, **kwargs: Any) -> Any:
            if training is not None:
                kwargs = {**kwargs, "training": training}
            outs = []
            for g in range(0, len(copies), cp):
                group = range(g, g + cp)
                outs += group_attention(
                    [copies[p] for p in group],
                    [models[p].operation_device(copies[p]) for p in group],
                    [_part(args, p) for p in group], [_part(kwargs, p) for p in group],
                    [_recomputed(models[p], copies[p]) for p in group])
            return Parts(outs)
        return run

    # --- loss: each chunk's on its copy's device, combined by positions ---------------------
    def _forward_loss(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        dp = len(self.replica_models()) // self.cp
        with tf.control_dependencies(self._length_checks(x)):
            parts = self._chunks(x, dp)
            ys = _cut(y, dp, self.cp)
            weights = _cut(sample_weight, dp, self.cp)
        outputs = self._copies_forward(parts, True)
        models = self.replica_models()
        losses, positions = [], []
        for p, y_pred in enumerate(outputs):
            with tf.device(models[p].output_device):
                losses.append(compat.compute_loss(self, x=parts[p], y=ys[p], y_pred=y_pred,
                                                  sample_weight=weights[p], training=True))
                positions.append(_positions(y_pred))
        with tf.device(self.output_device):
            # each chunk's loss is its mean over its (unmasked) positions: weighted by them,
            # the mean over the batch's; without masks every chunk has the same count
            if positions[0] is None:
                loss = tf.add_n(losses) / float(len(losses))
            else:
                loss = tf.math.divide_no_nan(
                    tf.add_n([l * n for l, n in zip(losses, positions)]), tf.add_n(positions))
            y_pred = _join([_join(outputs[r * self.cp:(r + 1) * self.cp])
                            for r in range(dp)], axis=0)
            return y_pred, loss, self._scale_loss(loss)

    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        loss = kwargs.get("loss", args[0] if args else None)
        for fn in keras.tree.flatten(loss) if loss is not None else ():
            reduction = getattr(fn, "reduction", "sum_over_batch_size")
            if reduction not in PER_POSITION_REDUCTIONS:
                raise PlannerError(
                    f"compile() received loss {getattr(fn, 'name', fn)!r} with reduction "
                    f"{reduction!r}; plan {self.plan_name!r} cuts every sequence into "
                    f"cp={self.cp} chunks and combines the chunks' losses as a mean over "
                    "positions, which needs reduction='sum_over_batch_size' (Keras' "
                    "default). Use that reduction, or re-plan with cp=1.")
        super().compile(optimizer, *args, **kwargs)


def _join(parts: Sequence[Any], axis: int = 1) -> Any:
    """Equal structures of tensors concatenated along ``axis``, their Keras masks too."""
    def join(*tensors: Any) -> Any:
        out = tf.concat(tensors, axis=axis)
        masks = [compat.get_keras_mask(t) for t in tensors]
        if all(m is not None for m in masks):
            compat.set_keras_mask(out, tf.concat(masks, axis=axis))
        return out
    return keras.tree.map_structure(join, *parts)


def _positions(y_pred: Any) -> Any:
    """How many positions a part's loss averages over: its output's unmasked positions
    (Keras divides a masked loss by them), None when the output has no mask."""
    leaves = keras.tree.flatten(y_pred)
    masks = [compat.get_keras_mask(t) for t in leaves]
    if all(m is None for m in masks):
        return None
    if len(leaves) > 1:
        raise PlannerError(
            "A context-parallel model with several outputs carries a Keras mask on them; "
            "apply combines the chunks' losses by one output's unmasked positions. Give the "
            "model one output, or re-plan with cp=1.")
    return tf.reduce_sum(tf.cast(masks[0], tf.float32))


def _part(structure: Any, p: int) -> Any:
    return keras.tree.map_structure(
        lambda v: v.values[p] if isinstance(v, Parts) else v, structure)


def _cut(data: Any, dp: int, cp: int) -> list[Any]:
    """Targets or sample weights in the parts of ``_chunks``: along the batch, then along
    axis 1 where a tensor has one (per-position values), else whole per replica."""
    if data is None:
        return [None] * (dp * cp)
    flat = keras.tree.flatten(data)
    pieces = []
    for t in flat:
        t = tf.convert_to_tensor(t)
        rows = tf.split(t, dp, axis=0)
        pieces.append([c for r in rows for c in (
            tf.split(r, cp, axis=1) if len(t.shape) >= 2 else [r] * cp)])
    return [keras.tree.pack_sequence_as(data, [piece[p] for piece in pieces])
            for p in range(dp * cp)]


def _recomputed(model: Any, operation: Any) -> Any:
    """How ``model`` (one rank) runs its local attention: recomputed when the plan says."""
    def wrap(fn: Any) -> Any:
        return recompute_call(fn) if operation.name in model.recompute_layers else fn
    return wrap


def wrap_context_parallel(view: Any, plan: Plan, device_of_layer: dict[str, str], *,
                          recompute_layers: Collection[str] = ()) -> ContextParallelModel:
    """Clone ``view`` once per (replica r, context rank c) on ``devices[r * cp + c]`` of
    the plan's stage, copy the weights, and return copy (0, 0) holding the others (module
    docstring). PlannerError for a model or plan that context parallelism cannot run."""
    s = plan.strategy
    cp, dp = s.cp, s.dp
    if s.tp != 1 or len(plan.stages) != 1:
        raise PlannerError(
            f"Plan {plan.name!r} has cp={cp} with tp={s.tp} and {len(plan.stages)} stage(s); "
            "apply runs context parallelism with data parallelism only (tp = pp = 1). "
            "Re-plan with --fix tp=1,pp=1, or with cp=1.")
    devices = plan.stages[0].devices
    if len(devices) != dp * cp or len(set(devices)) != len(devices):
        raise PlanMismatchError(
            f"Plan {plan.name!r} lists devices {list(devices)}; expected dp*cp = {dp}*{cp} "
            "distinct devices (devices[r * cp + c]). Regenerate the plan.")
    check_context_parallel_model(view, cp, plan.name)
    models = []
    for p in range(dp * cp):
        shift = {d: devices[p] for d in device_of_layer.values()}
        models.append(_copy(view, plan, {k: shift[d] for k, d in device_of_layer.items()},
                            recompute_layers))
    model = models[0]
    model._set_replicas(models[1:])
    model.cp = cp  # the copies are plain per-chunk models (cp = 1)
    model.num_replicas = dp  # batches split in dp x num_microbatches parts along axis 0
    return model


def _copy(view: Any, plan: Plan, device_of_layer: dict[str, str],
          recompute_layers: Collection[str]) -> ContextParallelModel:
    clone = clone_graph(view, device_of_layer)  # each layer built and called on its device
    device = next(iter(device_of_layer.values()))
    model = ContextParallelModel(
        clone.inputs, clone.outputs, name=view.name, device_of_layer=device_of_layer,
        default_device=device, plan_name=plan.name,
        num_microbatches=plan.strategy.num_microbatches, num_replicas=1,
        recompute_layers=recompute_layers, tp_devices=[device])
    copy_weights(view, model)
    return model
