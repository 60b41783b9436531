"""Sequence and context parallelism: which layers they split, and the sequence length.

Pipeline position: read by ``planner.pricing`` (per-layer arrays of a candidate with
``sequence_parallel`` or ``cp`` > 1) and ``planner.candidates`` (which cp degrees a model
allows). Pure functions of the ``ModelProfile``; no pricing here.

- Sequence parallelism (Korthikanti et al., "Reducing Activation Recomputation in Large
  Transformer Models", 2022, Sec. 4.2.2): the layers a tensor-parallel group would
  replicate -- per-token layers (``SEQUENCE_LOCAL_TYPES``) on [batch, sequence, ...]
  tensors -- run on 1/tp of the sequence on each rank, so their time and saved
  activations divide by tp; the f/g all-reduces around the split layers become an
  all-gather and a reduce-scatter of the same total bytes (Sec. 4.2.2, "the same
  communication volume"), so communication is unchanged.
- Context parallelism (Megatron-Core's context parallel; Liu et al., "Ring Attention",
  2023): every layer runs on 1/cp of each sample's sequence (time, activations and
  inputs divide by cp, the attention's causal load balanced by giving each rank two
  chunks, as Megatron-Core does); each attention layer gathers the other ranks' keys and
  values for its forward (an all-gather of its K/V bytes over the cp group) and
  reduce-scatters their gradients in the backward; the gathered K/V are kept for the
  backward. Gradients are reduced over the dp x cp ranks.
"""
from __future__ import annotations

from tfplan.profiler.comm import HEAD_SPLIT_TYPES
from tfplan.profiler.model_profile import LayerProfile, ModelProfile

# per-token layers: each output position depends only on the same position of the inputs
SEQUENCE_LOCAL_TYPES = frozenset({
    "LayerNormalization", "RMSNormalization", "Dropout", "Add", "Subtract", "Multiply",
    "Average", "Maximum", "Minimum", "Activation", "ReLU", "LeakyReLU", "ELU", "PReLU",
    "Softmax", "GaussianDropout", "GaussianNoise", "SpatialDropout1D", "Identity"})


def has_sequence(layer: LayerProfile) -> bool:
    """Whether the layer's output is [batch, sequence, features...] (at least two
    dimensions per sample, the first the sequence); unknown shapes count as not."""
    return layer.output_shape is not None and len(layer.output_shape) >= 2


def sequence_splits(profile: ModelProfile, tp: int) -> bool:
    """Whether sequence parallelism can cut this model's sequences into tp equal pieces:
    every per-token layer with a sequence has a known length that divides by tp (apply
    reduce-scatters into equal pieces, as Megatron-LM requires)."""
    lengths = [l.output_shape[0] for l in profile.layers
               if l.kind in SEQUENCE_LOCAL_TYPES and has_sequence(l)]
    return bool(lengths) and all(n and n % tp == 0 for n in lengths)


def sequence_parallel_layers(profile: ModelProfile, splits: tuple[str, ...]) -> tuple[bool, ...]:
    """Per layer: whether sequence parallelism splits it along the sequence (a per-token,
    unsplit layer with a sequence axis), given each layer's tensor-parallel split
    (``""`` = replicated)."""
    return tuple(not split and l.kind in SEQUENCE_LOCAL_TYPES and has_sequence(l)
                 for l, split in zip(profile.layers, splits))


def sequence_length(profile: ModelProfile) -> int | None:
    """Tokens per sample the attention layers see: the first attention layer's output
    sequence length; None when the model has no attention layer with a known shape
    (context parallelism then has nothing to split)."""
    for l in profile.layers:
        if l.kind in HEAD_SPLIT_TYPES and has_sequence(l) and l.output_shape[0]:
            return int(l.output_shape[0])
    return None


def kv_bytes(layer: LayerProfile) -> float:
    """Key and value bytes an attention layer reads for the profile batch: the profiler's
    ``attention_kv_bytes``, else two tensors the size of its output (K and V projected to
    the model width, as in multi-head attention)."""
    if layer.attention_kv_bytes:
        return float(layer.attention_kv_bytes)
    return 2.0 * layer.activation_bytes
