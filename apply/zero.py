"""ZeRO-1 and ZeRO-2 on one host: each data-parallel replica holds and updates its share of
the optimizer state (stage 1), and of the gradients (stage 2).

Pipeline position: ``apply.tensor_parallel`` calls it for a plan with ``dp > 1`` and
``strategy.optimizer_sharding`` (``apply.wrap`` routes such plans there, with any tp
and pp). ``planner.zero`` names the owner replica of each weight group (the dp copies
of one variable: same stage, same tensor rank, one per replica).

How it works (ZeRO stage 1, P_os: Rajbhandari et al., SC'20, Sec. 5.1 and 7.1):

* slots: the optimizer is built on the owners' copies only, each slot under its
  owner's device (``apply.placement.build_optimizer_on_devices``); the other copies
  have no optimizer state;
* gradients: each group's gradient sum over the replicas runs on the owner's
  device only (a reduce, where plain data parallelism all-reduces: the
  reduce-scatter half of ZeRO's collective);
* update: ``optimizer.apply_gradients`` gets the (sum, owner copy) pairs, so its
  update math runs on the owners' devices and ``optimizer.iterations`` advances
  once per step;
* broadcast: the new value of each owner copy is read on its device and assigned
  to the other copies on theirs (the all-gather half). Inside the traced train
  step TensorFlow's automatic control dependencies run a variable's reads after
  the writes that precede them in the program (the tf.function guide, "Automatic
  control dependencies"), so the copies get the updated value; eagerly, the code
  runs in order.

The same sum in the same order on one device, one update, exact copies: the result
is the single-device one, and after each step every copy of a weight is equal.

Expert parallelism (``apply.expert_parallel``, ep > 1): an expert shard's dp copies are
not one value; replica r holds the experts of ep rank ``r % ep``. Its weight groups are
then the parts of its reduction partition (``TensorParallelModel.reduction_groups``):
the dp/ep replicas ``k, k+ep, k+2ep, ..`` with the same rank k, each part one group with
one owner among its own replicas (dp = ep: one copy, its own owner). Its gradient is
summed over that part only, on the owner, and the new value copied to that part only.
Owners (deterministic, from the plan's devices and the variables' sizes): the dense
weights (one group of all dp copies each) get ``planner.zero.owners_by_device_group``
over their copies' devices exactly as without ep; the expert shards' groups get the same
rule among themselves, apart from the dense weights, over each part's copy devices (LPT
by bytes among the groups on the same dp/ep devices; ties to the lower replica), which
is the planner's pricing: dense state over dp replicas, expert state over the dp/ep
replicas that hold the same experts (``planner.pricing``, ``planner.experts``). Each
expert appears in exactly one group, so ``global_clipnorm`` over the owners' sums counts
it once. Weight files (``apply.checkpoint``) read each shard's slots from its owner.

ZeRO stage 2 (P_os+g, Sec. 5.2) also keeps the gradients sharded. What is kept where
(``reduce_to_owners``, called by ``PlannedModel._microbatch_train_step`` through
``TensorParallelModel._microbatch_gradients`` for each micro-batch):

* one micro-batch per step: as stage 1 (the replicas' gradients for a weight meet
  only on its owner's device, summed there, so only the owner ever holds the sum);
* ``num_microbatches`` m > 1: stage 1 accumulates each replica's own full gradient
  over the m micro-batches on that replica's devices (a gradient buffer as large as
  the model on every replica) and reduces once at the end. Stage 2 reduces each
  micro-batch's gradients onto the owner's device right away (one placed ``add_n``
  per weight per micro-batch) and accumulates only there: the running sum of weight
  i lives on its owner's device alone, each replica holding the accumulated
  gradients of the weights it owns (about 1/dp of them, LPT-balanced as the slots).
  A replica's own gradient of one micro-batch exists only between its backward op
  and that reduce (TensorFlow frees a tensor after its last consumer).

The cost: m reduces per step instead of one (the same bytes per micro-batch as one
all-reduce's reduce-scatter half, m times); ZeRO's paper makes the same trade.
Summing per micro-batch and then over micro-batches changes the order of the float
additions, not the sum (equal to one device's within float rounding).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

import tensorflow as tf

from tfplan.apply.device_names import short_name
from tfplan.apply.gradients import sum_gradients
from tfplan.apply.placement import tf_variable
from tfplan.core.errors import PlannerError
from tfplan.planner.zero import owners_by_device_group


Partition = tuple[tuple[int, ...], ...]  # replica parts, each part one weight group


@dataclass(frozen=True)
class WeightGroup:
    """The copies of one trainable variable that hold one value, and the replica that owns
    their state: all dp copies, or one part of the weight's reduction partition (an
    expert shard's copies: the replicas with its ep rank)."""

    index: int  # position in each replica's trainable variables
    path: str
    copies: tuple[Any, ...]  # replica replicas[j]'s keras.Variable at position j
    devices: tuple[str, ...]  # short device names, in the order of copies
    size_bytes: int
    owner: int  # replica index (planner.zero), one of replicas
    replicas: tuple[int, ...] = ()  # the replicas holding the copies; () = 0 .. dp-1

    @property
    def members(self) -> tuple[int, ...]:
        """The replica of each copy, in order."""
        return self.replicas or tuple(range(len(self.copies)))

    @property
    def owner_position(self) -> int:
        """The owner's position in ``copies``."""
        return self.members.index(self.owner)

    @property
    def owner_copy(self) -> Any:
        return self.copies[self.owner_position]

    @property
    def owner_device(self) -> str:
        return self.devices[self.owner_position]


