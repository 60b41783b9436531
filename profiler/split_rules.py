"""Which tensor-parallel splits a Keras layer's own configuration rules out, at any degree.

Pipeline position: ``profiler.static`` records each layer's ``LayerProfile.refused_splits``
with ``refused_splits(layer)``, so ``profiler.comm`` offers the planner only the splits
``apply``'s SPMD engine cuts; ``apply.spmd.rank_layers.split_problem`` asks the same
``split_refusal`` before it cuts a layer. One rule for the planner and the engine (the
other half, what the degree must divide, is ``profiler.comm.TensorSplit.degree_divides``
and ``split_problem``'s own).

A layer's class decides which splits it is offered at all (``profiler.comm.split_kind``);
here its configuration: LoRA or quantized weights; a gated attention or one over custom
axes; an attention block whose projections are not plain EinsumDense layers; a
channels-first or grouped convolution; an EinsumDense whose equation has no single kernel
axis to cut (``einsum_split_axis``: attention projections such as ``"bqm,muh->bquh"``
have two output axes, heads and head size, and are split with their block by heads).
"""
from __future__ import annotations

from typing import Any

SPLITS = ("column", "row", "heads", "vocab")
CACHED_ATTENTION = ("keras_hub.src.layers.modeling.cached_multi_head_attention",
                    "CachedMultiHeadAttention")


def refused_splits(layer: Any, attention_block: bool = False) -> tuple[str, ...]:
    """The splits ``split_refusal`` rules out for ``layer``, among those its class is
    offered (as ``profiler.comm.split_kind`` offers them: column and row to Dense,
    EinsumDense and convolutions, heads to attention layers and to an attention block,
    ``attention_block``, vocab to an Embedding)."""
    import keras

    if isinstance(layer, (keras.layers.MultiHeadAttention, keras.layers.GroupQueryAttention)) \
            or attention_block:
        offered: tuple[str, ...] = ("heads",)
    elif isinstance(layer, keras.layers.Embedding):
        offered = ("vocab",)
    elif isinstance(layer, (keras.layers.Dense, keras.layers.EinsumDense, keras.layers.Conv1D,
                            keras.layers.Conv2D, keras.layers.Conv3D)):
        offered = ("column", "row")
    else:
        return ()
    return tuple(s for s in offered if split_refusal(layer, s))


def split_refusal(layer: Any, split: str) -> str:
    """Why ``layer`` cannot be split by ``split`` at any degree ("" when its configuration
    allows it; the module docstring lists the rules)."""
    import keras

    from tfplan import compat

    cls = type(layer)
    if getattr(layer, "lora_enabled", False) or getattr(layer, "quantization_mode", None):
        return "LoRA or quantized layers are not split"
    if split == "heads":
        if cls is keras.layers.GroupQueryAttention:
            return "gated attention" if layer.use_gate else ""
        if cls is keras.layers.MultiHeadAttention or is_cached_attention(layer):
            settings = compat.attention_settings(layer)
            if settings.use_gate or layer.attention_axes not in (None, (1,), [1]):
                return "gated attention or custom attention_axes"
            return ""
        return _attention_block_refusal(layer)
    if split == "vocab":
        return "" if cls is keras.layers.Embedding else f"{cls.__name__} is not an Embedding"
    if cls is keras.layers.Dense:
        return ""
    if cls in (keras.layers.Conv1D, keras.layers.Conv2D, keras.layers.Conv3D):
        if layer.data_format != "channels_last" or layer.groups != 1:
            return "channels_first, grouped or LoRA convolutions"
        return ""
    if cls is keras.layers.EinsumDense:
        _, why = einsum_split_axis(layer.equation, split)
        return why
    return f"{cls.__name__} layers are not split by {split!r} here"


def einsum_split_axis(equation: str, split: str) -> tuple[str, str]:
    """(the kernel's axis letter a ``split`` cuts, "") for an EinsumDense ``equation``, or
    ("", why not): a column split cuts the output's last axis, a row split the input's last
    (contracted) axis, each a single kernel axis of its kind (with several, as attention
    projections' heads x head size, the last is within each head, which per-head ops read
    whole)."""
    if split not in ("column", "row"):
        return "", f"an EinsumDense is not split by {split!r}"
    inp, ker, out = einsum_specs(equation)
    char = out[-1] if split == "column" else inp[-1]
    if "." in equation or char not in ker or (
            char in inp if split == "column" else char in out):
        return "", f"equation {equation!r} cannot be cut by {split}"
    kernel_axes = [c for c in ker if (c in out if split == "column" else c in inp)]
    if len(kernel_axes) > 1:
        return "", (f"equation {equation!r} has {len(kernel_axes)} "
                    f"{'output' if split == 'column' else 'contracted'} kernel axes")
    return char, ""


def einsum_specs(equation: str) -> tuple[str, str, str]:
    """An EinsumDense equation's (input, kernel, output) subscripts: ``"abc,cd->abd"`` ->
    ``("abc", "cd", "abd")``."""
    inp, rest = equation.split(",")
    ker, out = rest.split("->")
    return inp, ker, out


def is_cached_attention(layer: Any) -> bool:
    """Whether ``layer`` is keras_hub's CachedMultiHeadAttention (whose training call is
    MultiHeadAttention's)."""
    import keras

    cls = type(layer)
    return (cls.__module__, cls.__name__) == CACHED_ATTENTION \
        and isinstance(layer, keras.layers.MultiHeadAttention)


def _attention_block_refusal(layer: Any) -> str:
    import keras

    from tfplan.profiler.attention_blocks import attention_block

    info = attention_block(layer)
    if info is None:
        return f"{type(layer).__name__} is not MultiHeadAttention (split by heads here)"
    for p in info.projections:
        if not isinstance(p.layer, keras.layers.EinsumDense) or \
                p.layer.activation not in (None, keras.activations.linear):
            return f"its projection {p.layer.name!r} is not an EinsumDense without activation"
    return ""
