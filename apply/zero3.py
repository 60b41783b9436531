"""ZeRO-3 (fully sharded data parallelism) on one host: each weight lives on one replica,
gathered onto the others for each layer's forward and again for its backward.

Pipeline position: ``apply.tensor_parallel`` calls ``install`` for a plan with
``strategy.zero_stage == 3`` and dp > 1, after building the dp replicas (copies of the
model, each on its own devices, as for ZeRO-1: ``apply.zero``); ``planner.zero`` names
the owner replica of each weight group (the dp copies of one variable, LPT-balanced by
bytes among the devices of its stage and tensor rank).

What is kept where (ZeRO stage 3, P_os+g+p: Rajbhandari et al., SC'20, Sec. 5.3; PyTorch's
FSDP with one variable per unit):

* weights: the owner's copy of each weight is its one persistent variable. Every other
  copy is released (``tfplan.compat.release_to``): the Keras variable stays in its
  layer, holds no memory and reads/writes its owner's, so ``get_weights``,
  ``set_weights``, weight files and checkpoints (``apply.checkpoint``) work on the
  one-device weights unchanged. A replica's device thus holds the weights it owns:
  about 1/dp of the model's bytes, the most and least loaded device at most one
  variable apart (LPT's bound);
* optimizer slots and the update: on the owners only (the optimizer is built on, and
  applied to, the owner copies, each slot under its variable's device);
* gradients: each replica's gradient of a weight goes to the owner's device and is
  summed there (one placed ``add_n`` in replica order); with several micro-batches
  the running sum is accumulated there too (``PlannedModel`` accumulates per
  variable, on its device, and the variables are the owners): gradients are sharded
  as in ZeRO-2.

The gather. Each call of a layer with trainable weights on replica r runs
``gathered_call``: the owner's variable is read on the owner's device (the
source), copied onto the device replica r's copy was planned on (``tf.identity``
under that device: the gather, an op named ``zero3_gather``), and the layer runs
with those values (``keras.StatelessScope(state_mapping=...)``: its variables read
the gathered tensors). The call is a ``tf.custom_gradient`` whose inputs are the
layer's float inputs and the sources; its gradient function copies the sources onto
r's devices again (``zero3_regather``, after the incoming gradient exists: a control
dependency), re-runs the layer's forward with them, and differentiates that
(``tf.gradients``, so each gradient op sits with its forward op). TensorFlow
therefore keeps, between a layer's forward and its backward, the layer's inputs
(the custom gradient's inputs) and the sources, which are reads of the owner's
persistent variable on the owner's device; the gathered copies on r's device die
with their last forward consumer. The forward gather waits for the layer's inputs
(a control dependency), so replica r holds the gathered weights of about one layer
at a time (the previous layer's die as it finishes, which is what makes this one's
inputs); there is no prefetch: a layer's gather does not overlap the previous
layer's compute. The re-gather waits for the gradient reaching the layer likewise.

Costs. Each layer's forward runs twice (the backward recomputes it: FSDP keeps the
layer's activations and re-gathers only; a generic Keras layer has no backward that
takes re-gathered weights, so the recomputation is the price of not keeping them).
Communication per step and replica: two gathers of every weight it does not own
(forward and backward), and its gradients to the owners. TensorFlow has no
reduce-scatter for placed devices (``tf.distribute``'s collectives run between
replicas of a strategy, not between a graph's devices), so the reduce-scatter half
is dp - 1 point-to-point sends of each weight's gradient to its owner, summed there:
the same bytes as a ring reduce-scatter, (dp - 1)/dp of the gradients per replica,
but with the owner's link receiving all dp - 1 of its weights' gradients at once
instead of a ring's pipelined steps. The gathers are sends of whole variables from
the owner (the all-gather half, likewise point to point).

Not applied here (``install`` refuses them, naming the layer): layers that hold both
trainable and non-trainable variables (BatchNormalization's moving statistics, a
dropout's seed state in an attention layer): the stateless run and the
recomputation would update such state not at all or twice. Layers without trainable
weights are not gathered (nothing to gather) and run as in ZeRO-1.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.apply.device_names import short_name
from tfplan.apply.gradients import sum_gradients
from tfplan.apply.placement import tf_variable
from tfplan.apply.zero import WeightGroup, weight_groups
from tfplan.core.errors import PlannerError

GATHER = "zero3_gather"
REGATHER = "zero3_regather"


class ShardedWeights:
    """The weight groups of a ZeRO-3 model's dp replicas, each held by its owner only.

    ``sources(groups)`` reads the owners' variables; ``recording()`` collects, while a
    training forward pass runs, every (group index, replica, source) read for it, and
    ``reduce`` turns their gradients into one gradient per group, summed on the owner.
    """

    def __init__(self, groups: Sequence[WeightGroup]) -> None:
        self.groups = list(groups)
        self.where = {id(c): (g, r) for g in self.groups for r, c in enumerate(g.copies)}
        self._recorded: list[tuple[int, int, Any]] | None = None

    def owner_variables(self) -> list[Any]:
        """The one persistent variable of each weight, in group order (what is trained)."""
        return [g.owner_copy for g in self.groups]

    @contextlib.contextmanager
    def recording(self) -> Iterator[list[tuple[int, int, Any]]]:
        previous, self._recorded = self._recorded, []
        try:
            yield self._recorded
        finally:
            self._recorded = previous

    def sources(self, groups: Sequence[WeightGroup], replica: int) -> list[Any]:
        out = []
        for g in groups:
            owner = tf_variable(g.owner_copy)
            with tf.device(owner.device):
                out.append(owner.read_value())
            if self._recorded is not None:
                self._recorded.append((g.index, replica, out[-1]))
        return out

    def reduce(self, recorded: Sequence[tuple[int, int, Any]], grads: Sequence[Any]
               ) -> list[Any]:
        """One gradient per group (None if no read of it got one): the sum over every
        replica's reads, in replica order, on the owner's device (the reduce half)."""
        parts: list[list[tuple[int, Any]]] = [[] for _ in self.groups]
        for (i, r, _), grad in zip(recorded, grads):
            if grad is not None:
                parts[i].append((r, grad))
        out = []
        for g, found in zip(self.groups, parts):
            if not found:
                out.append(None)
                continue
            with tf.device(tf_variable(g.owner_copy).device):
                out.append(sum_gradients([grad for _, grad in
                                          sorted(found, key=lambda p: p[0])]))
        return out


class Gathering:
    """What replica ``index`` of a ZeRO-3 model needs to run its layers: the shared
    ``ShardedWeights`` (a plain object: Keras does not track it)."""

    def __init__(self, weights: ShardedWeights, index: int) -> None:
        self.weights, self.index = weights, index

    def wrap(self, layer: Any, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` (a call of ``layer``) run on gathered weights (the module docstring);
        ``fn`` itself when the layer has no trainable weights of the groups."""
        copies = list(getattr(layer, "trainable_variables", ()) or ())
        entries = [self.weights.where.get(id(v)) for v in copies]
        if not copies or any(e is None for e in entries):
            return fn
        groups = [g for g, _ in entries]
        targets = [g.devices[r] for g, r in entries]
        return gathered_call(fn, copies, groups, targets, self.weights, self.index)