def weight_groups(variables: Sequence[Any], dp: int,
                  partitions: Sequence[Partition] | None = None) -> list[WeightGroup]:
    """Group ``variables`` (replica 0's trainable variables, then replica 1's, ...: what
    ``TensorParallelModel.trainable_variables`` returns) into weight groups with owners.

    ``partitions[i]``: the parts of the replicas whose copies of weight i hold one value
    (``TensorParallelModel.reduction_groups``; None or ``((0, .., dp-1),)``: every copy);
    each part is one group. Groups of all dp copies get ``planner.zero``'s owners, balanced
    among the groups on the same devices, exactly as without partitions; the groups of a
    partitioned weight (expert shards) are balanced the same way among themselves, apart
    from the others: ``owners_by_device_group`` over each part's copy devices, its owner
    one of that part's replicas (module docstring)."""
    variables = list(variables)
    if dp < 1 or len(variables) % dp:
        raise PlannerError(f"ZeRO-1 needs the same trainable variables in each of the {dp} "
                           f"replicas; received {len(variables)} variables in all. Keep the "
                           "replicas' trainable flags equal (set them before apply.wrap).")
    n = len(variables) // dp
    everyone = tuple(range(dp))
    parts_of = [tuple(tuple(part) for part in partitions[i]) if partitions is not None
                else (everyone,) for i in range(n)]
    for i, parts in enumerate(parts_of):
        if sorted(r for part in parts for r in part) != list(everyone):
            raise PlannerError(f"Weight {variables[i].path!r} has reduction parts {parts}; "
                               f"expected a partition of the replicas 0..{dp - 1}.")
    copies = [tuple(variables[r * n + i] for r in range(dp)) for i in range(n)]
    for group in copies:
        shapes = {tuple(v.shape) for v in group}
        if len(shapes) > 1:
            raise PlannerError(f"Weight {group[0].path!r} has shapes {sorted(shapes)} in the "
                               "data-parallel replicas; expected one shape. Keep the "
                               "replicas' trainable flags equal (set them before apply.wrap).")
    devices = [tuple(short_name(tf_variable(v).device) for v in group) for group in copies]
    sizes = [_size_bytes(group[0]) for group in copies]
    whole = [i for i in range(n) if parts_of[i] == (everyone,)]
    owners = dict(zip(whole, owners_by_device_group([(devices[i], sizes[i]) for i in whole])))
    out = [WeightGroup(index=i, path=copies[i][0].path, copies=copies[i], devices=devices[i],
                       size_bytes=sizes[i], owner=owners[i]) if i in owners else None
           for i in range(n)]
    # partitioned weights: one group per part, balanced among parts of the same size
    split = [(i, part) for i in range(n) if i not in owners for part in parts_of[i]]
    for length in sorted({len(part) for _, part in split}):
        same = [(i, part) for i, part in split if len(part) == length]
        local = owners_by_device_group([(tuple(devices[i][r] for r in part), sizes[i])
                                        for i, part in same])
        for (i, part), owner in zip(same, local):
            out.append(WeightGroup(index=i, path=copies[i][0].path,
                                   copies=tuple(copies[i][r] for r in part),
                                   devices=tuple(devices[i][r] for r in part),
                                   size_bytes=sizes[i], owner=part[owner], replicas=part))
    return sorted((g for g in out if g is not None), key=lambda g: g.index)  # stable


