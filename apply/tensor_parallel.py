"""Tensor-parallel plans: split layers whose shards live on their tensor-parallel devices.

Pipeline position: ``apply.wrap`` calls ``wrap_tensor_parallel`` for a plan with
``strategy.tp > 1``; ``Plan.tp_splits`` says how each split layer is cut
(``apply.sharded_layers``: column, row, heads, vocab, Megatron-LM's layout), every
other layer is replicated. Stage ``s`` of the plan lists ``dp * tp`` devices, tensor
rank innermost (``stages[s].devices[r * tp + t]`` is rank t of replica r,
``planner.plan``).

* Each split layer of replica r is re-created sharded over its stage's
  ``devices[r * tp:(r + 1) * tp]``; every other layer is built, and runs, on rank
  0 of its stage (``devices[r * tp]``). Replicated layers are therefore not
  duplicated on every rank as in Megatron-LM, which changes where work runs, not
  the result.
* A split may name a block's sub-layer (``block/sub``, at any depth, in a nested model
  too; ``apply.blocks``): the block is re-created on its stage's rank 0 (a nested model
  whole, from its config) and the sub-layer is swapped for its sharded twin in place (the
  parent's attribute and Keras' tracking); the block's own code runs unsplit on rank 0.
  A nested model whose layers span stages has their weights moved and its operations
  placed on their stages (``apply.blocks.place_nested``).
* Everything else is ``apply.pipeline``'s: each operation runs under its layer's
  device, gradients come from ``tf.gradients`` (colocated with their forward ops,
  so each shard's backward runs on its rank), optimizer slots and updates sit with
  each shard's variable (so a shard's slots live on its rank), micro-batches
  accumulate gradients, pipeline stages (pp > 1) run on their own devices.
* Data parallelism around it (dp > 1, one host): replica r is a copy of the
  sharded model on its own devices; each (micro-)batch is cut in dp parts, replica
  r runs part r, the loss is the whole batch's, and each copy of a weight is
  updated with the sum of every replica's gradient for it, summed by a placed
  ``add_n`` on that copy's device (the same sum in the same order everywhere, so
  the copies stay equal). The model returned is replica 0; ``weights``, weight
  files and ``get_weights`` hold one copy, ``trainable_variables`` (what is
  trained, with its optimizer slots) every copy. ``global_clipnorm`` is computed over
  one copy (``apply.clipping``), as on one device. Losses the layers add (``add_loss``,
  activity regularizers, a MoE layer's load-balancing loss) count as the mean over the
  replicas of each one's, as under MirroredStrategy (weight regularizers, equal on every
  copy, are unchanged). ``set_reduction_groups`` gives a weight whose copies differ
  (``apply.expert_parallel``'s expert shards) its own partition of the replicas: its
  gradient summed over its part only, weights synced and the clip norm counted by part.
* Sequence parallelism (``strategy.sequence_parallel``, Korthikanti et al. 2022, Sec.
  4.2.2): the unsplit per-token layers (LayerNormalization, residual Adds, Dropout,
  activations) run once per tensor rank on its 1/tp of the sequence instead of whole
  on rank 0; split layers all-gather the sequence before and reduce-scatter it after
  (``apply.sequence_parallel``, which also says what runs gathered).
* ZeRO-1 (``strategy.optimizer_sharding`` with dp > 1): ``apply.zero`` instead; one
  owner copy per weight (``planner.zero``) holds the optimizer slots, gets the sum on
  its device, is updated, and is copied to the other replicas (a weight with reduction
  groups: one owner per group, copied within its group). ZeRO-2 also reduces
  each micro-batch's gradients onto the owners (``apply.zero``). ZeRO-3 keeps one
  persistent copy of each weight, the owner's, and gathers it onto each replica for
  every layer's forward and backward (``apply.zero3``); ``trainable_variables`` are then
  the owners' copies.
* Weights are copied from the user's model, so training gives the single-device
  losses; the wrapped model's ``get_weights``/``set_weights``, weight files and
  saved models are the user's model's (unsplit arrays, in its order).

Across worker processes every plan runs one program per worker on the SPMD engine
(``apply.spmd``). Not applied: the layer configurations
``apply.sharded_layers`` lists, and the splits ``apply.dimensions.split_refusal`` refuses
(a block's own entry, a nested model's own layers, subclasses but keras_hub's
CachedMultiHeadAttention).
"""
from __future__ import annotations