def gathered_call(fn: Callable[..., Any], copies: Sequence[Any], groups: Sequence[WeightGroup],
                  targets: Sequence[str], weights: ShardedWeights, replica: int
                  ) -> Callable[..., Any]:
    """``fn`` with ``copies`` (replica ``replica``'s variables of one layer) read from their
    owners, gathered onto ``targets`` for the forward and again for the backward."""

    def run(*args: Any, **kwargs: Any) -> Any:
        structure = (args, kwargs)
        leaves = keras.tree.flatten(structure)
        is_float = [tf.is_tensor(leaf) and leaf.dtype.is_floating for leaf in leaves]
        inputs = [leaf for leaf, f in zip(leaves, is_float) if f]
        after = [leaf for leaf in leaves if tf.is_tensor(leaf)]  # gather when inputs exist
        k = len(inputs)

        def call(ins: Sequence[Any], values: Sequence[Any]) -> Any:
            it = iter(ins)
            filled = [next(it) if f else leaf for leaf, f in zip(leaves, is_float)]
            a, kw = keras.tree.pack_sequence_as(structure, filled)
            with keras.StatelessScope(state_mapping=list(zip(copies, values))):
                return fn(*a, **kw)

        @tf.custom_gradient
        def forward(*flat: Any) -> Any:
            ins, sources = list(flat[:k]), list(flat[k:])
            out = call(ins, _gather(sources, targets, after, GATHER))

            def grad(*dys: Any) -> list[Any]:
                with _no_colocation():
                    values = _gather(sources, targets, [d for d in dys if d is not None],
                                     REGATHER)
                    # one tensor per argument: a tensor passed twice (attention's query and
                    # value) gets each use's gradient in its own slot, not the sum in both
                    again = [tf.identity(t) for t in ins]
                    return _backward(lambda: call(again, values), again, values, dys)
            return out, grad

        return forward(*inputs, *weights.sources(groups, replica))

    return run


