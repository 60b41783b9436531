"""``SpmdModel``: the keras.Model the SPMD engine trains; every device runs its own part.

Pipeline position: the last step of ``apply.spmd`` (``apply.wrap`` returns it for the plans
``apply.wrap.spmd_refusal`` accepts). It holds the devices' copies (``apply.spmd.copies``)
and runs Keras' ``fit``/``evaluate``/``predict`` through its own steps:

* **Rows.** The global batch is cut on the host into P = dp x m parts of nearly equal
  rows (replica q's micro-batch k is part q m + k, rows [i n / P, (i+1) n / P)); each
  part goes from the host to its replica's devices only. Any batch size works; under
  tensor parallelism (collectives of fixed shapes) a batch smaller than the plan's is
  padded to it with zero rows that weigh 0 in the loss and the metrics.
* **Forward and loss.** Every device (replica q, tensor rank t) runs its copy on its
  replica's parts and computes the compiled loss of its own rows (Keras masks and sample
  weights applied as one device applies them) plus its copy's ``add_loss`` terms. Tensor
  ranks of a replica compute the same loss (Megatron: the layers between split ones run on
  every rank).
* **One device's mean.** Part i's loss is a mean over its n_i rows (or, with a Keras mask,
  its v_i unmasked entries); one device's loss over the batch is sum_i c_i L_i / P with
  c_i = P n_i / n (P v_i / v, the counts summed by an all-reduce over the data-parallel
  group). Each device differentiates its own share (its parts' sum_i (c_i L_i + aux_i) / P,
  scaled by the optimizer's loss scale) with respect to its own variables only, under
  its own ``tf.device``: no device computes a gradient for another.
* **Reduction.** Each device's gradients are summed over its data-parallel group (tensor
  rank t of every replica) in one packed ``CollectiveReduceV2`` per dtype
  (``apply.spmd.reduction``), so every replica applies the same update to its copy. Under
  ZeRO-1/2 (``apply.spmd.zero``) each device receives only its shard of the sum (a
  reduce-scatter), updates its shards, and all-gathers them into its copy; under ZeRO-3
  (``apply.spmd.zero3``) the shards are the weights, the gathers inside each layer's call
  and the reduce-scatters their gradients, so the tape's gradients are the shards'. A
  ``global_clipnorm`` / ``clipnorm`` is applied to the one-device norms (each split
  weight's squares summed over its tensor ranks by one small all-reduce, and over the
  data-parallel group where ZeRO holds shards), not the norm over the copies the optimizer
  sees; a sparse gradient clipped by ``global_clipnorm`` becomes dense and one clipped by
  ``clipnorm`` stays sparse, as one device's clipping leaves them.
* **Offload** (``"optimizer"``: ZeRO-Offload, ``apply.offload``): the optimizer state (each
  copy's, or under ZeRO each shard's) lives on the device's host CPU; each reduced gradient
  is copied there, the update runs there, and the new value is written back to the
  device. Under ``"optimizer+weights"`` each copy's weights live there too
  (``apply.spmd.copies``), read by its layers' ops on the device; under ZeRO-3 the shards
  (``apply.spmd.zero3``).
* **Pipelines** (``_pipeline_train_step``, ``apply.spmd.pipeline``): each column runs its
  slots in the schedule's order, each backward slot one gradient on its stage's device;
  under 1F1B a part's loss is weighted by the batch's rows before every count is known
  (``_slot_targets``), then each device's gradients meet over its stage's dp group.
* **Metrics and the logged loss** are updated per part, on the part's tensor rank 0, in
  the model's own metric variables: Keras' metric states are sums (totals and counts), so
  adding the parts' updates gives one device's values.

Weights read and write as the user's model's (``get_weights``, ``set_weights``; files
through a template model of the user's structure on the host: ``save_weights``,
``load_weights``, ``save``), so weight files and saved models load in the plain model
and in any plan of it; once compiled, with one device's optimizer state
(``apply.spmd.optimizer_state``).
"""
from __future__ import annotations

import contextlib
import functools
import warnings
from dataclasses import dataclass
from typing import Any, Iterator

import keras
import numpy as np
import tensorflow as tf
from keras import ops

from tfplan import compat
from tfplan.apply.backup import planned_callbacks, release
from tfplan.apply.checkpoint import save_atomically
from tfplan.apply.collective_ops import (instance_scope, member_all_reduce, member_receive,
                                         member_send)
from tfplan.apply.input_shapes import InputShapeChecks
from tfplan.apply.monitor import PlanMonitor
from tfplan.apply.offload import state_on_host
from tfplan.apply.placement import (build_optimizer_on_devices, inner_optimizer,
                                    updates_on_variable_devices)
from tfplan.apply.spmd.across import (WorkerHooks, gathered_outputs,
                                      summed_over_workers)
from tfplan.apply.spmd.batch_norm import moving_statistics
from tfplan.apply.spmd.copies import Copies
from tfplan.apply.spmd.failures import worker_failures
from tfplan.apply.spmd.optimizer_state import OptimizerState
from tfplan.apply.spmd.pipeline import ColumnPass, pp_group, slot_order
from tfplan.apply.spmd.rank_layers import is_twin
from tfplan.apply.spmd.reduction import reduced
from tfplan.apply.spmd.context import check_loss_reduction, joined
from tfplan.apply.spmd.input import (KEY, cut, is_worker_rows, parts_of, rows_of,
                                     worker_rows)
from tfplan.apply.spmd.layout import summed_over_tp
from tfplan.apply.spmd.zero import ZeroShards, check_optimizer
from tfplan.apply.spmd.zero3 import install as install_zero3
from tfplan.core.errors import PlannerError

HOST = "/device:CPU:0"  # where the input batch lives (the worker's host)