from typing import Any, Callable, Collection, Mapping, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.batches import concat_batches, split_microbatches
from tfplan.apply.blocks import (InnerSplit, holds_shards, placed_clone, resolve_splits,
                                 set_unsplit_weights, shard_inside, unsplit_layout,
                                 unsplit_weights)
from tfplan.apply.checkpoint import CanonicalWeight, merged_copies, plain_layout
from tfplan.apply.clipping import clipped_over_one_copy, optimizer_clipping_off
from tfplan.apply.cloning import clone_layer, copy_weights
from tfplan.apply.gradients import sum_gradients
from tfplan.apply.mode import Processes, run_processes
from tfplan.apply.offload import weights_device
from tfplan.apply.pipeline import PlacedModel
from tfplan.apply.placement import tf_variable
from tfplan.apply.schedule import active_trace, schedule_of
from tfplan.apply.sequence_parallel import (gathered_layers, sequence_layers,
                                            sequence_sharded, warn_gathered)
from tfplan.apply.sharded_attention_block import first_calls
from tfplan.apply.sharded_base import Sharded
from tfplan.apply.sharded_layers import sharded_clone
from tfplan.apply.zero import apply_sharded, owned_variables, reduce_to_owners
from tfplan.apply.zero3 import install as install_zero3
from tfplan.core.errors import PlannerError
from tfplan.planner.plan import Plan


Substitute = Callable[[Any, int, str], Any]  # (layer, replica, its device) -> layer or None