def _gather(sources: Sequence[Any], targets: Sequence[str], after: Sequence[Any],
            name: str) -> list[Any]:
    """Each source copied onto its target device, once ``after`` exist."""
    out = []
    with tf.control_dependencies([t for t in after if not isinstance(t, tf.IndexedSlices)]):
        for source, target in zip(sources, targets):
            with tf.device(target):
                out.append(tf.identity(source, name=name))
    return out


def _backward(recompute: Callable[[], Any], ins: Sequence[Any], values: Sequence[Any],
              dys: Sequence[Any]) -> list[Any]:
    """Gradients of the recomputed forward with respect to ``ins`` and ``values``."""
    xs = list(ins) + list(values)
    if tf.executing_eagerly():
        with tf.GradientTape() as tape:
            tape.watch(xs)
            out = recompute()
        ys, grad_ys = _pairs(out, dys)
        return list(tape.gradient(ys, xs, output_gradients=grad_ys,
                                  unconnected_gradients=tf.UnconnectedGradients.NONE))
    ys, grad_ys = _pairs(recompute(), dys)
    # tf.gradients: each gradient op colocated with its forward op (apply.placement)
    return tf.gradients(ys, xs, grad_ys=grad_ys,
                        unconnected_gradients=tf.UnconnectedGradients.NONE)


def _pairs(out: Any, dys: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    ys, grads = [], []
    for y, dy in zip(keras.tree.flatten(out), dys):
        if dy is not None and tf.is_tensor(y) and y.dtype.is_floating:
            ys.append(y)
            grads.append(dy)
    return ys, grads


def _no_colocation() -> Any:
    """A scope free of the colocation ``tf.gradients`` puts a gradient function under (the
    custom gradient's IdentityN on the layer's device), so the re-gather lands on each
    variable's planned device and tensor-parallel shards differentiate on their ranks."""
    if tf.executing_eagerly():
        return contextlib.nullcontext()
    return tf.compat.v1.colocate_with(None, ignore_existing=True)


def install(replicas: Sequence[Any], plan_name: str = "") -> ShardedWeights:
    """Make ``replicas`` (replica 0 first, each a TensorParallelModel whose
    ``trainable_variables`` are its own) ZeRO-3: group their weights, release every copy
    but the owner's, give each replica its ``Gathering`` (``_zero3``). Layers that are
    gathered are recomputed by the gather itself, so they leave ``recompute_layers``."""
    for model in replicas:
        for layer in model.layers:
            if layer.trainable_variables and layer.non_trainable_variables:
                raise PlannerError(
                    f"Plan {plan_name!r} shards weights with ZeRO-3, but layer {layer.name!r} "
                    f"({type(layer).__name__}) holds non-trainable variables "
                    f"({layer.non_trainable_variables[0].path!r}) beside its weights; "
                    "ZeRO-3 runs each layer on gathered weights and recomputes it in the "
                    "backward, which would update such state not at all or twice. Re-plan "
                    "with zero_stage 2 (plan analyze --zero-stage 2) or without that state "
                    "(e.g. dropout=0).")
    dp = len(replicas)
    variables = [v for m in replicas for v in m.trainable_variables]
    groups = weight_groups(variables, dp)
    for g in groups:
        for r, copy in enumerate(g.copies):
            if r != g.owner:
                compat.release_to(copy, g.owner_copy)
    weights = ShardedWeights(groups)
    for r, model in enumerate(replicas):
        gathered = {layer.name for layer in model.layers if layer.trainable_variables}
        model.recompute_layers = frozenset(model.recompute_layers - gathered)
        model._zero3 = Gathering(weights, r)
    return weights


def persistent_bytes_by_device(replicas: Sequence[Any]) -> dict[str, int]:
    """Bytes of the distinct variables with storage of their own (``compat.holds_storage``)
    that the replicas' layers hold, by device (short name): what each device keeps
    between steps."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for model in replicas:
        for v in model.weights:
            if not compat.holds_storage(v) or id(tf_variable(v)) in seen:
                continue
            seen.add(id(tf_variable(v)))
            device = short_name(tf_variable(v).device)
            size = tf.as_dtype(v.dtype).size
            for d in v.shape:
                size *= int(d)
            out[device] = out.get(device, 0) + size
    return out
