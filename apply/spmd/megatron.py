"""Megatron-LM's conjugate operators, one tensor-parallel rank's side of each.

Pipeline position: under ``apply.spmd.rank_layers`` (each rank's shard of a split layer
calls these on its own device), above ``apply.collective_ops`` (the member side of a
collective over the plan's ``tp`` group). Shoeybi et al. 2019, "Megatron-LM", Sec. 3:

* ``copy_to_tp`` (their *f*): identity forward; the backward all-reduces the input's
  gradient over the group (a column split's input, attention's input);
* ``reduce_from_tp`` (their *g*): the forward all-reduces the rank's partial sum; the
  backward is the identity (a row split's output, attention's output, a vocabulary
  split's lookup);
* ``gather_from_tp``: the forward all-gathers the ranks' slices of the last axis (a
  column split whose output a replicated layer reads); the backward keeps the rank's
  slice of the gradient;
* ``scatter_to_tp``: the forward keeps the rank's slice of the last axis (a row split
  whose input is whole); the backward all-gathers the slices of the gradient.

Every rank calls the same operators in the same order (SPMD), so their collectives meet
(``collective_ops``' instance keys count per group and device). The operators are
``tf.custom_gradient`` functions, so a rank's backward pass stays on its own device
except for the collective itself. Slices along the last axis must be equal (the split
dimension divides by tp; ``rank_layers`` checks it).
"""
from __future__ import annotations

from typing import Any

import tensorflow as tf

from tfplan.apply.collective_ops import (member_all_gather, member_all_reduce,
                                       member_reduce_scatter)
from tfplan.apply.groups import Group


def conjugate(x: Any, forward: Any, backward: Any) -> Any:
    """``forward(x)``, whose gradient is ``backward(dy)`` (one rank's side of both; also
    the self-adjoint collectives of ``apply.spmd.experts`` and ``apply.spmd.batch_norm``)."""

    @tf.custom_gradient
    def op(x: Any) -> Any:
        return forward(x), backward

    return op(x)


def copy_to_tp(x: Any, group: Group, device: str) -> Any:
    """Megatron's f: identity forward, all-reduce of the gradient backward."""
    return conjugate(x, tf.identity, lambda dy: member_all_reduce(dy, group, device, "tp"))


def reduce_from_tp(x: Any, group: Group, device: str) -> Any:
    """Megatron's g: all-reduce forward, identity backward."""
    return conjugate(x, lambda v: member_all_reduce(v, group, device, "tp"), tf.identity)


def gather_from_tp(x: Any, group: Group, device: str) -> Any:
    """All-gather of the ranks' last-axis slices forward, the rank's slice backward (of
    the gathered width: a gradient may reach it without a static last axis, as mixed
    precision's casts of the loss's leave it)."""
    width = int(x.shape[-1]) * group.size if x.shape[-1] is not None else None
    return conjugate(x, lambda v: _gather_last(v, group, device),
                      lambda dy: _own_slice(dy, group, device, width))


def scatter_to_tp(x: Any, group: Group, device: str) -> Any:
    """The rank's last-axis slice forward, all-gather of the gradient's slices backward."""
    full = int(x.shape[-1])
    return conjugate(x, lambda v: _own_slice(v, group, device),
                      lambda dy: _gather_last(dy, group, device, full))


def gather_heads_from_tp(x: Any, group: Group, device: str) -> Any:
    """The ranks' heads of attention scores [batch, heads, query, key] all-gathered along
    axis 1 forward (the whole layer's scores, as one device returns them), the rank's
    heads of the gradient backward."""
    def gather(v: Any) -> Any:
        order = [1, 0, *range(2, len(v.shape))]
        return tf.transpose(member_all_gather(tf.transpose(v, order), group, device, "tp"),
                            order)

    return conjugate(x, gather,
                      lambda dy: tf.split(dy, group.size, axis=1)[group.devices.index(device)])


def _gather_last(x: Any, group: Group, device: str, full: int | None = None) -> Any:
    """Every member's ``x`` concatenated along the last axis (the gather runs on axis 0);
    ``full``: the whole axis where the slices are ``slice_sizes(full)`` of unequal sizes
    (each padded to the largest for the gather, the padding dropped after it)."""
    rank = len(x.shape)
    to_front = [rank - 1, *range(rank - 1)]
    back = [*range(1, rank), 0]
    sizes = slice_sizes(full, group.size) if full else []
    if not sizes or len(set(sizes)) == 1:
        gathered = member_all_gather(tf.transpose(x, to_front), group, device, "tp")
        return tf.transpose(gathered, back)
    own, largest = sizes[group.devices.index(device)], sizes[0]
    padded = tf.pad(x, [[0, 0]] * (rank - 1) + [[0, largest - own]])
    gathered = tf.transpose(member_all_gather(tf.transpose(padded, to_front), group, device,
                                              "tp"), back)
    pieces = tf.split(gathered, group.size, axis=-1)
    return tf.concat([p[..., :n] for p, n in zip(pieces, sizes)], axis=-1)