def owned_variables(variables: Sequence[Any], dp: int,
                    partitions: Sequence[Partition] | None = None) -> list[Any]:
    """The owner copy of each weight group: what the optimizer is built on."""
    return [g.owner_copy for g in weight_groups(variables, dp, partitions)]


def apply_sharded(apply: Callable[[list[Any], list[Any]], None], gradients: Sequence[Any],
                  variables: Sequence[Any], dp: int,
                  partitions: Sequence[Partition] | None = None) -> None:
    """One ZeRO-1 update: reduce each group's gradients on its owner's device, ``apply``
    the sums to the owner copies, copy the new values to the group's other copies.

    ``apply(gradients, variables)`` is the model's own placed update
    (``PlacedModel._apply_gradients``: slots and update math on each variable's device).
    ``partitions``: as ``weight_groups``'.
    """
    groups = weight_groups(variables, dp, partitions)
    n = len(variables) // dp
    sums = []
    for g in groups:
        parts = [gradients[r * n + g.index] for r in g.members]
        present = [p for p in parts if p is not None]
        if not present:
            sums.append(None)  # not trained by this loss: Keras skips it, nothing to copy
            continue
        if len(present) == 1 and parts[g.owner_position] is not None:  # ZeRO-2: reduced
            sums.append(parts[g.owner_position])
            continue
        with tf.device(tf_variable(g.owner_copy).device):  # a reduce, not an all-reduce
            sums.append(sum_gradients(present))  # in replica order
    apply(sums, [g.owner_copy for g in groups])
    for g, summed in zip(groups, sums):
        if summed is None:
            continue
        owner = tf_variable(g.owner_copy)
        with tf.device(owner.device):
            value = owner.read_value()
        assign_copies(g.copies, value, skip=g.owner_position)


def reduce_to_owners(gradients: Sequence[Any], variables: Sequence[Any], dp: int,
                     partitions: Sequence[Partition] | None = None) -> list[Any]:
    """ZeRO-2: ``gradients`` (one micro-batch's, ``variables``' layout) with each group's
    sum over its replicas on its owner's device, in the owner's position; None in every
    other copy's position (no replica but the owner keeps a gradient of that weight)."""
    groups = weight_groups(variables, dp, partitions)
    n = len(variables) // dp
    out: list[Any] = [None] * len(gradients)
    for g in groups:
        present = [p for p in (gradients[r * n + g.index] for r in g.members) if p is not None]
        if present:
            with tf.device(tf_variable(g.owner_copy).device):  # the reduce, on the owner
                out[g.owner * n + g.index] = sum_gradients(present)  # in replica order
    return out


def assign_copies(copies: Sequence[Any], value: Any, skip: int | None) -> None:
    """``value`` into every copy but number ``skip``, each assign on its copy's device."""
    for r, copy in enumerate(copies):
        if r != skip:
            target = tf_variable(copy)
            with tf.device(target.device):
                target.assign(value)


def _size_bytes(variable: Any) -> int:
    count = 1
    for dim in variable.shape:
        count *= int(dim)
    return count * tf.as_dtype(variable.dtype).size
