"""ZeRO-1 and ZeRO-2 on the SPMD engine: each data-parallel rank keeps the optimizer state of
1/dp of every weight (stage 1) and receives only that share of the summed gradients
(stage 2 also for each micro-batch).

Pipeline position: part of ``SpmdModel``'s step (``apply.spmd.model``) when the run
description's ``zero_stage`` is 1 or 2 with dp > 1. ``ZeroShards`` is made once from the
devices' copies; ``SpmdModel.compile`` builds the optimizer on its shards.

How it works (ZeRO's stages 1 and 2, Rajbhandari et al., SC'20, Sec. 5.1-5.2, with
per-parameter shards cut along the first axis as PyTorch's FSDP2 ``fully_shard`` cuts them):

* **Shards.** A weight of shape [d0, ...] (a scalar counts as [1]) is padded to dp r
  rows, r = ceil(d0 / dp); replica q's shard is rows [q r, (q+1) r), a variable on each of
  that replica's devices. Where d0 does not divide by dp, the rows are the positions of
  the fewest leading axes that do (``lead_axes``: a 3x3 kernel [3, 3, c, k] over 2
  replicas is cut as [9 c, k]), so no bytes are padding (an Embedding's table keeps its
  rows: its sparse gradient's ids name them) (tensor rank t holds the shard of its own slice of a split
  weight). The optimizer is built on the shards only: each device holds 1/dp of its
  copy's optimizer state (``planner.pricing`` divides it by dp). The padding rows get zero
  gradients and are never read back.
* **Each step** a shard is first read from the device's own copy of the weight (a local
  slice), so weight files, ``set_weights`` and the copies never disagree with it.
* **Gradients.** A device's dense gradients of one dtype are packed as [dp, sum_i r_i w_i]
  (weight i's padded rows, w_i elements each, cut into the dp shards) and reduce-scattered
  over its data-parallel group, one collective per dtype (between CPUs the all-reduce
  stand-in of ``apply.collective_ops``): replica q receives the sum of its shards. A sparse
  gradient (``tf.IndexedSlices``: an Embedding's looked-up rows) is all-gathered as without
  ZeRO and each replica keeps the rows inside its shard: the optimizer sees one device's
  rows (Keras' Adam squares a sparse gradient's rows before summing duplicates), so the
  update is one device's exactly. ZeRO-1 reduces the step's gradient once; ZeRO-2 with m
  micro-batches reduces each micro-batch's gradient as soon as it exists and accumulates
  only the shard (m reduce-scatters, as ``planner.traffic`` prices); with pipeline stages,
  each backward slot's gradients of its chunk's weights (``reduce_some``, the pipeline's
  ``reduce`` hook), on the chunk's device over its data-parallel group.
* **Update.** One ``optimizer.apply_gradients`` over every device's (shard gradient, shard)
  pairs: its update math runs beside each shard, and a ``LossScaleOptimizer``'s check for
  non-finite gradients sees every shard of the model at once (all devices skip together).
* **All-gather.** Each device packs its updated shards per dtype and all-gathers them over
  its data-parallel group (kind ``zero``); every copy of a weight then holds the update.

Expert parallelism (``apply.spmd.experts``): an expert shard is held by the dp / ep replicas
of its ep rank only, so its ZeRO shards are cut over that ``edp`` group (dp / ep of them,
replica q holding shard q // ep of its ep rank's experts), its gradients reduce-scattered
and its shards all-gathered there; every other weight over the whole data-parallel group.
The planner prices the experts' state likewise (``planner.experts``).

Elementwise optimizers only: the update of each element depends on that element's
gradient and state alone (SGD, Adam, AdamW, RMSprop, Adagrad, Adadelta, Adamax, Nadam,
Ftrl, Lion). Lamb's trust ratio, Adafactor's factored moments and Muon's orthogonalised
update read a whole weight, which a shard is not: ``check_optimizer`` refuses them with
the fix. ``AdamW``'s exclusions from weight decay follow each weight to its shards.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.collective_ops import member_all_gather, member_reduce_scatter
from tfplan.apply.gradients import sum_gradients
from tfplan.apply.offload import host_device
from tfplan.apply.placement import inner_optimizer
from tfplan.apply.spmd.reduction import gathered_slices
from tfplan.core.errors import PlannerError

ELEMENTWISE = ("SGD", "Adam", "AdamW", "RMSprop", "Adagrad", "Adadelta", "Adamax", "Nadam",
               "Ftrl", "Lion")


@dataclass(frozen=True)
class Cut:
    """How one weight is cut into dp shards: along its leading ``lead`` axes taken as one
    (module docstring)."""

    shape: tuple[int, ...]  # the weight's (in the device's copy)
    dp: int
    lead: int = 1  # the leading axes whose positions are the rows (``lead_axes``)

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:self.lead], dtype=np.int64)) if self.shape else 1

    @property
    def per_shard(self) -> int:
        """r = ceil(d0 / dp): rows of each shard."""
        return -(-self.rows // self.dp)

    @property
    def row_shape(self) -> tuple[int, ...]:
        return self.shape[self.lead:]

    @property
    def width(self) -> int:
        """Elements of one row."""
        return int(np.prod(self.row_shape, dtype=np.int64))

    @property
    def shard_shape(self) -> tuple[int, ...]:
        return (self.per_shard, *self.row_shape)

    def padded(self, value: Any) -> Any:
        """``value`` (the weight's shape) as [dp r, ...] with zero rows after its own."""
        value = tf.reshape(value, (self.rows, *self.row_shape))
        extra = self.dp * self.per_shard - self.rows
        return value if extra == 0 else tf.pad(value, [[0, extra]] + [[0, 0]] * len(self.row_shape))

    def unpadded(self, rows: Any) -> Any:
        """The weight from its dp r padded rows ([dp r, ...], every shard's in order; a
        NumPy array or a tensor): the padding cut, the weight's shape."""
        reshape = np.reshape if isinstance(rows, np.ndarray) else tf.reshape
        return reshape(rows[:self.rows], self.shape)

    def shard_of(self, value: Any, q: int) -> Any:
        """Replica q's rows of ``value`` (a local slice, padded)."""
        r = self.per_shard
        return self.padded(value)[q * r:(q + 1) * r]

    def rows_of(self, g: Any, q: int) -> Any:
        """The rows of a sparse gradient (``tf.IndexedSlices``) inside replica q's shard, as
        the shard's own sparse gradient (ids relative to the shard)."""
        lo = q * self.per_shard
        ids = tf.cast(g.indices, tf.int64)
        inside = tf.logical_and(ids >= lo, ids < lo + self.per_shard)
        return tf.IndexedSlices(tf.boolean_mask(g.values, inside),
                                tf.boolean_mask(ids, inside) - lo,
                                tf.constant(self.shard_shape, tf.int64))


def lead_axes(shape: tuple[int, ...], dp: int) -> int:
    """The fewest leading axes of ``shape`` whose positions divide into dp equal rows (a
    3x3 convolution's kernel [3, 3, c, k] over 2 replicas: 3, its 9 c rows), so no shard
    is padded; 1 (the first axis, padded) where none does."""
    for k in range(1, len(shape) + 1):
        if int(np.prod(shape[:k], dtype=np.int64)) % dp == 0:
            return k
    return 1


def _cut(variable: Any, dp: int, table: bool) -> Cut:
    shape = tuple(int(d) for d in variable.shape)
    return Cut(shape, dp, 1 if table else lead_axes(shape, dp))


def check_optimizer(optimizer: Any, plan_name: str) -> None:
    """Refuse an optimizer whose update reads a whole weight (module docstring)."""
    opt = inner_optimizer(optimizer)
    name = type(opt).__name__
    problem = ""
    if name not in ELEMENTWISE or type(opt).__module__.split(".")[0] != "keras":
        problem = f"{name} is not one of Keras' elementwise optimizers ({', '.join(ELEMENTWISE)})"
    elif getattr(opt, "use_ema", False):
        problem = "use_ema=True keeps a moving average of whole weights"
    elif (getattr(opt, "gradient_accumulation_steps", None) or 1) > 1:
        problem = "gradient_accumulation_steps accumulates whole gradients"
    if problem:
        raise PlannerError(
            f"Plan {plan_name!r} shards the optimizer state (ZeRO) into rows of each weight "
            f"on the SPMD engine, and {problem}. Received optimizer {name}; expected an "
            "elementwise one. Fix: compile with one of those, or use a plan with zero_stage=0 "
            "(plan analyze ... --zero-stage 0).")


class ZeroShards:
    """Every device's shards of its copy's trainable weights (module docstring)."""

    def __init__(self, copies: Any, stage: int) -> None:
        self.run, self.stage = copies.run, stage
        # per column (q, t) this process runs; None for another worker's column
        self.weights = [[None if model is None else list(model.trainable_variables)
                         for model in row] for row in copies.models]
        # the group each weight is sharded over (its gradient's: "edp" or "dp")
        self.kinds = _grid(self.weights, lambda q, t, vs: [copies.reduction_group(v)
                                                           for v in vs])
        # an Embedding's table (``tables``: their ids; ZeRO-3 gathers them on their own) is
        # cut by its rows (its sparse gradient's ids), others along the leading axes that
        # cut without padding
        # another worker's pipeline chunks' weights (a column across workers: built here,
        # never run): no shards here, their holders' are theirs
        self.foreign = copies.foreign
        self.tables = frozenset(id(layer.embeddings) for model in copies.mine
                                for layer in compat.flatten_layers(model)
                                if isinstance(layer, keras.layers.Embedding))
        self.cuts = _grid(self.weights, lambda q, t, vs: [
            _cut(v, self.group_size(kind), id(v) in self.tables)
            for v, kind in zip(vs, self.kinds[q][t])])
        self._index = _grid(self.weights, lambda q, t, vs: {id(v): i for i, v in enumerate(vs)})
        # each weight's device (its chunk's under pipeline parallelism): its shard's too
        self.devices = _grid(self.weights, lambda q, t, vs: copies.weight_devices(q, t))
        self.shards = _grid(self.weights, lambda q, t, vs: self._made(q, t, vs))
        # what every column's trainable weight i is, read from one of this process's (the
        # same in every copy): its index among the copy's weights, its group, a table
        self.copies = copies
        q, t = self.columns[0]
        index = {id(w): j for j, w in enumerate(copies.models[q][t].weights)}
        self.weight_index = [index[id(v)] for v in self.weights[q][t]]
        self.kind_of = list(self.kinds[q][t])
        self.table_of = [id(v) in self.tables for v in self.weights[q][t]]
        self.fetched: dict[tuple[int, int, int], np.ndarray] = {}  # other workers' shards

    def _made(self, q: int, t: int, vs: list[Any]) -> list[Any]:
        """Copy (q, t)'s shard variables, on its weights' devices (ZeRO-3 with the weights
        offloaded: their hosts)."""
        shards: list[Any] = []
        for i, (v, cut, device) in enumerate(zip(vs, self.cuts[q][t], self.devices[q][t])):
            if id(v) in self.foreign:  # another worker's chunk: its shards are there
                shards.append(None)
                continue
            if self.stage == 3 and self.run.offload == "optimizer+weights":
                device = host_device(device)  # the weights trained live there
            with tf.init_scope(), tf.device(device):
                shards.append(keras.Variable(
                    np.zeros(cut.shard_shape, v.dtype), dtype=v.dtype,
                    name=f"zero{self.stage}_shard_q{q}_t{t}_{i}"))
        return shards

    @property
    def columns(self) -> list[tuple[int, int]]:
        """The columns (q, t) this process runs (one host: every one)."""
        return [(q, t) for q, row in enumerate(self.weights)
                for t, vs in enumerate(row) if vs is not None]

    def group_size(self, kind: str) -> int:
        """Replicas a weight sharded over ``kind`` ("dp", "edp") is cut among."""
        return self.run.dp // self.run.ep if kind == "edp" else self.run.dp

    def position(self, q: int, kind: str) -> int:
        """Replica q's shard of a weight sharded over ``kind``."""
        return self.holders(q, kind).index(q)

    def holders(self, q: int, kind: str) -> list[int]:
        """The replicas sharing replica q's weight sharded over ``kind``, in shard order
        (an expert shard's: those of q's ep rank, ``apply.groups``' edp group)."""
        if kind == "edp":
            return [p for p in range(self.run.dp) if self.run.ep_rank(p) == self.run.ep_rank(q)]
        return list(range(self.run.dp))

    @property
    def variables(self) -> list[Any]:
        """Every device's shards: what the optimizer is built on."""
        return [s for row in self.shards for shards in row if shards is not None
                for s in shards if s is not None]

    def exclude_like_weights(self, optimizer: Any) -> None:
        """A weight AdamW leaves out of weight decay leaves its shards out too."""
        opt = inner_optimizer(optimizer)
        if not getattr(opt, "weight_decay", None):
            return
        excluded = [s for q, t in self.columns
                    for v, s in zip(self.weights[q][t], self.shards[q][t])
                    if s is not None and not compat.uses_weight_decay(opt, v)]
        if excluded:
            opt.exclude_from_weight_decay(var_list=excluded)

    # ------------------------------------------------------------------ step
    def load_all(self) -> None:
        """Every shard read from its copy (eagerly: ZeRO-3's start, and after
        ``set_weights``)."""
        for q, t in self.columns:
            self.load(q, t)

    def read(self, q: int, t: int, variable: Any) -> np.ndarray:
        """Copy (q, t)'s ``variable``'s value: joined from every rank's shards where ZeRO-3
        trains it (its own storage is freed; another worker's shards from ``fetched``),
        else its own."""
        j = self._index[q][t].get(id(variable))
        if j is None:
            return np.asarray(variable.numpy())
        return self.joined(q, t, j, lambda shard: np.asarray(shard.numpy()))

    def joined(self, q: int, t: int, i: int, value: Callable[[Any], np.ndarray]) -> np.ndarray:
        """Copy (q, t)'s trainable weight i whole from its holders' shards, each
        ``value(shard variable)`` (the shard, or one of its optimizer slots), another
        worker's from ``fetched`` (``fetch``)."""
        pieces = [value(self.shards[r][t][i]) if self.shards[r][t] is not None
                  and self.shards[r][t][i] is not None else self.fetched[(r, t, i)]
                  for r in self.holders(q, self.kind_of[i])]
        return self.cut(t, i).unpadded(np.concatenate(pieces, axis=0))

    def cut(self, t: int, i: int) -> Cut:
        """How trainable weight i of a tensor-rank-t copy is cut (any process's column)."""
        shape = self.copies.rank_shape(t, self.weight_index[i])
        n = self.group_size(self.kind_of[i])
        return Cut(shape, n, 1 if self.table_of[i] else lead_axes(shape, n))

    def fetch(self, value: Callable[[Any], np.ndarray]) -> None:
        """One program per worker: every column's shards (``value(shard variable)``) from
        the workers holding them into ``fetched`` (``apply.spmd.across.exchanged``; every
        worker calls it)."""
        from tfplan.apply.spmd.across import exchanged

        keys = [(r, t, i) for r in range(self.run.dp) for t in range(self.run.tp)
                for i in range(len(self.weight_index))]
        entries = [(self.copies.owner(r, t, self.weight_index[i]), self.cut(t, i).shard_shape,
                    lambda r=r, t=t, i=i: value(self.shards[r][t][i])) for r, t, i in keys]
        self.fetched = {key: got for key, got in zip(keys, exchanged(self.run, entries))}

    def write(self, q: int, t: int, variable: Any, value: Any) -> None:
        """Copy (q, t)'s ``variable`` set to ``value``: its shard where ZeRO-3 trains it."""
        j = self._index[q][t].get(id(variable))
        if j is None:
            variable.assign(value)
            return
        cut = self.cuts[q][t][j]
        self.shards[q][t][j].assign(np.asarray(cut.shard_of(
            np.asarray(value), self.position(q, self.kinds[q][t][j]))))

    def own(self, q: int, t: int) -> list[int]:
        """The indices of copy (q, t)'s weights whose chunks this process runs (every one
        unless the column's pipeline chunks lie on several workers)."""
        return [i for i, s in enumerate(self.shards[q][t]) if s is not None]

    def shard_of(self, q: int, t: int, weight: Any) -> Any:
        """Copy (q, t)'s shard of ``weight``."""
        return self.shards[q][t][self._index[q][t][id(weight)]]

    def load(self, q: int, t: int) -> None:
        """Copy (q, t)'s shards read from its weights (a local slice on each's device)."""
        for v, s, cut, device, kind in zip(self.weights[q][t], self.shards[q][t],
                                           self.cuts[q][t], self.devices[q][t],
                                           self.kinds[q][t]):
            if s is None:  # another worker's chunk
                continue
            with tf.device(device):
                s.assign(cut.shard_of(v.value, self.position(q, kind)))

    def reduce(self, per_part: Sequence[Sequence[Any]], q: int, t: int) -> list[Any]:
        """Device (q, t)'s shard of the gradient summed over its data-parallel group:
        ``per_part`` holds one gradient list per reduction (one for ZeRO-1; each
        micro-batch's for ZeRO-2), each reduced on its own and the shards accumulated."""
        out: list[Any] = []
        for grads in per_part:
            out = _accumulated(out, self._reduced(grads, q, t))
        return out

    def reduce_some(self, weights: Sequence[Any], grads: Sequence[Any], q: int, t: int
                    ) -> list[Any]:
        """``reduce`` of the gradients of some of copy (q, t)'s weights (a pipeline slot's
        chunk, ZeRO-2): their shards, in ``weights``' order."""
        index = [self._index[q][t][id(w)] for w in weights]
        full: list[Any] = [None] * len(self.weights[q][t])
        for i, g in zip(index, grads):
            full[i] = g
        out = self._reduced(full, q, t)
        return [out[i] for i in index]

    def _reduced(self, grads: Sequence[Any], q: int, t: int) -> list[Any]:
        """The shards of ``grads`` (aligned with copy (q, t)'s weights; None: not reduced)."""
        run, cuts, devices = self.run, self.cuts[q][t], self.devices[q][t]
        kinds = self.kinds[q][t]
        out: list[Any] = [None] * len(grads)
        packs: dict[tuple[str, Any, str], list[int]] = {}  # (device, dtype, group): packed
        for i, g in enumerate(grads):
            if g is None:
                continue
            if isinstance(g, tf.IndexedSlices):
                device = devices[i]
                with tf.device(device):
                    out[i] = cuts[i].rows_of(gathered_slices(
                        g, run.chunk_group(kinds[i], device), device),
                        self.position(q, kinds[i]))
            else:
                packs.setdefault((devices[i], g.dtype, kinds[i]), []).append(i)
        for (device, _, kind), indices in packs.items():
            group = run.chunk_group(kind, device)
            with tf.device(device):
                packed = tf.concat([tf.reshape(cuts[i].padded(grads[i]), (cuts[i].dp, -1))
                                    for i in indices], axis=1)
                packed = tf.reshape(packed, [-1])
                mine = packed if group.size == 1 else member_reduce_scatter(
                    packed, group, device, "dp")
                sizes = [cuts[i].per_shard * cuts[i].width for i in indices]
                for i, piece in zip(indices, tf.split(mine, sizes)):
                    out[i] = tf.reshape(piece, cuts[i].shard_shape)
        return out

    def gather(self, q: int, t: int) -> None:
        """Device (q, t)'s updated shards all-gathered over its data-parallel group into
        its copy's weights (kind ``zero``)."""
        indices = self.own(q, t)
        for i, whole in zip(indices, self.wholes(q, t, indices)):
            with tf.device(self.devices[q][t][i]):
                self.weights[q][t][i].assign(whole)

    def wholes(self, q: int, t: int, indices: Sequence[int],
               gather: Callable[[Any, Any, str], Any] | None = None) -> list[Any]:
        """Copy (q, t)'s weights ``indices``, whole, from every rank's shards: one packed
        all-gather per device and dtype over the device's data-parallel group,
        ``gather(packed, group, device)`` (``member_all_gather``, kind ``zero``, by
        default; ZeRO-3's carries its gradient's reduce-scatter)."""
        run = self.run
        gather = gather or (lambda x, group, device: member_all_gather(x, group, device,
                                                                       "zero"))
        out: list[Any] = [None] * len(indices)
        packs: dict[tuple[str, Any, str], list[int]] = {}  # (device, dtype, group): packed
        for n, i in enumerate(indices):
            packs.setdefault((self.devices[q][t][i], self.shards[q][t][i].dtype,
                              self.kinds[q][t][i]), []).append(n)
        for (device, _, kind), ns in packs.items():
            cuts = [self.cuts[q][t][indices[n]] for n in ns]
            group, n_shards = run.chunk_group(kind, device), self.group_size(kind)
            with tf.device(device):
                packed = tf.concat([tf.reshape(self.shards[q][t][indices[n]].value, [-1])
                                    for n in ns], 0)
                whole = tf.reshape(packed if group.size == 1 else gather(packed, group, device),
                                   (n_shards, -1))
                sizes = [cut.per_shard * cut.width for cut in cuts]
                for n, piece, cut in zip(ns, tf.split(whole, sizes, axis=1), cuts):
                    out[n] = cut.unpadded(
                        tf.reshape(piece, (n_shards * cut.per_shard, *cut.row_shape)))
        return out


def _grid(rows: list[list[Any]], make: Callable[[int, int, Any], Any]) -> list[list[Any]]:
    """``make(q, t, rows[q][t])`` for every column this process runs; None for the others."""
    return [[None if cell is None else make(q, t, cell) for t, cell in enumerate(row)]
            for q, row in enumerate(rows)]


def _accumulated(total: list[Any], more: list[Any]) -> list[Any]:
    """Shard gradients summed; sparse ones joined (their rows, as one device's would be)."""
    return list(more) if not total else [sum_gradients([a, b]) for a, b in zip(total, more)]