@keras.saving.register_keras_serializable(package="tfplan")
class TensorParallelModel(PlacedModel):
    """A PlacedModel whose split layers run on several devices each.

    With dp > 1 it is replica 0 and holds the other replicas (same layers and weights on
    their own tp devices, ``_Replicas``): see ``wrap_tensor_parallel``.
    """

    optimizer_sharding = False  # ZeRO-1 across the dp replicas (apply.zero)
    zero_stage = 0  # 2: gradients accumulated on their owners too (apply.zero)
    _zero3: Any = None  # ZeRO-3: this replica's apply.zero3.Gathering

    def __init__(self, inputs: Any, outputs: Any, name: str | None = None, *,
                 tp_devices: Sequence[str] = (),
                 sequence_layers: dict[str, tuple[str, ...]] | None = None,
                 sequence_gathered: Collection[str] = (), **kwargs: Any) -> None:
        super().__init__(inputs, outputs, name=name, **kwargs)
        # every device the model touches (compile refuses XLA when there are several)
        self.stage_devices = tuple(dict.fromkeys([*self.stage_devices, *tp_devices]))
        self._others = _Replicas(())
        self._reduction = _ReductionGroups({})  # every replica, unless set_reduction_groups
        # sequence parallelism (apply.sequence_parallel): {per-token layer: its tp devices},
        # and the unsplit layers that run on the whole sequence: those not per-token, and
        # per-token ones whose inputs turned out not [batch, seq, hidden] when traced
        self.sequence_layers = dict(sequence_layers or {})
        self.sequence_gathered: set[str] = set(sequence_gathered)

    def _placed(self, op: Any, fn: Any, trace: Any) -> Any:
        if self._zero3 is not None:  # ZeRO-3: the layer's weights gathered from their owners
            fn = self._zero3.wrap(op, fn)
        devices = self.sequence_layers.get(getattr(op, "name", None))
        if devices:  # a per-token layer: once per tensor rank, on its sequence piece
            fn = sequence_sharded(op, fn, devices, self.sequence_gathered)
        return super()._placed(op, fn, trace)

    # --- data parallel replicas (dp > 1) ---------------------------------------------------
    def _set_replicas(self, replicas: Sequence[Any]) -> None:
        self._others = _Replicas(tuple(replicas))  # a plain object: Keras does not track it
        self.stage_devices = tuple(dict.fromkeys(
            [*self.stage_devices, *(d for r in replicas for d in r.stage_devices)]))

    def replica_models(self) -> tuple[Any, ...]:
        return (self, *self._others.models)

    def set_reduction_groups(self, groups: Mapping[int, Sequence[Sequence[int]]]) -> None:
        """Weights whose data-parallel copies are not all copies of one value: {id(replica
        0's variable): a partition of the replicas 0..dp-1}. A copy's gradient is summed over
        its part only, ``set_weights``/``load_weights`` copy it from its part's first
        replica, and ``global_clipnorm`` counts one copy per part (expert shards,
        ``apply.expert_parallel``: the replicas with the same ep rank). Every other weight:
        one part, all replicas."""
        self._reduction = _ReductionGroups(
            {key: tuple(tuple(part) for part in parts) for key, parts in groups.items()})

    def reduction_groups(self, variable: Any) -> tuple[tuple[int, ...], ...]:
        """The partition of the replicas ``variable`` (replica 0's) is reduced over."""
        dp = 1 + len(self._others.models)
        return self._reduction.groups.get(id(variable), (tuple(range(dp)),))

    @property
    def trainable_variables(self) -> list[Any]:
        """Replica 0's trainable variables, then each other replica's, in the same order
        (what the train step differentiates and the optimizer updates); under ZeRO-3 the
        one persistent copy of each weight, its owner's (``apply.zero3``)."""
        if self._zero3 is not None and self._others.models:
            return self._zero3.weights.owner_variables()
        own = list(super().trainable_variables)
        return own + [v for r in self._others.models for v in r.trainable_variables]

    def _forward_loss(self, x: Any, y: Any, sample_weight: Any) -> tuple[Any, Any, Any]:
        if not self._others.models:
            return super()._forward_loss(x, y, sample_weight)
        replicas = (self, *self._others.models)
        parts = split_microbatches((x, None, None), len(replicas), self._batch_error)
        predictions, added = [], []
        for model, (xr, _, _) in zip(replicas, parts):
            predictions.append(model(xr, training=True))
            added.append(list(model.losses))  # add_loss, regularizers: this replica's
        with tf.device(self.output_device):  # the loss of the whole (micro-)batch
            y_pred = concat_batches(predictions)
            loss = compat.compute_loss(self, x=x, y=y, y_pred=y_pred,
                                       sample_weight=sample_weight, training=True)
            if any(added[1:]):  # Keras added replica 0's losses; make it every replica's mean
                loss = loss + _replica_mean_correction(added)
            scaled = self._scale_loss(loss)
        return y_pred, loss, scaled

    @property
    def sharded_weights(self) -> Any:
        """ZeRO-3: the weight groups (``apply.zero3.ShardedWeights``: each weight's copies,
        the devices they were planned on, its owner); None otherwise."""
        return self._zero3.weights if self._zero3 is not None else None

    def _loss_and_gradients(self, x: Any, y: Any, sample_weight: Any,
                            variables: list[Any]) -> tuple[Any, Any, list[Any]]:
        if self._zero3 is None or not self._others.models:
            return super()._loss_and_gradients(x, y, sample_weight, variables)
        # ZeRO-3: gradients of every replica's reads of each weight, summed on its owner
        sharded = self._zero3.weights
        with sharded.recording() as reads:
            if tf.executing_eagerly():
                with tf.GradientTape() as tape:
                    y_pred, loss, scaled = self._forward_loss(x, y, sample_weight)
                grads = tape.gradient(scaled, [s for _, _, s in reads])
                return y_pred, loss, sharded.reduce(reads, grads)
            y_pred, loss, scaled = self._forward_loss(x, y, sample_weight)
        trace = active_trace()  # 1F1B / interleaved, as PlacedModel
        received = trace.received_activations() if trace is not None else []
        grads = tf.gradients(scaled, [s for _, _, s in reads] + received,
                             unconnected_gradients=tf.UnconnectedGradients.NONE)
        summed = sharded.reduce(reads, grads[:len(reads)])
        if trace is not None:
            trace.record_backward(variables, summed, grads[len(reads):])
        return y_pred, loss, summed

    def _after_compile(self) -> None:
        if self._zero3 is not None:  # ZeRO-3: trainable_variables are the owners
            super()._after_compile()
            return
        if self.optimizer_sharding and self._others.models:  # ZeRO-1: the owners' slots only
            variables = self.trainable_variables
            dp = 1 + len(self._others.models)
            self._build_slots(owned_variables(variables, dp, self._partitions(variables, dp)))
            return
        super()._after_compile()

    def _microbatch_gradients(self, gradients: list[Any], variables: list[Any]) -> list[Any]:
        dp = 1 + len(self._others.models)
        if dp > 1 and self.optimizer_sharding and self.zero_stage == 2:  # on the owners
            return reduce_to_owners(gradients, variables, dp, self._partitions(variables, dp))
        return gradients

    def _partitions(self, variables: list[Any], dp: int) -> list[tuple[tuple[int, ...], ...]]:
        """Each weight's reduction partition (replica 0's variables, the first 1/dp of
        ``variables``): ``apply.zero``'s groups, an expert shard's copies per ep rank."""
        return [self.reduction_groups(v) for v in variables[:len(variables) // dp]]

    def _apply_gradients(self, gradients: list[Any], variables: list[Any]) -> None:
        dp = 1 + len(self._others.models)
        if self._zero3 is not None:  # ZeRO-3: the owners' sums, the owners' update
            super(TensorParallelModel, self)._apply_gradients(gradients, variables)
            return
        if dp > 1 and self.optimizer_sharding:  # ZeRO-1: reduce, owner update, copy out
            apply_sharded(super()._apply_gradients, gradients, variables, dp,
                          self._partitions(variables, dp))
            return
        if dp > 1:  # each copy of a weight gets the sum of all replicas' gradients for it
            n = len(variables) // dp  # (of its reduction group's: set_reduction_groups)
            summed = list(gradients)
            for i in range(n):
                if any(gradients[r * n + i] is None for r in range(dp)):
                    continue
                for part in self.reduction_groups(variables[i]):
                    grads = [gradients[r * n + i] for r in part]
                    for r in part:  # the same sum, in the same order, on each replica
                        with tf.device(tf_variable(variables[r * n + i]).device):
                            summed[r * n + i] = sum_gradients(grads)
            one_copy = [summed[part[0] * n + i] for i in range(n)  # global_clipnorm's
                        for part in self.reduction_groups(variables[i])]
            gradients = clipped_over_one_copy(self.optimizer, summed, variables, dp,
                                              one_copy=one_copy)
            with optimizer_clipping_off(self.optimizer):  # global_clipnorm: apply.clipping
                super()._apply_gradients(gradients, variables)
            return
        super()._apply_gradients(gradients, variables)

    # the user's model's weights, in its order and shapes (layer by layer, unsplit; a block
    # or nested model holding split sub-layers through apply.blocks)
    def get_weights(self) -> list[np.ndarray]:
        return [w for layer in self.layers for w in _unsplit(layer)]

    def set_weights(self, weights: Sequence[Any]) -> None:
        weights, start = list(weights), 0
        counts = [len(_unsplit(layer)) for layer in self.layers]
        if sum(counts) != len(weights):
            raise ValueError(f"Model {self.name!r} has {sum(counts)} weight arrays (unsplit, "
                             f"as the original model); set_weights received {len(weights)}.")
        for layer, n in zip(self.layers, counts):
            if n and holds_shards(layer) and not isinstance(layer, Sharded):
                set_unsplit_weights(layer, weights[start:start + n])
            elif n:
                layer.set_weights(weights[start:start + n])
            start += n
        self._sync_replicas()

    def load_weights(self, *args: Any, **kwargs: Any) -> Any:
        out = super().load_weights(*args, **kwargs)
        self._sync_replicas()
        return out

    def _checkpoint_layout(self) -> list[CanonicalWeight]:
        """Each weight of the user's model: its shards (a split layer's ``full_pieces``)
        in every data-parallel copy (``apply.checkpoint``)."""
        return merged_copies([_replica_layout(m) for m in (self, *self._others.models)])

    def _sync_replicas(self) -> None:
        """Copy replica 0's weights to the others (after set_weights / load_weights); a
        weight with reduction groups from its group's first replica."""
        replicas = self.replica_models()
        for r, replica in enumerate(replicas[1:], start=1):
            for i, (mine, theirs) in enumerate(zip(self.weights, replica.weights)):
                source = next(part[0] for part in self.reduction_groups(mine) if r in part)
                if source != r:
                    theirs.assign(replicas[source].weights[i])


def _unsplit(layer: Any) -> list[np.ndarray]:
    """``layer.get_weights()`` of the user's layer (``apply.blocks.unsplit_weights`` for a
    block or nested model holding split sub-layers)."""
    if holds_shards(layer) and not isinstance(layer, Sharded):
        return unsplit_weights(layer)
    return layer.get_weights()


def _replica_layout(model: Any) -> list[CanonicalWeight]:
    out: list[CanonicalWeight] = []
    for layer in model.layers:
        if hasattr(layer, "full_pieces"):  # apply.sharded_layers
            if layer.trainable:
                out += [CanonicalWeight((tuple(shards),), axis)
                        for shards, axis in layer.full_pieces()]
        elif holds_shards(layer):  # a block or nested model with split sub-layers
            out += unsplit_layout(layer)
        else:
            out += plain_layout(layer.trainable_weights)
    return out


def _replica_mean_correction(added: Sequence[Sequence[Any]]) -> Any:
    """What turns replica 0's added losses (which Keras' loss already holds) into the
    mean of every replica's: ``mean_r(L_r) - L_0``. Each replica's add_loss values (a MoE
    layer's load-balancing loss, activity regularizers) are its part of the batch's, as
    under MirroredStrategy; weight regularizers are equal on every copy, so unchanged."""
    totals = [tf.add_n([tf.cast(v, tf.float32) for v in losses]) if losses
              else tf.constant(0.0) for losses in added]
    return tf.add_n(totals) / float(len(totals)) - totals[0]


class _ReductionGroups:
    """{id(replica 0's variable): partition of the replicas} (out of Keras' sight)."""

    def __init__(self, groups: dict[int, tuple[tuple[int, ...], ...]]) -> None:
        self.groups = groups


class _Replicas:
    """The other data-parallel replicas of a TensorParallelModel, out of Keras' sight (their
    weights are replica 0's: weight files and ``model.weights`` hold one copy)."""

    def __init__(self, models: tuple[Any, ...]) -> None:
        self.models = models


def wrap_tensor_parallel(view: Any, plan: Plan, device_of_layer: dict[str, str], *,
                         recompute_layers: Collection[str] = (),
                         substitute: Substitute | None = None) -> TensorParallelModel:
    """Clone ``view`` with ``plan.tp_splits``' layers sharded over their stage's tp
    devices, every other layer on its stage's rank 0, once per data-parallel replica
    (replica r on ``devices[r * tp:(r + 1) * tp]`` of each stage); copy the weights.

    dp > 1: replica 0 is the model returned; each training (micro-)batch is cut in dp
    parts, replica r runs part r, the loss is the whole batch's, and every copy of a
    weight is updated with the sum of all replicas' gradients for it (placed ``add_n``
    on each copy's device), so the copies stay equal and train like one device.

    ``substitute(layer, r, device)``: a new, unbuilt layer replica r uses instead of a
    clone of ``layer`` (built on ``device`` like any layer), or None for the usual clone
    (``apply.expert_parallel``'s twins).
    """
    tp, dp = plan.strategy.tp, plan.strategy.dp
    if run_processes(plan) is Processes.PER_WORKER:  # one program per worker
        raise PlannerError(
            f"Plan {plan.name!r} runs one program per worker; it runs through apply.wrap "
            "(the SPMD engine builds each worker's part), not wrap_tensor_parallel on the "
            "whole plan.")
    # top-level splits, and splits of sub-layers inside blocks (apply.blocks)
    splits, inner = resolve_splits(view, plan)
    models = []
    for r in range(dp):
        shift = {stage.devices[0]: stage.devices[r * tp] for stage in plan.stages}
        models.append(_replica(view, plan, r, {k: shift[d] for k, d in device_of_layer.items()},
                               splits, inner, recompute_layers, substitute))
    model = models[0]
    warn_gathered(plan.name, model.sequence_gathered)
    if dp > 1:
        if plan.strategy.zero_stage == 3:  # one persistent copy of each weight (apply.zero3)
            install_zero3(models, plan.name)
        model._set_replicas(models[1:])
        model.num_replicas = dp  # batches must split in dp x num_microbatches parts
        model.optimizer_sharding = plan.strategy.optimizer_sharding  # ZeRO-1: apply.zero
        model.zero_stage = plan.strategy.zero_stage
    return model


def _replica(view: Any, plan: Plan, r: int, device_of_layer: dict[str, str],
             splits: dict[str, str], inner: dict[str, list[InnerSplit]],
             recompute_layers: Collection[str],
             substitute: Substitute | None = None) -> TensorParallelModel:
    tp = plan.strategy.tp
    shard_devices = {name: tuple(stage.devices[r * tp:(r + 1) * tp])
                     for stage in plan.stages for name in stage.layers}
    device_of_entry = {name: devices[0] for name, devices in shard_devices.items()}
    on_host = weights_device(plan)  # "optimizer+weights": built on the host (apply.offload)

    def where(layer: Any) -> Any:
        device = device_of_layer.get(layer.name, "")
        return tf.device(on_host(device) if on_host and device else device)

    sp = plan.strategy.sequence_parallel and tp > 1

    def clone_function(layer: Any) -> Any:
        with where(layer):
            twin = substitute(layer, r, device_of_layer.get(layer.name, "")) \
                if substitute is not None else None
            if twin is not None:
                return twin
            split = splits.get(layer.name, "")
            if split:
                return sharded_clone(layer, split, shard_devices[layer.name], plan.name,
                                     sequence_parallel=sp)
            clone = clone_layer(layer)
        # a nested model's layers on their own stages (apply.blocks)
        return placed_clone(layer, clone, device_of_entry, on_host)

    def call_function(layer: Any, *args: Any, **kwargs: Any) -> Any:
        with where(layer):
            out = layer(*args, **kwargs)  # builds it (a nested model is built already)
        if layer.name in inner and id(layer) not in swapped:  # once, at its first call
            swapped.add(id(layer))  # its split sub-layers, swapped in place (apply.blocks)
            with where(layer):  # how attention blocks split whole are called, to check them
                calls = first_calls(layer, args, kwargs, [s.block_class for s in
                                                          inner[layer.name] if s.block_class])
            shard_inside(layer, inner[layer.name], shard_devices.__getitem__, plan.name,
                         calls)
        return out

    swapped: set[int] = set()

    clone = keras.models.clone_model(view, clone_function=clone_function,
                                     call_function=call_function)
    stages = tuple(dict.fromkeys(device_of_layer.values()))
    model = TensorParallelModel(
        clone.inputs, clone.outputs, name=view.name, device_of_layer=device_of_layer,
        default_device=stages[0], plan_name=plan.name,
        num_microbatches=plan.strategy.num_microbatches, num_replicas=1,
        recompute_layers=recompute_layers, schedule=schedule_of(plan),  # apply.schedule
        tp_devices=[d for stage in plan.stages for d in stage.devices[r * tp:(r + 1) * tp]],
        sequence_layers=sequence_layers(view.layers, splits, shard_devices.get) if sp else None,
        sequence_gathered=gathered_layers(view.layers, splits) if sp else ())
    copy_weights(view, model)
    return model