def slice_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``parts`` nearly equal slices of ``n``, the first ones one larger (as
    ``numpy.array_split`` cuts)."""
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def _own_slice(x: Any, group: Group, device: str, width: int | None = None) -> Any:
    """This member's slice (``slice_sizes``) of ``x``'s last axis (``width`` of it where
    its static shape does not say)."""
    sizes = slice_sizes(int(x.shape[-1]) if x.shape[-1] is not None else width, group.size)
    return tf.split(x, sizes, axis=-1)[group.devices.index(device)]


# --- sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in
# Large Transformer Models", Sec. 4.2.2): between the split layers a [batch, seq, ...] tensor
# is cut along its sequence (axis 1) into tp equal pieces, piece t on rank t; f and g become
# f-bar and g-bar, each of them one all-gather and one reduce-scatter (the bytes of g's and
# f's all-reduces: an all-reduce is a reduce-scatter then an all-gather) -------------------
SEQ_AXIS = 1


def gather_sequence_to_tp(x: Any, group: Group, device: str) -> Any:
    """Their f-bar, before a column or heads split: the pieces all-gathered forward, the
    gradient reduce-scattered back into pieces."""
    return all_gather_sequence(x, group, device, "tp")


def all_gather_sequence(x: Any, group: Group, device: str, kind: str,
                        differentiable: bool = True) -> Any:
    """Every member's piece joined along the sequence (forward), the gradient
    reduce-scattered back into pieces (each member's piece of the members' sum); the
    collectives counted as ``kind`` (f-bar's "tp"; context parallelism's keys and values,
    "cp"). ``differentiable=False``: the gather alone (a mask)."""
    if not differentiable:
        return _gather_seq(x, group, device, kind)
    return conjugate(x, lambda v: _gather_seq(v, group, device, kind),
                      lambda dy: _reduce_scatter_seq(dy, group, device, kind))


def reduce_scatter_from_tp(x: Any, group: Group, device: str) -> Any:
    """Their g-bar, after a row, heads or vocabulary split: the partial sums
    reduce-scattered into pieces forward, the pieces' gradients all-gathered back."""
    return conjugate(x, lambda v: _reduce_scatter_seq(v, group, device),
                      lambda dy: _gather_seq(dy, group, device))


def scatter_to_sequence(x: Any, group: Group, device: str) -> Any:
    """A whole tensor that every rank holds cut to the rank's piece (forward, no
    communication); the pieces' gradients all-gathered back (each rank's whole gradient)."""
    return conjugate(x, lambda v: _own_piece(v, group, device),
                      lambda dy: _gather_seq(dy, group, device))


def gather_from_sequence(x: Any, group: Group, device: str) -> Any:
    """The pieces all-gathered for a layer that mixes positions (run whole on every rank);
    the rank's piece of the (replicated) gradient back."""
    return conjugate(x, lambda v: _gather_seq(v, group, device),
                      lambda dy: _own_piece(dy, group, device))


def _seq_to_front(x: Any) -> list[int]:
    rank = len(x.shape)
    return [SEQ_AXIS, *(a for a in range(rank) if a != SEQ_AXIS)]


def _seq_back(rank: int) -> list[int]:
    return [*range(1, SEQ_AXIS + 1), 0, *range(SEQ_AXIS + 1, rank)]


def _gather_seq(x: Any, group: Group, device: str, kind: str = "tp") -> Any:
    """Every member's piece concatenated along the sequence axis, in member order."""
    gathered = member_all_gather(tf.transpose(x, _seq_to_front(x)), group, device, kind)
    return tf.transpose(gathered, _seq_back(len(x.shape)))


def _reduce_scatter_seq(x: Any, group: Group, device: str, kind: str = "tp") -> Any:
    """This member's piece of the sum of every member's ``x`` (the sequence divides by the
    group's size: ``rank_layers`` checks it)."""
    piece = member_reduce_scatter(tf.transpose(x, _seq_to_front(x)), group, device, kind)
    return tf.transpose(piece, _seq_back(len(x.shape)))


def _own_piece(x: Any, group: Group, device: str) -> Any:
    return tf.split(x, group.size, axis=SEQ_AXIS)[group.devices.index(device)]
