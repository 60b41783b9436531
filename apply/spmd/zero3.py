"""ZeRO-3 on the SPMD engine: each data-parallel rank holds 1/dp of every weight, gathers a
layer's weights for its forward and again for its backward, and receives only its shard of
their gradients.

Pipeline position: part of ``SpmdModel`` (``apply.spmd.model``) when the run description's
``zero_stage`` is 3 with dp > 1: ``install`` runs once on the devices' copies after
``apply.spmd.zero.ZeroShards`` has cut their weights into shards (the same per-parameter
cut along the first axis as ZeRO-1/2), which are then the weights trained: the optimizer is
built on them and updates them in place, and nothing is gathered after the update.

How a layer runs (ZeRO stage 3, P_os+g+p: Rajbhandari et al., SC'20, Sec. 5.3; the unit is a
top-level layer of the copy, as FSDP wraps a transformer block, a nested model's layers
each):

* **Forward.** The layer's call all-gathers its shards over the device's data-parallel group
  (one collective per dtype, kind ``zero``) and runs with the gathered values
  (``keras.StatelessScope``: its variables read them; they are not written).
* **Backward.** The call runs under ``tf.recompute_grad`` (``apply.recompute``): TensorFlow
  keeps only the layer's inputs, and the backward all-gathers the shards again and re-runs
  the layer's forward (TensorFlow's gradient ops read the weights they were made with, so
  a gathered weight kept for the backward would stay on the device from forward to
  backward: ZeRO-3's memory is what the recomputation buys; the recomputed forward is its
  price, as ``planner.pricing`` counts it). The gradient of the gather is a reduce-scatter
  over the group (kind ``dp``; between CPUs the all-reduce stand-in): each rank receives the
  sum of its shard's rows, one collective per dtype and micro-batch. An Embedding's table is
  gathered on its own, and its sparse gradient (its looked-up rows) all-gathered and
  filtered to the shard's rows, as under ZeRO-1/2: the optimizer sees one device's rows.

Layers holding non-trainable variables (BatchNormalization's moving statistics, a dropout's
seed state) would update them in a stateless call not at all, and twice in the
recomputation: ``install`` refuses them, naming the layer.

Under ``offload="optimizer+weights"`` the shards (the weights trained) live on the
device's host CPU with their optimizer state and update; each gather reads its shard from
there (ZeRO-Infinity's parameter offload, Rajbhandari et al., SC'21, Sec. 5).

The copies' own variables of the gathered weights give up their storage
(``compat.free_storage``): every read of them in a step goes through the gather, and the
weights read and write as the user's model's through the shards (``ZeroShards.read`` /
``write``), so a device holds 1/dp of its copy's weights (and a layer's gathered ones
while it runs).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.apply.collective_ops import member_all_gather, member_reduce_scatter
from tfplan.apply.recompute import recompute_call
from tfplan.apply.spmd.reduction import gathered_slices
from tfplan.core.errors import PlannerError


def install(copies: Any, zero: Any) -> None:
    """Every unit layer of every copy gathered from the shards (module docstring)."""
    run = copies.run
    for q, row in enumerate(copies.models):
        for t, model in enumerate(row):
            if model is None:  # another worker's column
                continue
            # (another worker's chunks' layers never run here: not gathered)
            index = {id(zero.weights[q][t][i]): i for i in zero.own(q, t)}
            for layer in _units(model):
                mine = [index[id(v)] for v in layer.trainable_variables if id(v) in index]
                if not mine:
                    continue
                if layer.non_trainable_variables:
                    raise PlannerError(
                        f"Plan {run.plan_name!r} runs ZeRO-3 on the SPMD engine, and layer "
                        f"{layer.name!r} holds non-trainable state "
                        f"({layer.non_trainable_variables[0].path!r}) that its gathered, "
                        "recomputed call would update not at all or twice. Re-plan with "
                        "--zero-stage 2 (or 1).")
                layer.call = recompute_call(
                    _gathered(layer, layer.call, mine, zero, q, t), tape_only=True)
                for i in mine:  # read only through the gathers from now on
                    compat.free_storage(zero.weights[q][t][i])


def _units(model: Any) -> list[Any]:
    """The layers gathered as one: the copy's top-level layers, a nested model's own."""
    out = []
    for layer in getattr(model, "layers", ()):
        if isinstance(layer, keras.Model) and getattr(layer, "layers", None):
            out += _units(layer)
        else:
            out.append(layer)
    return out


def _gathered(layer: Any, call: Callable[..., Any], mine: Sequence[int], zero: Any, q: int,
              t: int) -> Callable[..., Any]:
    """``layer``'s ``call`` on its weights gathered from the shards ``mine`` (indices into
    copy (q, t)'s trainable weights)."""
    weights = [zero.weights[q][t][i] for i in mine]

    def run(*args: Any, **kwargs: Any) -> Any:
        full = gather_weights(zero, q, t, mine)
        with keras.StatelessScope(state_mapping=list(zip(weights, full))):
            return call(*args, **kwargs)
    return run


def gather_weights(zero: Any, q: int, t: int, indices: Sequence[int]) -> list[Any]:
    """Copy (q, t)'s weights ``indices``, whole, from every rank's shards: one all-gather per
    device and dtype (``ZeroShards.wholes``; an Embedding's table, in ``zero.tables``, on
    its own), each the gradient's reduce-scatter."""
    run = zero.run
    out: list[Any] = [None] * len(indices)
    dense = [n for n, i in enumerate(indices) if id(zero.weights[q][t][i]) not in zero.tables]
    for n, whole in zip(dense, zero.wholes(q, t, [indices[n] for n in dense],
                                           _gather_dense_grad)):
        out[n] = whole
    for n, i in enumerate(indices):
        if out[n] is not None:
            continue
        cut, device = zero.cuts[q][t][i], zero.devices[q][t][i]
        with tf.device(device):  # an Embedding's table: its gradient stays sparse
            whole = _gather_sparse_grad(zero.shards[q][t][i].value, cut,
                                        run.chunk_group("dp", device), device, q)
            whole.set_shape((run.dp * cut.per_shard, *cut.row_shape))
            if cut.rows != run.dp * cut.per_shard:  # padding rows cut (dense)
                whole = whole[:cut.rows]
        out[n] = whole
    return out


def _gather_dense_grad(packed: Any, group: Any, device: str) -> Any:
    """All-gather forward; its gradient reduce-scattered back to this rank's part."""

    @tf.custom_gradient
    def gather(x: Any) -> Any:
        def grad(dy: Any) -> Any:
            return member_reduce_scatter(tf.convert_to_tensor(dy), group, device, "dp")
        return member_all_gather(x, group, device, "zero"), grad

    return gather(packed)


def _gather_sparse_grad(shard: Any, cut: Any, group: Any, device: str, q: int) -> Any:
    """An Embedding table's all-gather; its sparse gradient all-gathered and cut to the
    shard's rows (module docstring)."""

    @tf.custom_gradient
    def gather(x: Any) -> Any:
        def grad(dy: Any) -> Any:
            if not isinstance(dy, tf.IndexedSlices):
                rows = tf.reshape(tf.convert_to_tensor(dy), (group.size * cut.per_shard, -1))
                total = member_reduce_scatter(rows, group, device, "dp")
                return tf.reshape(total, cut.shard_shape)
            return cut.rows_of(gathered_slices(dy, group, device), q)
        return member_all_gather(x, group, device, "zero"), grad

    return gather(shard)