class SpmdModel(InputShapeChecks, WorkerHooks, keras.Model):
    """The wrapped model of an SPMD plan (module docstring)."""

    def __init__(self, copies: Copies, template: Any, plan: Any,
                 name: str | None = None, logdir: str | None = None) -> None:
        super().__init__(name=name)
        self.plan = plan  # the plan, matched to the model (``Plan.for_model``)
        self._logdir = logdir  # fit() writes predicted vs measured step times there
        self._copies = copies  # a plain object: Keras tracks the models below, once
        self.device_models = copies.mine  # this process's (one program per worker)
        # the user's structure, on the host: held in a plain object, so Keras does not
        # track it (its weights are not the wrapped model's, nor trained)
        self._host = _Host(template)
        self._split_vars = {id(v) for m in self.device_models
                            for layer in compat.flatten_layers(m)
                            if is_twin(layer)
                            for v, a in zip(layer.weights, layer.rank_axes()) if a is not None}
        run = copies.run
        # a plain object too: its shards are scratch, read from the copies every step
        self._zero = ZeroShards(copies, run.zero_stage) if run.zero_stage else None
        if run.zero_stage == 3:  # the shards are the weights trained (apply.spmd.zero3)
            self._zero.load_all()
            install_zero3(copies, self._zero)
        self._optimizer_state = OptimizerState(copies, self._zero)  # plain, like _copies
        self._sends: list[Any] = []  # a traced step's hops between workers (``_hops``)
        # the sequence length context parallelism cuts (the inputs' axis 1)
        shapes = [tuple(x.shape) for x in template.inputs]
        self._sequence = shapes[0][1] if run.cp > 1 and len(shapes[0]) > 1 else None
        self.built = True

    # ---------------------------------------------------------------- variables
    # one program per worker: the copies' weights of another worker's pipeline chunks are
    # not this model's (never run or trained here: ``Copies.foreign``)
    def _own(self, variables: list[Any]) -> list[Any]:
        copies = self.__dict__.get("_copies")
        foreign = copies.foreign if copies is not None else frozenset()
        return [v for v in variables if id(v) not in foreign] if foreign else variables

    @property
    def trainable_weights(self) -> list[Any]:
        return self._own(super().trainable_weights)

    @property
    def non_trainable_weights(self) -> list[Any]:
        return self._own(super().non_trainable_weights)

    @property
    def weights(self) -> list[Any]:
        return self._own(super().weights)

    @property
    def variables(self) -> list[Any]:
        return self._own(super().variables)

    @property
    def trainable_variables(self) -> list[Any]:
        return self.trainable_weights

    @property
    def non_trainable_variables(self) -> list[Any]:
        return self.non_trainable_weights

    # ---------------------------------------------------------------- description
    @property
    def run_description(self) -> Any:
        return self._copies.run

    def compute_output_spec(self, *args: Any, **kwargs: Any) -> Any:
        return self._copies.mine[0].compute_output_spec(*args, **kwargs)

    # ---------------------------------------------------------------- compile
    @property
    def run_eagerly(self) -> bool:
        return False

    @run_eagerly.setter
    def run_eagerly(self, value: bool) -> None:
        """Every step runs traced: one program whose collectives TensorFlow orders per
        device (eager collectives wait on each other and hang), so ``run_eagerly=True`` is
        refused."""
        if value:
            raise PlannerError(
                f"Plan {self.plan.name!r} runs on the SPMD engine (apply.spmd), whose step is "
                "one traced program: every device's collectives must be in one graph, in one "
                "order, so it cannot run eagerly (received run_eagerly=True). Compile with "
                "run_eagerly=False; to look inside a step, use tf.print in the model's "
                "layers, or train the plain model eagerly on one device.")

    def compile(self, optimizer: Any = "rmsprop", *args: Any, **kwargs: Any) -> None:
        """Keras' ``compile``, never with XLA: one XLA cluster runs on one device, and the
        step spans the plan's devices and the host (Keras' ``jit_compile="auto"`` turns it
        on wherever a GPU is visible); then the optimizer's state is built beside what it
        updates."""
        if kwargs.get("jit_compile") is True:
            warnings.warn(f"Plan {self.plan.name!r}: the step spans several devices and one "
                          "XLA cluster runs on one device; compiling without jit_compile.",
                          stacklevel=2)
        kwargs["jit_compile"] = False
        if self._copies.run.cp > 1:  # the chunks' losses combine as a mean over positions
            check_loss_reduction(kwargs.get("loss", args[0] if args else None),
                                 self.plan.name, self._copies.run.cp)
        super().compile(optimizer, *args, **kwargs)
        self._build_optimizer()

    def compile_from_config(self, config: dict[str, Any]) -> None:
        """``compile`` from a compile config (Keras' own skips a model that overrides
        ``compile``, with a warning)."""
        self.compile(**keras.saving.deserialize_keras_object(config))

    def _build_optimizer(self) -> None:
        """The optimizer's state beside what it updates: each copy's weights, or under ZeRO
        the devices' shards (``apply.spmd.zero``)."""
        if self._zero is None:
            made = build_optimizer_on_devices(self.optimizer, self.trainable_variables,
                                              self._state_device)
        else:
            check_optimizer(self.optimizer, self.plan.name)
            self._zero.exclude_like_weights(self.optimizer)
            made = build_optimizer_on_devices(self.optimizer, self._zero.variables,
                                              self._state_device)
        self._optimizer_state.built(self.optimizer, made)

    @property
    def _state_device(self) -> Any:
        """Where each weight's optimizer state lives: beside it (None), or under offload
        on its host's CPU (ZeRO-Offload, ``apply.offload``)."""
        return state_on_host if self._copies.run.offload != "none" else None

    # ---------------------------------------------------------------- rows
    def _parts(self, data: Any) -> tuple[list[Any], list[Any]]:
        """The batch cut on the host into dp x m parts, and each part's row flags (1 real,
        0 padding; None where nothing is padded): ``apply.spmd.input.cut`` (a batch
        smaller than the plan's padded to it where collectives fix its shape), or a
        worker's rows of a dataset cut before the step (``apply.spmd.input.worker_rows``:
        another worker's parts None)."""
        run = self._copies.run
        if is_worker_rows(data):
            parts, flags, _ = parts_of(data, run)
            return parts, flags
        with tf.device(HOST), tf.name_scope("tfplan_input"):
            parts, flags, _ = cut(data, run, self._sequence)
            return parts, flags

    def _batch_rows(self, data: Any) -> Any:
        """The batch's rows before padding (a worker's rows carry the global batch's)."""
        if is_worker_rows(data):
            return data[KEY]["n"]
        return rows_of(data)

    # ---------------------------------------------------------------- forward
    def _forward(self, data: Any, training: bool) -> list[list[list[dict[str, Any]]]]:
        """Every device's forward on its replica's parts: ``out[q][t]``, a list of dicts
        (one per micro-batch: ``_loss_terms``'). Under pipeline parallelism each column
        runs its chunks in turn (``apply.spmd.pipeline``)."""
        run = self._copies.run
        m = run.num_microbatches
        parts, flags = self._parts(data)
        self._elsewhere = []
        out: list[list[Any]] = []
        for q, replica in enumerate(self._copies.models):
            row = []
            for t, model in enumerate(replica):
                if model is None:  # another worker's column
                    row.append(None)
                    continue
                if self._copies.programs is not None:
                    column = self._column(q, t, parts, flags, training)
                    results = column.forward_all()
                    # the outputs are on the last chunk's worker (one program per worker)
                    last_here = run.is_local(run.column(q, t)[-1])
                    row.append(results if last_here else None)
                    if not last_here:
                        self._added_elsewhere(column)
                    continue
                device = run.replicas[q][t]
                results = []
                with tf.device(device):
                    for k in range(m):
                        x, y, sw = keras.utils.unpack_x_y_sample_weight(parts[q * m + k])
                        y_pred = model(x, training=training)
                        results.append(self._loss_terms(x, y, y_pred, sw, flags[q * m + k],
                                                        model.losses))
                row.append(results)
            out.append(row)
        return out

    def _column(self, q: int, t: int, parts: list[Any], flags: list[Any], training: bool
                ) -> ColumnPass:
        """Column (q, t)'s pass over its replica's parts (pipelines)."""
        run, m, zero = self._copies.run, self._copies.run.num_microbatches, self._zero
        stage = zero.stage if zero is not None and training else 0
        # ZeRO-2: each slot's gradients reduced at once; ZeRO-3: the shards differentiated
        # through the gathers
        shard_of = functools.partial(zero.shard_of, q, t) if stage >= 2 else None
        reduce = functools.partial(zero.reduce_some, q=q, t=t) if stage == 2 else None
        return ColumnPass(run, self._copies.programs[q][t], run.column(q, t),
                          parts[q * m:(q + 1) * m], flags[q * m:(q + 1) * m], training,
                          self._loss_terms, shard_of=shard_of, reduce=reduce,
                          sends=self._sends)

    def _loss_terms(self, x: Any, y: Any, y_pred: Any, sw: Any, valid: Any, added: Any
                    ) -> dict[str, Any]:
        """One part's loss terms. ``counts``: what its loss divides by (its rows, or with
        a Keras mask its unmasked entries); ``reals``: the same over its real rows (less
        where ``valid`` flags padding rows, which weigh 0 in the loss and the metrics);
        ``added``: the part's ``add_loss`` values."""
        mask = compat.get_keras_mask(y_pred) if tf.is_tensor(y_pred) else None
        # Keras' compiled metrics take no weights (only weighted_metrics do): they see the
        # real rows alone
        metric_args = (y, y_pred, sw) if valid is None else _real_rows(valid, (y, y_pred, sw))
        if valid is not None:
            sw = _flagged(valid, sw, mask, y_pred)
        loss = compat.compiled_loss(self, y, y_pred, sw) if y is not None else None
        aux = [compat.added_loss(self, v) for v in added]
        if aux and valid is not None:
            aux = [_without_padding(a, valid, self._copies.run) for a in aux]
        rows = ops.cast(rows_of(x), "float32")
        real_rows = rows if valid is None else ops.sum(valid)
        count, real = rows, real_rows
        if mask is not None and _reduction(self.loss) in ("sum_over_batch_size", "mean"):
            mask = ops.cast(mask, "float32")
            count = ops.sum(mask)
            real = count if valid is None else ops.sum(mask * _along_rows(valid, mask))
        return {"y_pred": y_pred, "loss": loss, "aux": ops.sum(aux) if aux else None,
                "counts": ops.stack([count, rows]), "reals": ops.stack([real, real_rows]),
                "metric_args": metric_args, "masked": mask is not None,
                "per_row": _per_row(mask)}

    def _weights_of_parts(self, results: list[list[Any]], totals: Any = None
                          ) -> list[list[list[Any]]]:
        """(c_i of the loss, c_i of the added losses) of every part, on each device (module
        docstring): each part's counts over the real counts summed over the replica's parts,
        then over the data-parallel group (one all-reduce of two numbers; ``totals[q][t]``
        where already summed)."""
        run = self._copies.run
        out = []
        for q, row in enumerate(results):
            out_row = []
            for t, parts in enumerate(row):
                if parts is None:  # another worker's column
                    out_row.append(None)
                    continue
                with tf.device(run.loss_replicas[q][t]):
                    total = self._totals(parts, q, t) if totals is None else totals[q][t]
                    out_row.append([ops.divide_no_nan(p["counts"] * run.parts, total)
                                    for p in parts])
            out.append(out_row)
        return out

    def _totals(self, parts: list[Any], q: int, t: int) -> Any:
        """The real counts (loss, added losses) of replica q's parts summed over the
        data-parallel group of tensor rank t, on the device its loss is on."""
        run = self._copies.run
        device = run.loss_replicas[q][t]
        with tf.device(device):
            own = ops.sum(ops.stack([p["reals"] for p in parts]), axis=0)
            return own if run.dp == 1 else member_all_reduce(
                own, run.loss_dp_group(t), device, "dp")

    @staticmethod
    def _part_loss(p: dict[str, Any], c: Any) -> Any:
        """c_i L_i + c'_i aux_i of one part (``c``: both weights)."""
        value = 0.0 if p["loss"] is None else c[0] * ops.cast(p["loss"], "float32")
        if p["aux"] is not None:
            value = value + c[1] * ops.cast(p["aux"], "float32")
        return value

    def _part_losses(self, parts: list[Any], weights: list[Any]) -> list[Any]:
        """The device's share of one device's loss, part by part: (c_i L_i + c'_i aux_i) / P,
        each times the optimizer's loss scale (mixed_float16)."""
        return [self.optimizer.scale_loss(self._part_loss(p, c) / self._copies.run.parts)
                for p, c in zip(parts, weights)]

    def _track(self, results: list[list[Any]], weights: list[list[list[Any]]],
               data: Any) -> None:
        """The logged loss and the compiled metrics, per part on its tensor rank 0."""
        run = self._copies.run
        share = ops.cast(self._batch_rows(data), "float32") / run.parts
        for q, row in enumerate(results):
            if row[0] is None:  # replica q's tensor rank 0 is another worker's: it counts
                continue
            with tf.device(run.loss_replicas[q][0]):
                for p, c in zip(row[0], weights[q][0]):
                    compat.loss_tracker(self).update_state(self._part_loss(p, c),
                                                          sample_weight=share)
                    metrics = compat.compiled_metrics(self)
                    if metrics is not None and p["metric_args"][0] is not None:
                        metrics.update_state(*p["metric_args"])

    def _track_all(self, results: list[list[Any]], weights: list[list[list[Any]]],
                   data: Any) -> None:
        """``_track``; one program per worker: each worker tracks its replicas' parts, then
        the metrics' changes are summed over the workers (``across.summed_over_workers``)."""
        run = self._copies.run
        if run.every_column_here:
            self._track(results, weights, data)
            return
        with summed_over_workers(self.metrics, run):
            self._track(results, weights, data)
            with tf.device(HOST):  # a stage's added losses here, the loss on another worker
                for value in getattr(self, "_elsewhere", ()):
                    compat.add_to_mean_total(compat.loss_tracker(self), value)

    def _corrected_later(self, order: Any, column: ColumnPass) -> bool:
        """Whether a column's gradients are corrected after its backward (1F1B on a model
        whose output has a Keras mask: the slots weighted the loss by an estimate of the
        mask's counts, the step's true counts known only after the last forward), from
        the schedule and the model's graph alone: every worker computes the same."""
        outputs = self._host.model.outputs  # (``_loss_terms``' "masked", from the graph)
        if len(outputs) != 1 or compat.get_keras_mask(outputs[0]) is None:
            return False
        last = column.program.chunks - 1
        first_backward = next(i for i, s in enumerate(order) if s.kind == "B")
        return any(s.kind == "F" and s.stage == last for s in order[first_backward:])

    def _send_correction(self, factor: Any, column: ColumnPass) -> None:
        """The masked 1F1B correction (a scalar) from the last chunk's device to each of
        the column's devices on other workers (a two-member broadcast each)."""
        last = column.column[-1]
        with tf.device(last):
            factor = tf.cast(tf.convert_to_tensor(factor), tf.float32)
        for device in dict.fromkeys(column.column):
            if not self._copies.run.is_local(device):
                self._sends.append(member_send(factor, pp_group((last, device)), last))

    def _received_correction(self, grads: dict[str, Any], column: ColumnPass
                             ) -> dict[str, Any]:
        """``_send_correction``'s factor received on each of this worker's devices of the
        column, its gradients multiplied by it."""
        last = column.column[-1]
        out = dict(grads)
        for device in dict.fromkeys(column.column):  # every one the sender sends to
            if not self._copies.run.is_local(device):
                continue
            with tf.device(device):
                factor = member_receive(tf.constant([], tf.int32), tf.float32,
                                        pp_group((last, device)), device)
                if device in grads:
                    gs, vs = grads[device]
                    out[device] = ([_times_sparse(g, factor) for g in gs], vs)
        return out

    def _added_elsewhere(self, column: ColumnPass) -> None:
        """A column whose loss is on another worker: its chunks' added losses here enter
        the logged loss as one device's (``_track``: part j's weighs its rows, c'_j x the
        rows' share), kept in ``_elsewhere`` for ``_track_all``."""
        with tf.device(HOST):
            terms = [rows_j * added for rows_j, added in (
                self._added_sum(column, j, range(column.program.chunks))
                for j in range(len(column.parts))) if added is not None]
            if terms:
                self._elsewhere.append(ops.sum(terms))

    def _added_sum(self, column: ColumnPass, j: int, chunks: Any) -> tuple[Any, Any]:
        """(part j's rows, the sum of its added losses on ``chunks``, float32; None where
        there are none), the terms checked to hold no padding rows (``_without_padding``,
        as on the last stage)."""
        x, _, _ = keras.utils.unpack_x_y_sample_weight(column.parts[j])
        added = [compat.added_loss(self, v) for k in chunks for v in column.aux[j][k]]
        if column.flags[j] is not None:
            added = [_without_padding(a, column.flags[j], self._copies.run) for a in added]
        total = ops.sum([ops.cast(a, "float32") for a in added]) if added else None
        return ops.cast(rows_of(x), "float32"), total

    # ---------------------------------------------------------------- steps
    @contextlib.contextmanager
    def _shape_checked(self, data: Any, what: str) -> Iterator[None]:
        """``InputShapeChecks._shape_checked``; a worker's rows were checked as the
        dataset cut them (``apply.spmd.input.worker_rows``)."""
        if is_worker_rows(data):
            yield
            return
        with super()._shape_checked(data, what):
            yield

    def train_step(self, data: Any) -> Any:
        with self._shape_checked(data, "A training batch"), instance_scope("train"), \
                moving_statistics() as statistics, self._hops() as sends:
            metrics = self._train_step(data)
            statistics.update()  # "local" BatchNormalization: once per step
            return _after(sends, metrics)

    @contextlib.contextmanager
    def _hops(self) -> Iterator[list[Any]]:
        """The sends of a traced step's pipeline hops between workers (``ColumnPass``):
        what its result must depend on, or ``tf.function`` prunes them."""
        self._sends = []
        try:
            yield self._sends
        finally:
            self._sends = []

    def _train_step(self, data: Any) -> Any:
        if self._copies.programs is not None:
            return self._pipeline_train_step(data)
        run, zero = self._copies.run, self._zero
        with tf.GradientTape(persistent=True) as tape:
            results = self._forward(data, training=True)
            weights = self._weights_of_parts(results)
            # scaled inside the tape (mixed_float16's loss scale): the tape records it
            losses = [[None if parts is None else self._part_losses(parts, weights[q][t])
                       for t, parts in enumerate(row)] for q, row in enumerate(results)]
            totals = [[None if parts is None else tf.add_n(parts) for parts in row]
                      for row in losses]  # on the tape
        grads, variables, owners = [], [], []
        for q, replica in enumerate(self._copies.models):
            for t, model in enumerate(replica):
                if model is None:  # another worker's column
                    continue
                device = run.replicas[q][t]
                vs = model.trainable_variables
                with tf.device(device):
                    if zero is not None and zero.stage == 3:  # reduce-scattered already
                        gs = self._on_pieces_summed(
                            _gradients(tape, totals[q][t], zero.shards[q][t]),
                            zero.weights[q][t], device)
                    elif zero is not None:
                        zero.load(q, t)
                        # ZeRO-2: each micro-batch's gradient reduced as soon as it exists
                        per_part = losses[q][t] if zero.stage == 2 else [totals[q][t]]
                        gs = zero.reduce([self._on_pieces_summed(_gradients(tape, loss, vs), vs,
                                                                 device)
                                          for loss in per_part], q, t)
                    else:
                        gs = self._on_pieces_summed(_gradients(tape, totals[q][t], vs), vs,
                                                    device)
                        gs = self._reduced(gs, vs, device) if run.dp > 1 else gs
                grads.append(gs)
                owners.append(vs)
                variables.append(zero.shards[q][t] if zero is not None else vs)
        del tape
        grads = self._clipped([run.replicas[q][t] for q, t in run.local_columns]
                              if run.local else list(run.devices), _all_computed(grads), owners)
        with self._own_clipping(), \
                updates_on_variable_devices(self.optimizer, self._state_device), \
                compat.without_replica_sum(self.optimizer):
            self.optimizer.apply_gradients(
                [(g, v) for gs, vs in zip(grads, variables) for g, v in zip(gs, vs)])
        if zero is not None and zero.stage < 3:
            for q, t in zero.columns:
                with tf.device(run.replicas[q][t]):
                    zero.gather(q, t)
        self._track_all(results, weights, data)
        return self.get_metrics_result()

    def _pipeline_train_step(self, data: Any) -> Any:
        """A pipeline plan's step: each column's slots in the schedule's order
        (``apply.spmd.pipeline``), each device's gradients summed over its data-parallel
        group (ZeRO-1: reduce-scattered to its shards, which it updates and all-gathers;
        ZeRO-2: each backward slot's reduce-scattered; ZeRO-3: the shards' gradients from
        the gathers, nothing gathered after), one update."""
        run, zero = self._copies.run, self._zero
        results, totals, columns = self._pipeline_gradients(data)
        entries = []  # (device, gradients, the weights they are of, what is updated)
        for q, row in enumerate(columns):
            for t, by_device in enumerate(row):
                if by_device is None:  # another worker's column
                    continue
                by_device = {device: (self._on_pieces_summed(gs, vs, device), vs)
                             for device, (gs, vs) in by_device.items()}
                if zero is None:
                    for device, (gs, vs) in by_device.items():
                        if run.dp > 1:
                            with tf.device(device):
                                gs = self._reduced(gs, vs, device)
                        entries.append((device, gs, vs, vs))
                    continue
                of = {id(v): g for gs, vs in by_device.values() for g, v in zip(gs, vs)}
                vs = zero.weights[q][t]
                if zero.stage < 3:  # (ZeRO-3's shards are the weights trained)
                    zero.load(q, t)
                # ZeRO-2/3: shards' gradients, reduce-scattered (None: another worker's chunk)
                gs = [of.get(id(v)) for v in vs]
                if zero.stage == 1:  # slot by slot (ColumnPass.reduce) or by the gathers
                    gs = zero.reduce([gs], q, t)
                devices, own = zero.devices[q][t], set(zero.own(q, t))
                for device in dict.fromkeys(devices[i] for i in sorted(own)):
                    mine = [i for i, d in enumerate(devices) if d == device and i in own]
                    entries.append((device, [gs[i] for i in mine], [vs[i] for i in mine],
                                    [zero.shards[q][t][i] for i in mine]))
        devices, grads, owners, variables = (list(x) for x in zip(*entries))
        grads = self._clipped(devices, _all_computed(grads), owners)
        with self._own_clipping(), \
                updates_on_variable_devices(self.optimizer, self._state_device), \
                compat.without_replica_sum(self.optimizer):
            self.optimizer.apply_gradients(
                [(g, v) for gs, vs in zip(grads, variables) for g, v in zip(gs, vs)])
        if zero is not None and zero.stage < 3:
            for q, t in zero.columns:
                zero.gather(q, t)
        self._track_all(results, self._weights_of_parts(results, totals), data)
        return self.get_metrics_result()

    def _reduced(self, grads: list[Any], variables: list[Any], device: str) -> list[Any]:
        """``device``'s gradients summed over its data-parallel group; an expert shard's
        over its ``edp`` group only, the replicas holding the same experts
        (``apply.spmd.experts``)."""
        run = self._copies.run
        by_group: dict[str, list[int]] = {}
        for i, v in enumerate(variables):
            by_group.setdefault(self._copies.reduction_group(v), []).append(i)
        out = list(grads)
        for kind, indices in by_group.items():
            group = run.chunk_group(kind, device)
            if group.size > 1:
                summed = reduced([grads[i] for i in indices], [variables[i] for i in indices],
                                 group, device)
                for i, g in zip(indices, summed):
                    out[i] = g
        return out

    def _on_pieces_summed(self, grads: list[Any], variables: list[Any], device: str
                          ) -> list[Any]:
        """The gradients of the weights read on sequence pieces summed over ``device``'s
        tp group (``apply.spmd.layout.summed_over_tp``); the others as they are."""
        on_pieces = self._copies.sequence_weights
        if not on_pieces:
            return grads
        with tf.device(device):
            return summed_over_tp(grads, variables, on_pieces,
                                  self._copies.run.chunk_group("tp", device), device)

    def _pipeline_gradients(self, data: Any) -> tuple[Any, Any, Any]:
        """(results, totals, gradients) of a pipeline step, ``gradients[q][t]``: column
        (q, t)'s {device: (gradients, weights)}, not yet reduced. A part's
        loss is weighted as one device's (``_weights_of_parts``) where every forward comes
        before the first backward (GPipe); otherwise (1F1B) by its own count, and each
        gradient divided by the counts' sum at the end."""
        run = self._copies.run
        rows = ops.cast(self._batch_rows(data), "float32")  # the real rows (before padding)
        parts, flags = self._parts(data)
        self._elsewhere = []
        order = slot_order(run)
        results, totals, columns = [], [], []
        with tf.GradientTape(persistent=True) as tape:
            for q, replica in enumerate(self._copies.models):
                row, row_totals, row_grads = [], [], []
                for t in range(len(replica)):
                    if replica[t] is None:  # another worker's column
                        row.append(None)
                        row_totals.append(None)
                        row_grads.append(None)
                        continue
                    column = self._column(q, t, parts, flags, True)
                    total, deferred = None, None
                    # one program per worker: the loss is on the last chunk's worker
                    last_here = run.is_local(column.column[-1])
                    for slot in order:
                        j, k = slot.microbatch, slot.stage
                        if slot.kind == "F":
                            column.forward(j, k, tape)
                            continue
                        if not run.is_local(column.column[k]):  # another worker's chunk
                            column.backward(j, k, tape, [])
                            continue
                        if not last_here:  # no loss here: the gradients that come back
                            with tf.device(column.column[k]):  # (and its added losses)
                                targets = self._added_targets(column, j, k, rows)
                            column.backward(j, k, tape, targets)
                            continue
                        if deferred is None:  # decided at the first backward
                            deferred = any(r is None for r in column.results)
                            if deferred:
                                self._check_deferred(column)
                            else:
                                total = self._totals(column.results, q, t)
                        with tf.device(column.column[k]):
                            targets = self._slot_targets(column, j, k, total, rows)
                        column.backward(j, k, tape, targets)
                    grads = column.weight_grads()
                    if not last_here:
                        self._added_elsewhere(column)
                        if self._corrected_later(order, column):  # the last stage's factor
                            if any(any(chunks) for chunks in column.aux):  # (it would scale
                                self._check_deferred(column, masked=True)  # them too)
                            grads = self._received_correction(grads, column)
                        row.append(None)
                        row_totals.append(None)
                        row_grads.append(grads)
                        continue
                    factor = 1.0  # of the column's gradients (masked 1F1B)
                    if deferred:  # 1F1B: the sum of the parts' counts, known now
                        total = self._totals(column.results, q, t)
                        if column.results[0]["masked"]:  # its estimate corrected
                            estimate = rows * column.results[0]["per_row"]
                            at = run.loss_replicas[q][t]
                            grads = _divided(grads, total[0] / estimate, at)
                            with tf.device(at):
                                factor = ops.divide_no_nan(estimate, total[0])
                    if run.spans_workers(q, t) and self._corrected_later(order, column):
                        self._send_correction(factor, column)  # its stages elsewhere too
                    row.append(column.results)
                    row_totals.append(total)
                    row_grads.append(grads)
                results.append(row)
                totals.append(row_totals)
                columns.append(row_grads)
        del tape
        return results, totals, columns

    def _slot_targets(self, column: ColumnPass, j: int, k: int, total: Any, rows: Any
                      ) -> list[Any]:
        """Backward slot (j, k)'s losses, weighted and scaled (mixed_float16): by one
        device's c_i / P = counts_i / total where ``total`` is known; else (1F1B) by
        counts_i over the batch's real ``rows`` (exact without a Keras mask; with one, over
        rows x the mask's entries per row, corrected when the step's counts are known),
        so a loss scale sees the gradients one device's step has."""
        p = column.results[j]
        out = []
        if total is None:
            total = ops.stack([rows * p["per_row"], rows])
        counts = ops.divide_no_nan(p["counts"], total)
        if k == column.program.chunks - 1 and p["loss"] is not None:
            out.append(self.optimizer.scale_loss(counts[0] * ops.cast(p["loss"], "float32")))
        added = [compat.added_loss(self, v) for v in column.aux[j][k]]
        if added:
            out.append(self.optimizer.scale_loss(counts[1] * ops.cast(ops.sum(added),
                                                                      "float32")))
        return out

    def _added_targets(self, column: ColumnPass, j: int, k: int, rows: Any) -> list[Any]:
        """Backward slot (j, k)'s added losses (add_loss) where the column's loss is on
        another worker: weighted as one device's, by the part's rows over the batch's real
        rows (``_slot_targets``' ``counts[1]``; both known on every worker, unlike the
        loss's counts), a part holding padding rows refused as on the last stage."""
        rows_j, added = self._added_sum(column, j, (k,))
        if added is None:
            return []
        return [self.optimizer.scale_loss(ops.divide_no_nan(rows_j, rows) * added)]

    def _check_deferred(self, column: ColumnPass, masked: bool | None = None) -> None:
        """A 1F1B part's loss and added losses divide by different sums where the output
        has a Keras mask (its unmasked entries, its rows): refused, with the fix.
        ``masked``: known from the graph (a stage whose loss is on another worker)."""
        if masked is None:
            masked = column.results[0]["masked"]
        if masked and any(any(chunks) for chunks in column.aux):
            raise PlannerError(
                f"Plan {self.plan.name!r} runs a {self._copies.run.schedule} pipeline on a "
                "model whose output has a Keras mask and which adds losses (add_loss): "
                "one device's loss divides the two by different counts, known only after "
                "every micro-batch's forward, which this schedule interleaves with the "
                "backward. Re-plan with --schedule gpipe.")

    def test_step(self, data: Any) -> Any:
        with self._shape_checked(data, "A batch given to evaluate"), instance_scope("test"), \
                self._hops() as sends:
            results = self._forward(data, training=False)
            weights = self._weights_of_parts(results)
            self._track_all(results, weights, data)
            return _after(sends, self.get_metrics_result())

    def predict_step(self, data: Any) -> Any:
        if is_worker_rows(data):  # a worker's rows of a dataset (checked as it was cut)
            return self._gathered(data, self._batch_rows(data), training=False)
        x, _, _ = keras.utils.unpack_x_y_sample_weight(data)
        with self._shape_checked(data, "A batch given to predict"):
            return self(x, training=False)

    def _gathered(self, data: Any, n: Any, training: bool) -> Any:
        """One program per worker: the outputs of ``data``'s ``n`` rows, every worker's
        parts summed into the whole batch's on each (``across.gathered_outputs``)."""
        with instance_scope("call"), self._hops() as sends:
            results = self._forward(data, training=training)
            return _after(sends, gathered_outputs(results, n, self._copies.run,
                                                  self._host.model.outputs, self._sequence))

    def call(self, inputs: Any, training: Any = None) -> Any:
        if not self._copies.run.every_column_here:  # one program per worker
            return self._gathered((inputs,), rows_of(inputs), bool(training))
        with instance_scope("call"), self._hops():
            results = self._forward((inputs,), training=bool(training))
        outs = [p["y_pred"] for row in results for p in row[0]]
        cp, m = self._copies.run.cp, self._copies.run.num_microbatches
        if cp > 1:  # replica r's chunks joined, micro-batch by micro-batch
            with tf.device(HOST):
                outs = [joined([outs[(r * cp + c) * m + k] for c in range(cp)], self._sequence)
                        for r in range(len(outs) // (cp * m)) for k in range(m)]
        n = rows_of(inputs)  # a padded batch's outputs cut back to its rows
        with tf.device(HOST):
            return tf.nest.map_structure(lambda *ys: ops.concatenate(ys, axis=0)[:n], *outs)

    # ---------------------------------------------------------------- clipping
    def _clipped(self, devices: list[str], grads: list[list[Any]],
                 variables: list[list[Any]]) -> list[list[Any]]:
        """``clipnorm`` / ``global_clipnorm`` on one device's norms (module docstring):
        ``grads[i]`` on ``devices[i]``, of ``variables[i]`` (a pipeline column's chunks sum
        their squares for the global norm)."""
        opt = inner_optimizer(self.optimizer)
        clipnorm, global_clipnorm = opt.clipnorm, opt.global_clipnorm
        if not clipnorm and not global_clipnorm:
            return grads
        run = self._copies.run
        scale = getattr(self.optimizer, "dynamic_scale", None)
        rank = {d: t for grid in (run.stages or (run.replicas,)) for replica in grid
                for t, d in enumerate(replica)}
        staged, sums = [], {}
        for device, gs, vs in zip(devices, grads, variables):
            with tf.device(device):
                # an expert shard's squares: under ZeRO summed over dp with the rest (every
                # replica holds a shard of one ep rank's experts), else over the ep group
                experts = self._copies.expert_weights if self._zero is None else frozenset()
                squares = ops.stack([
                    _sum_of_squares(g) if (id(v) in self._split_vars or rank[device] == 0)
                    and id(v) not in experts else ops.zeros(()) for g, v in zip(gs, vs)])
                if self._zero is not None:  # each replica holds a shard of each sum
                    squares = member_all_reduce(squares, run.chunk_group("dp", device),
                                                device, "dp")
                if run.tp > 1:
                    squares = member_all_reduce(squares, run.chunk_group("tp", device),
                                                device, "tp")
                if any(id(v) in experts for v in vs):  # each expert counted once: the
                    shards = ops.stack([  # squares of the ep ranks' slices summed
                        _sum_of_squares(g) if id(v) in experts else ops.zeros(())
                        for g, v in zip(gs, vs)])
                    squares = squares + member_all_reduce(
                        shards, run.chunk_group("ep", device), device, "ep")
                if scale is not None:
                    squares = squares / ops.square(ops.cast(scale, "float32"))
                staged.append(squares)
                sums[device] = ops.sum(squares)
        columns = {d: tuple(dict.fromkeys(run.column(q, t))) for q in range(run.dp)
                   for t in range(run.tp) for d in run.column(q, t)}
        out = []
        for device, gs, squares in zip(devices, grads, staged):
            with tf.device(device):
                column = columns[device]
                if global_clipnorm and all(map(run.is_local, column)):
                    # over the column's chunks: a scalar from each of its devices
                    total = ops.sqrt(ops.sum(ops.stack([sums[d] for d in column])))
                elif global_clipnorm:  # a column across workers: its devices' scalars summed
                    total = ops.sqrt(member_all_reduce(  # by a collective over them
                        sums[device], pp_group(column), device, "pp"))
                if global_clipnorm:
                    factor = global_clipnorm / ops.maximum(total, global_clipnorm)
                    gs = [_times(g, factor) for g in gs]
                else:
                    norms = ops.sqrt(squares)
                    # Keras' _clip_by_norm keeps a sparse gradient sparse (keras.ops
                    # multiply and divide act on its rows), unlike clip_by_global_norm
                    gs = [_times_sparse(g, clipnorm / ops.maximum(norms[j], clipnorm))
                          for j, g in enumerate(gs)]
            out.append(gs)
        return out

    @contextlib.contextmanager
    def _own_clipping(self) -> Iterator[None]:
        """The optimizer's own norm clipping off while the step applies clipped grads."""
        opt = inner_optimizer(self.optimizer)
        saved = opt.clipnorm, opt.global_clipnorm
        opt.clipnorm = opt.global_clipnorm = None
        try:
            yield
        finally:
            opt.clipnorm, opt.global_clipnorm = saved

    # ---------------------------------------------------------------- fit
    def fit(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Keras' ``fit``, its inputs checked against the plan's shapes first
        (``apply.input_shapes``); a ``BackupAndRestore`` among the callbacks becomes the
        planned one (``apply.backup``: exact mid-epoch resumes, a backup checked against its
        metadata), whose files hold one device's layout (any plan resumes them); with a
        ``logdir`` at ``apply.wrap``, ``apply.monitor.PlanMonitor`` is one of them."""
        self._check_input_shapes(x, "The data given to fit")
        if self._logdir is not None:
            kwargs["callbacks"] = [*(kwargs.get("callbacks") or []),
                                   PlanMonitor(self.plan, self._logdir)]
        if "callbacks" in kwargs:
            kwargs["callbacks"] = planned_callbacks(kwargs["callbacks"])
        self._initial_epoch = None  # Keras keeps a restored epoch after fit; this fit's own
        x = self._worker_rows(x, "The data given to fit")
        if isinstance(kwargs.get("validation_data"), tf.data.Dataset):
            kwargs["validation_data"] = self._worker_rows(kwargs["validation_data"],
                                                          "The validation data given to fit")
        try:
            with self._runtime_shape_errors():
                return super().fit(x, *args, **kwargs)
        finally:
            release(kwargs.get("callbacks"))  # SIGTERM handed back (apply.backup)

    def evaluate(self, x: Any = None, *args: Any, **kwargs: Any) -> Any:
        what = "The data given to evaluate"
        return self._checked(x, what, lambda: super(InputShapeChecks, self).evaluate(
            self._worker_rows(x, what), *args, **kwargs))

    def predict(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        what = "The data given to predict"
        return self._checked(x, what, lambda: super(InputShapeChecks, self).predict(
            self._worker_rows(x, what), *args, **kwargs))

    @contextlib.contextmanager
    def _runtime_shape_errors(self) -> Iterator[None]:
        """``InputShapeChecks._runtime_shape_errors``, around every entry point that runs
        steps; one program per worker, a collective aborted because a worker was lost
        raised as the ``WorkerLostError`` naming it (``apply.spmd.failures``)."""
        run = self._copies.run
        with worker_failures(run.plan_name) if not run.every_column_here \
                else contextlib.nullcontext(), super()._runtime_shape_errors():
            yield

    def _worker_rows(self, x: Any, what: str) -> Any:
        """A ``tf.data.Dataset`` as this worker's rows of each batch, one program per worker
        (``apply.spmd.input.worker_rows``); anything else as it is."""
        if not isinstance(x, tf.data.Dataset):
            return x
        return worker_rows(x, self._copies.run, self._sequence,
                           lambda inputs: self._check_input_shapes(inputs, what))

    def train_on_batch(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._checked(x, "The batch given to train_on_batch",
                             lambda: super(SpmdModel, self).train_on_batch(x, *args, **kwargs))

    def test_on_batch(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return self._checked(x, "The batch given to test_on_batch",
                             lambda: super(SpmdModel, self).test_on_batch(x, *args, **kwargs))

    def predict_on_batch(self, x: Any) -> Any:
        return self._checked(x, "The batch given to predict_on_batch",
                             lambda: super(SpmdModel, self).predict_on_batch(x))

    def _shape_model(self) -> Any:
        return self._host.model  # the user's inputs (the plan's shapes are matched to them)

    # ---------------------------------------------------------------- weights
    def get_weights(self) -> list[np.ndarray]:
        if self._zero is not None and self._zero.stage == 3:  # ZeRO-3 trains the shards
            if not self._copies.run.every_column_here:  # others' shards from their workers
                self._zero.fetch(lambda shard: np.asarray(shard.numpy()))
            try:
                return self._copies.get_weights(read=self._zero.read)
            finally:
                self._zero.fetched = {}
        return self._copies.get_weights()

    def set_weights(self, weights: Any) -> None:
        if self._zero is not None and self._zero.stage == 3:
            self._copies.set_weights(weights, write=self._zero.write)
            return
        self._copies.set_weights(weights)

    def _template(self) -> Any:
        """The model of the user's structure on the host, holding the unsplit weights and,
        once this model is compiled, one device's optimizer state
        (``apply.spmd.optimizer_state``)."""
        template = self._host.model
        template.set_weights(self.get_weights())
        self._optimizer_state.to_template(template, self.loss)
        return template

    def save_weights(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        """The user's model's weights (and optimizer state, as one device's), written to a
        temporary file renamed over ``filepath`` (``apply.checkpoint.save_atomically``: a
        save that fails or is killed leaves the previous file whole)."""
        template = self._template()
        if self.is_chief:  # one program per worker: worker 0 writes, the others wait
            save_atomically(lambda path: template.save_weights(path, overwrite=overwrite,
                                                               **kwargs), filepath)
        self._sync_workers()

    def load_weights(self, filepath: Any, skip_mismatch: bool = False, **kwargs: Any) -> None:
        template = self._template()
        template.load_weights(filepath, skip_mismatch=skip_mismatch, **kwargs)
        self.set_weights(template.get_weights())
        self._optimizer_state.from_template(template)

    def save(self, filepath: Any, overwrite: bool = True, **kwargs: Any) -> None:
        """The user's model with these weights and, once compiled, its optimizer (one
        device's state) and loss: ``keras.models.load_model`` gives the plain model."""
        template = self._template()
        if self.is_chief:  # one program per worker: worker 0 writes, the others wait
            template.save(filepath, overwrite=overwrite, **kwargs)
        self._sync_workers()


def _after(sends: list[Any], result: Any) -> Any:
    """``result`` depending on ``sends`` (pipeline hops between workers, else pruned)."""
    if not sends:
        return result
    with tf.control_dependencies(sends):
        return tf.nest.map_structure(tf.identity, result)


def _per_row(mask: Any) -> int:
    """The entries per row of a Keras mask (1 without one, or where not static)."""
    if mask is None or any(d is None for d in mask.shape[1:]):
        return 1
    return int(np.prod(mask.shape[1:]))


@dataclass(frozen=True)
class _Host:
    """The user's model on the host, out of Keras' tracking (``SpmdModel._template``)."""

    model: Any


def _divided(grads: dict[str, tuple[list[Any], list[Any]]], total: Any, at: str
             ) -> dict[str, tuple[list[Any], list[Any]]]:
    """Every device's gradients divided by ``total`` (a count on device ``at``)."""
    with tf.device(at):
        inverse = ops.divide_no_nan(1.0, total)
    out = {}
    for device, (gs, vs) in grads.items():
        with tf.device(device):
            out[device] = ([_times_sparse(g, inverse) for g in gs], vs)
    return out


def _times_sparse(g: Any, factor: Any) -> Any:
    """A gradient times a scalar, a sparse one kept sparse (its rows scaled)."""
    if isinstance(g, tf.IndexedSlices):
        return tf.IndexedSlices(g.values * ops.cast(factor, g.values.dtype), g.indices,
                                g.dense_shape)
    return g * ops.cast(factor, g.dtype)


def _sum_of_squares(g: Any) -> Any:
    """The squared norm of a gradient as Keras' clipping computes it (a sparse one's rows
    squared as they are, before duplicates are summed)."""
    values = g.values if isinstance(g, tf.IndexedSlices) else g
    return ops.sum(ops.square(ops.cast(values, "float32")))


def _times(g: Any, factor: Any) -> Any:
    """A gradient times a scalar, dense as Keras' global clipping leaves it: one device's
    ``clip_by_global_norm`` multiplies a ``tf.IndexedSlices`` with ``*``, which TensorFlow
    converts to a dense tensor (its duplicate rows summed) before the update."""
    g = tf.convert_to_tensor(g)
    return g * ops.cast(factor, g.dtype)


def _all_computed(grads: list[list[Any]]) -> list[list[Any]]:
    """``grads``, each available only once every one of them is computed. A recomputed
    layer (``tf.recompute_grad``) reads its weights again in the backward, also for the
    gradient of its input, which no gradient of its own weights waits for; without this
    the update of its weights could run first and the layers below would see the new
    values (seen: 1 run in 6 of the MLP under full recomputation, its second loss 0.2%
    off)."""
    flat = [t for gs in grads for g in gs if g is not None
            for t in ((g.values, g.indices) if isinstance(g, tf.IndexedSlices) else (g,))]
    out = []
    for gs in grads:
        row = []
        for g in gs:
            if g is None:
                row.append(g)
                continue
            with tf.device(g.device), tf.control_dependencies(flat):
                row.append(tf.IndexedSlices(tf.identity(g.values), tf.identity(g.indices),
                                            g.dense_shape)
                           if isinstance(g, tf.IndexedSlices) else tf.identity(g))
        out.append(row)
    return out


def _gradients(tape: Any, loss: Any, variables: list[Any]) -> list[Any]:
    """d loss / d variables (zeros where the loss does not reach a variable)."""
    gs = tape.gradient(loss, variables)
    return [tf.zeros_like(v) if g is None else g for g, v in zip(gs, variables)]


def _along_rows(valid: Any, like: Any) -> Any:
    """The row flags shaped to multiply ``like`` (rows first, any further axes)."""
    return ops.reshape(valid, (-1,) + (1,) * (len(like.shape) - 1))


def _flagged(valid: Any, sw: Any, mask: Any, y_pred: Any) -> Any:
    """The sample weights with padding rows at 0 (the flags alone where none were given,
    shaped as the output's Keras mask where it has one: Keras multiplies the two; else as
    the loss of each output element, which Keras' losses give for every axis of the
    output but the last: [rows, seq] for a sequence's tokens)."""
    if sw is None:
        if mask is not None:
            return _along_rows(valid, mask)
        if tf.is_tensor(y_pred) and len(y_pred.shape) > 2:
            return ops.reshape(valid, (-1,) + (1,) * (len(y_pred.shape) - 2))
        return valid
    sw = ops.cast(sw, "float32")
    return sw * _along_rows(valid, sw)


def _real_rows(valid: Any, structure: Any) -> Any:
    """Every tensor of ``structure`` without its padding rows (a Keras mask kept along)."""
    keep = valid > 0.5

    def cut(t: Any) -> Any:
        if t is None:
            return None
        out = tf.boolean_mask(t, keep)
        mask = compat.get_keras_mask(t)
        if mask is not None:
            compat.set_keras_mask(out, tf.boolean_mask(mask, keep))
        return out

    return tf.nest.map_structure(cut, structure)


def _without_padding(term: Any, valid: Any, run: Any) -> Any:
    """An ``add_loss`` term of a part; refused where the part holds padding rows (it is
    computed over every row of the part, so the padding would change it)."""
    check = tf.debugging.assert_equal(
        ops.sum(1.0 - valid), 0.0,
        message=(f"Plan {run.plan_name!r}: the model adds losses (add_loss, activity "
                 "regularizers) over its rows, and this batch is smaller than the plan's "
                 f"global batch ({run.global_batch}); it is padded (the plan's collectives "
                 "fix the batch's shape) and the padding rows would change those terms. "
                 "Batch the data with drop_remainder=True."))
    with tf.control_dependencies([check]):
        return tf.identity(term)


def _reduction(loss: Any) -> str:
    """The reduction of a compiled loss ("sum_over_batch_size" for names and functions)."""
    return getattr(loss, "reduction", None) or "sum_over_batch_size"
