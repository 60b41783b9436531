"""Bytes each parallel strategy would move for each layer, per training step.

Pipeline position: profiler stage, derived from a ``ModelProfile`` (pure: no
TensorFlow). The planner prices these payloads with its alpha-beta link model
(``planner.cost_model``); ``plan profile --json`` shows them per layer under
``comm``. All sizes are for the profile's ``batch_size`` samples, like the rest
of the profile, and are the payload handed to one collective (what one device
contributes), not the bytes on the wire.

- Data parallel: every trainable weight's gradient is all-reduced once per
  step, so the payload is the layer's ``grad_bytes`` (Goyal et al. 2017,
  "Accurate, Large Minibatch SGD", sec. 3; Keras keeps gradients in the
  variables' float32 under mixed precision).
- Tensor parallel, Megatron-style (Shoeybi et al. 2019, "Megatron-LM", sec. 3,
  the conjugate operators f and g): a *column* split of a Dense/EinsumDense
  needs no forward collective and all-reduces the gradient of its input in the
  backward pass (operator f); a *row* split all-reduces its output in the
  forward pass and needs nothing backward (operator g). A column layer feeding a
  row layer (the MLP pair) therefore costs one all-reduce each way. A
  convolution (Conv1D/2D/3D, channels last) is a matrix product over channels at
  every spatial position, so the same holds with its activations: column cuts its
  filters (output channels, the last axis), row its input channels, and the
  f/g all-reduces carry its input gradient and its output (``apply.sharded_layers``
  splits them so; it refuses grouped and channels-first convolutions, which the
  profile does not tell apart: a plan splitting one fails there, with a
  PlannerError). An attention layer split by heads is column for Q/K/V and row
  for the output projection: one all-reduce of its output forward, one of its
  input gradient backward. GroupQueryAttention splits the same way, each device
  holding whole key/value heads with the query heads that share them, so the degree
  must divide its key/value heads (``LayerProfile.attention_kv_heads``;
  ``TensorSplit.allows``); MultiHeadAttention has any degree (``apply`` gives the
  devices heads as evenly as they go). An
  Embedding split over the vocabulary all-reduces its output forward (sec. 3,
  "input embedding"). Every other layer is replicated and moves nothing.
- Pipeline parallel: if a stage boundary follows the layer, its output
  activation goes forward to the next stage and a gradient of the same size
  comes back (Huang et al. 2019, "GPipe"), point to point.

Layers go by their Keras class (``split_kind``): a sub-layer inside a block (a custom
layer with sub-layers, ``LayerProfile.block``) is split like the same layer at the top
level; a subclass of a Keras layer only where ``apply`` runs its split
(``SPLIT_SUBCLASSES``). A custom attention block (``LayerProfile.attention_heads``:
keras_hub's ``LlamaAttention``, ``profiler.attention_blocks``) is split by heads as a
whole, as MultiHeadAttention is: its entry carries the f/g all-reduces of its input and
output, its sub-layers run on each rank's heads (``planner.tp_splits.attention_units``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tfplan.profiler.model_profile import LayerProfile, ModelProfile

COLUMN_ROW_TYPES = ("Dense", "EinsumDense", "Conv1D", "Conv2D", "Conv3D")
HEAD_SPLIT_TYPES = ("MultiHeadAttention", "GroupedQueryAttention")
# the split kind of a custom attention block (``LayerProfile.attention_heads`` > 0:
# ``profiler.attention_blocks``), split by heads as a whole
ATTENTION_BLOCK = "AttentionBlock"
VOCAB_SPLIT_TYPES = ("Embedding",)
# subclasses of those Keras layers that ``apply`` splits as their Keras class (their
# training call is the base class's): keras_hub's attention with a key/value cache
# (``cache=None`` in training). Other subclasses stay whole: their ``call`` may differ.
SPLIT_SUBCLASSES = {"CachedMultiHeadAttention": "MultiHeadAttention"}


def split_kind(layer: LayerProfile) -> str:
    """The Keras class whose tensor-parallel splits ``layer`` may take ("": none), by the
    rule ``apply.dimensions.split_refusal`` applies: a top-level layer or a sub-layer of a
    block (not a block's own entry, not a layer of a nested model, which its graph holds),
    of Keras' own class or a ``SPLIT_SUBCLASSES`` subclass -- or a custom attention block
    (``attention_heads`` > 0): ``ATTENTION_BLOCK``, split by heads as a whole."""
    if layer.attention_heads and layer.block and layer.block != layer.name:
        return ATTENTION_BLOCK  # inside another block: apply swaps it in place there
    if layer.name == layer.block or ("/" in layer.name and not layer.block):
        return ""
    if not layer.base_type or layer.base_type == layer.type:
        return layer.type
    return layer.base_type if SPLIT_SUBCLASSES.get(layer.type) == layer.base_type else ""


@dataclass(frozen=True)
class TensorSplit:
    """One way to split a layer across a tensor-parallel group, and its collectives."""

    split: str  # "column", "row", "heads", "vocab"
    fwd_allreduce_bytes: int
    bwd_allreduce_bytes: int
    degree_divides: int = 0  # the tensor-parallel degree must divide this (0: any degree)

    def allows(self, degree: int) -> bool:
        """Whether a tensor-parallel group of ``degree`` devices can take this split."""
        return not self.degree_divides or self.degree_divides % degree == 0

    def to_dict(self) -> dict[str, Any]:
        return {"split": self.split, "fwd_allreduce_bytes": self.fwd_allreduce_bytes,
                "bwd_allreduce_bytes": self.bwd_allreduce_bytes,
                **({"degree_divides": self.degree_divides} if self.degree_divides else {})}


def _last_axis(layer: LayerProfile) -> int:
    """The size of the layer's output's last axis (0: unknown)."""
    shape = layer.output_shape
    return int(shape[-1]) if shape and shape[-1] else 0


@dataclass(frozen=True)
class LayerComm:
    name: str
    dp_allreduce_bytes: int  # gradient all-reduce payload under data parallelism
    tp_splits: tuple[TensorSplit, ...]  # empty: the layer is replicated under tensor parallelism
    pp_send_bytes: int  # output activation sent forward (its gradient comes back, same size)

    def to_dict(self) -> dict[str, Any]:
        return {"dp_allreduce_bytes": self.dp_allreduce_bytes,
                "tp_splits": [s.to_dict() for s in self.tp_splits],
                "pp_send_bytes": self.pp_send_bytes, "pp_recv_grad_bytes": self.pp_send_bytes}


def layer_comm(layer: LayerProfile, input_bytes: int) -> LayerComm:
    """The communication ``layer`` implies under each strategy (see the module docstring)."""
    out = layer.activation_bytes
    kind = split_kind(layer)
    width = _last_axis(layer)
    if kind in COLUMN_ROW_TYPES:
        if layer.groups != 1:  # a grouped convolution's channels do not cut by rank
            splits = ()
        else:  # a column split's output cuts equally over the ranks (apply.spmd.rank_layers)
            splits = (TensorSplit("column", 0, input_bytes, width),
                      TensorSplit("row", out, 0))
    elif kind in HEAD_SPLIT_TYPES or kind == ATTENTION_BLOCK:
        # the key/value heads (MultiHeadAttention's are its heads) cut over the ranks
        splits = (TensorSplit("heads", out, input_bytes, layer.attention_kv_heads),)
    elif kind in VOCAB_SPLIT_TYPES:
        rows = layer.params // width if width and layer.params % width == 0 else 0
        splits = (TensorSplit("vocab", out, 0, rows),)  # the vocabulary cuts equally
    else:
        splits = ()
    splits = tuple(x for x in splits if x.split not in layer.refused_splits)
    return LayerComm(name=layer.name, dp_allreduce_bytes=layer.grad_bytes, tp_splits=splits,
                     pp_send_bytes=out)


def input_grad_bytes(profile: ModelProfile) -> dict[str, int]:
    """{layer name: bytes of its input whose gradient the backward pass computes}, in one
    pass over the edges: a layer's recorded floating-point input bytes (a mask's or token
    ids' have no gradient; profiles made before that was recorded: all its input bytes),
    else the sum of its in-edges; none
    for a top-level layer that reads only the model's inputs (nothing upstream trains, so a
    column split's backward all-reduce of that gradient never runs)."""
    names = {layer.name for layer in profile.layers}
    into: dict[str, int] = {}
    from_layers: set[str] = set()  # layers with an input from another layer
    for e in profile.edges:
        into[e.dst] = into.get(e.dst, 0) + e.bytes
        if e.src in names:
            from_layers.add(e.dst)
    return {layer.name: 0 if (not layer.block and not layer.inputs and layer.name in into
                              and layer.name not in from_layers)
            else _grad_bytes(layer) if layer.input_bytes else into.get(layer.name, 0)
            for layer in profile.layers}


def _grad_bytes(layer: LayerProfile) -> int:
    """A layer's recorded inputs that take a gradient: the floating-point ones (all of them
    in a profile made before those were recorded apart)."""
    return layer.float_input_bytes if layer.float_input_bytes >= 0 else layer.input_bytes


def profile_comm(profile: ModelProfile) -> tuple[LayerComm, ...]:
    """``layer_comm`` for every layer of ``profile``, in its order (a split layer's backward
    all-reduce over the input gradient the backward computes: ``input_grad_bytes``)."""
    grad_in = input_grad_bytes(profile)
    return tuple(layer_comm(layer, grad_in[layer.name]) for layer in profile.layers)
