"""Per-layer FLOP formulas, forward and backward, for a batch of N samples.

Pipeline position: used by ``profiler.static`` while it walks a Keras model's
layer graph; the numbers end up in ``LayerProfile.flops_fwd`` / ``flops_bwd``
and from there in the planner's cost model. Shapes arrive as concrete tuples
whose first axis is already N (the profiled batch size).

Conventions (the tests hand-compute totals from exactly these rules):

* A multiply-add is 2 FLOPs (the convention of TensorFlow's own profiler, of
  Kaplan et al. 2020 "Scaling Laws", and of nanoGPT's ``estimate_mfu``).
* Bias add: 1 FLOP per output element. Activation functions: see
  ``ACTIVATION_FWD_FLOPS`` / ``ACTIVATION_BWD_FLOPS`` (1 per element for the
  ReLU family and other pointwise functions, softmax 5 forward / 4 backward,
  linear 0).
* Backward of a weighted layer (Dense, Conv*, DepthwiseConv*, SeparableConv*) is
  what autodiff computes: the weight gradient (same multiply-add count as the
  forward product) if the layer is trainable, plus the input gradient (same
  count again) only if ``input_needs_grad`` -- the input gradient is skipped
  when nothing upstream has a trainable weight (e.g. the first layer, fed only
  by model inputs) -- plus 1 per output element for the bias gradient (if
  trainable) and the activation's backward constant per output element.
* Backward of pooling, merge, activation and other elementwise layers is 1x
  forward (except activations, which use their own backward constant);
  normalization layers are 2x forward. Any layer whose inputs need no gradient
  and which has no trainable weight has a backward of 0 (autodiff prunes it).
* Layers that only move or select data (Concatenate, Flatten, Reshape, Dropout,
  Permute, ZeroPadding*, Cropping*, Embedding, ...) are 0 FLOPs by convention:
  their cost is memory traffic, not arithmetic. Dropout's training-time mask
  multiply is deliberately counted as 0 under this rule.
* Every other layer type is 0 FLOPs *and* is named in ``not_counted``: nothing
  is ever silently zero.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

Shape = tuple[int, ...]

#: FLOPs per element of an activation function, forward. Pointwise functions
#: count 1 (one "op" each, whatever its transcendental cost), softmax counts 5
#: (max, subtract, exp, sum, divide), linear 0.
ACTIVATION_FWD_FLOPS: dict[str, int] = {
    "linear": 0, "softmax": 5, "log_softmax": 5,
    **{name: 1 for name in (
        "relu", "relu6", "leaky_relu", "elu", "selu", "celu", "gelu", "sigmoid",
        "hard_sigmoid", "log_sigmoid", "tanh", "hard_tanh", "tanh_shrink", "silu",
        "swish", "hard_silu", "hard_swish", "softplus", "softsign", "sparse_plus",
        "squareplus", "soft_shrink", "hard_shrink", "threshold", "exponential", "mish",
    )},
}

#: FLOPs per element of an activation's backward: 1 for pointwise functions
#: (multiply the upstream gradient by the derivative), softmax 4
#: (dx = y * (g - sum(g * y)): multiply, sum, subtract, multiply), linear 0.
ACTIVATION_BWD_FLOPS: dict[str, int] = {
    name: (0 if name == "linear" else 4 if name in ("softmax", "log_softmax") else 1)
    for name in ACTIVATION_FWD_FLOPS
}

#: Normalization: 5 FLOPs per element for the statistics and the normalizing
#: (mean: 1 add; centre: 1 subtract; variance: 1 multiply + 1 add; scale by
#: 1/std: 1 multiply), +1 for gamma (``scale=True``) and +1 for beta
#: (``center=True``); per-channel work (rsqrt, moving averages) is ignored.
#: Training-mode statistics are counted even for BatchNormalization.
NORM_STATS_FLOPS_PER_ELEMENT = 5
#: RMS normalization: square + sum (2) and scale by 1/rms (1), +1 for gamma.
RMS_STATS_FLOPS_PER_ELEMENT = 3
NORM_BWD_MULTIPLE = 2
ELEMENTWISE_BWD_MULTIPLE = 1
#: Rescaling computes ``x * scale + offset``: 2 per element; backward 1 per element.
RESCALING_FWD_FLOPS_PER_ELEMENT = 2
RESCALING_BWD_FLOPS_PER_ELEMENT = 1


@dataclass(frozen=True)
class LayerFlops:
    """FLOPs of one call of one layer on N samples; ``not_counted`` names what has no formula."""

    fwd: int
    bwd: int
    not_counted: tuple[str, ...] = ()


def prod(values: Sequence[int]) -> int:
    return math.prod(int(v) for v in values)


def activation_name(fn: Any) -> str:
    """The name of a Keras activation function (``relu``, ``linear``...), or its repr."""
    return getattr(fn, "__name__", repr(fn))


def _activation(fn: Any, elements: int, on_grad_path: bool) -> LayerFlops:
    """Forward/backward FLOPs of activation ``fn`` over ``elements`` values."""
    name = activation_name(fn)
    if name not in ACTIVATION_FWD_FLOPS:
        return LayerFlops(0, 0, (f"activation '{name}' has no FLOP formula",))
    bwd = ACTIVATION_BWD_FLOPS[name] * elements if on_grad_path else 0
    return LayerFlops(ACTIVATION_FWD_FLOPS[name] * elements, bwd)


def _trainable(layer: Any) -> bool:
    return bool(layer.trainable and layer.trainable_weights)


def _weighted(layer: Any, *, input_macs: int, weight_macs: int, out_elements: int,
              input_needs_grad: bool, fwd_macs: int | None = None,
              always_input_macs: int = 0) -> LayerFlops:
    """Shared rule for Dense/Conv-like layers.

    Forward: 2 * fwd_macs + bias (1 per output element) + activation.
    Backward: 2 * weight_macs (if trainable) + 2 * input_macs (if the input
    needs a gradient) + 2 * always_input_macs (if trainable or the input needs a
    gradient: an inner input gradient, e.g. SeparableConv's pointwise stage) +
    bias gradient (1 per output element, if trainable) + activation backward.
    """
    fwd_macs = weight_macs if fwd_macs is None else fwd_macs
    trainable = _trainable(layer)
    on_path = trainable or input_needs_grad
    bias = out_elements if getattr(layer, "use_bias", False) else 0
    act = _activation(getattr(layer, "activation", None) or _linear, out_elements, on_path)
    fwd = 2 * fwd_macs + bias + act.fwd
    bwd = 0
    if trainable:
        bwd += 2 * weight_macs + bias
    if input_needs_grad:
        bwd += 2 * input_macs
    if on_path:
        bwd += 2 * always_input_macs + act.bwd
    return LayerFlops(fwd, bwd, act.not_counted)


def _linear(x: Any) -> Any:  # stands in for a missing activation attribute
    return x


_linear.__name__ = "linear"


def _channels_axis(layer: Any) -> int:
    return -1 if getattr(layer, "data_format", "channels_last") == "channels_last" else 1


def _spatial(layer: Any, shape: Shape) -> Shape:
    return tuple(shape[1:-1]) if _channels_axis(layer) == -1 else tuple(shape[2:])


# --- weighted layers ---------------------------------------------------------------
def dense_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape], input_needs_grad: bool
                ) -> LayerFlops:
    """Dense: K inputs -> U units at P = prod(output.shape[:-1]) positions.

    fwd = 2*K*U*P (matmul) + U*P (bias) + act_fwd*U*P.
    bwd = 2*K*U*P (dW, if trainable) + 2*K*U*P (dX, if the input needs a gradient)
          + U*P (dbias, if trainable) + act_bwd*U*P.
    """
    k, out = ins[0][-1], outs[0]
    macs = k * out[-1] * prod(out[:-1])
    return _weighted(layer, input_macs=macs, weight_macs=macs, out_elements=prod(out),
                     input_needs_grad=input_needs_grad)


def conv_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape], input_needs_grad: bool
               ) -> LayerFlops:
    """Conv1D/2D/3D: per output position, prod(kernel_size) * Cin/groups * Cout multiply-adds.

    With P = N * prod(output spatial dims):
    fwd = 2*prod(k)*(Cin/groups)*Cout*P + Cout*P (bias) + act_fwd*Cout*P;
    bwd = the same product for dW (if trainable) and for dX (if the input needs a
    gradient) + Cout*P (dbias) + act_bwd*Cout*P.
    """
    cin = ins[0][_channels_axis(layer)]
    out = outs[0]
    positions = out[0] * prod(_spatial(layer, out))
    macs = prod(layer.kernel_size) * (cin // layer.groups) * layer.filters * positions
    return _weighted(layer, input_macs=macs, weight_macs=macs, out_elements=prod(out),
                     input_needs_grad=input_needs_grad)


def conv_transpose_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape],
                         input_needs_grad: bool) -> LayerFlops:
    """Conv*DTranspose: per INPUT position, prod(kernel_size) * Cin * Cout multiply-adds.

    fwd = 2*prod(k)*Cin*Cout*N*prod(input spatial) + bias + activation (per output
    element); backward as for Conv (dW, dX if needed, dbias, activation).
    """
    inp = ins[0]
    cin = inp[_channels_axis(layer)]
    macs = prod(layer.kernel_size) * cin * layer.filters * inp[0] * prod(_spatial(layer, inp))
    return _weighted(layer, input_macs=macs, weight_macs=macs, out_elements=prod(outs[0]),
                     input_needs_grad=input_needs_grad)


def depthwise_conv_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape],
                         input_needs_grad: bool) -> LayerFlops:
    """DepthwiseConv1D/2D: prod(kernel_size) multiply-adds per output element.

    Output elements E = N * prod(output spatial) * Cin * depth_multiplier.
    fwd = 2*prod(k)*E + E (bias) + act_fwd*E; bwd = 2*prod(k)*E (dW) + 2*prod(k)*E
    (dX, if needed) + E (dbias) + act_bwd*E.
    """
    elements = prod(outs[0])
    macs = prod(layer.kernel_size) * elements
    return _weighted(layer, input_macs=macs, weight_macs=macs, out_elements=elements,
                     input_needs_grad=input_needs_grad)


def separable_conv_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape],
                         input_needs_grad: bool) -> LayerFlops:
    """SeparableConv1D/2D: a depthwise stage then a 1x1 pointwise stage.

    With P = N * prod(output spatial), M = Cin * depth_multiplier:
    depthwise macs D = prod(k)*M*P, pointwise macs W = M*Cout*P.
    fwd = 2*(D + W) + Cout*P (bias) + activation.
    bwd = 2*(D + W) (both weight gradients, if trainable) + 2*W (gradient into the
    depthwise output, needed whenever anything here needs a gradient) + 2*D (dX,
    if the input needs a gradient) + Cout*P (dbias) + activation backward.
    """
    cin = ins[0][_channels_axis(layer)]
    out = outs[0]
    positions = out[0] * prod(_spatial(layer, out))
    mid = cin * layer.depth_multiplier
    depthwise = prod(layer.kernel_size) * mid * positions
    pointwise = mid * layer.filters * positions
    return _weighted(layer, input_macs=depthwise, weight_macs=depthwise + pointwise,
                     always_input_macs=pointwise, out_elements=prod(out),
                     input_needs_grad=input_needs_grad)


# --- weight-free layers ------------------------------------------------------------
def _elementwise(fwd: int, bwd_if_needed: int, input_needs_grad: bool) -> LayerFlops:
    return LayerFlops(fwd, bwd_if_needed if input_needs_grad else 0)


def pooling_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape], input_needs_grad: bool
                  ) -> LayerFlops:
    """Max/AveragePooling1D/2D/3D: prod(pool_size) per output element; bwd = 1x fwd."""
    fwd = prod(layer.pool_size) * prod(outs[0])
    return _elementwise(fwd, ELEMENTWISE_BWD_MULTIPLE * fwd, input_needs_grad)


def global_pooling_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape],
                         input_needs_grad: bool) -> LayerFlops:
    """GlobalMax/GlobalAveragePooling1D/2D/3D: 1 per input element; bwd = 1x fwd."""
    fwd = prod(ins[0])
    return _elementwise(fwd, ELEMENTWISE_BWD_MULTIPLE * fwd, input_needs_grad)


def normalization_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape],
                        input_needs_grad: bool) -> LayerFlops:
    """BatchNormalization / LayerNormalization: (5 + scale + center) per element.

    5 = mean (1) + centre (1) + variance (2) + normalize (1); scale (gamma) and
    center (beta) add 1 each, so 7 per element with the defaults. LayerNormalization
    with ``rms_scaling`` and RMSNormalization: 3 + scale. bwd = 2x fwd whenever
    the input or the layer's own weights need a gradient, else 0.
    """
    elements = prod(ins[0])
    if getattr(layer, "rms_scaling", False) or type(layer).__name__ == "RMSNormalization":
        per = RMS_STATS_FLOPS_PER_ELEMENT + int(bool(getattr(layer, "scale", True)))
    else:
        per = (NORM_STATS_FLOPS_PER_ELEMENT + int(bool(layer.scale))
               + int(bool(layer.center)))
    fwd = per * elements
    on_path = input_needs_grad or _trainable(layer)
    return LayerFlops(fwd, NORM_BWD_MULTIPLE * fwd if on_path else 0)


def activation_layer_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape],
                           input_needs_grad: bool) -> LayerFlops:
    """Activation/ReLU/LeakyReLU/ELU/Softmax: the activation's constants per element."""
    name = type(layer).__name__
    fn = {"ReLU": "relu", "LeakyReLU": "leaky_relu", "ELU": "elu", "Softmax": "softmax"}.get(name)
    if fn is None:
        fn = activation_name(layer.activation)
    elements = prod(outs[0])
    if fn not in ACTIVATION_FWD_FLOPS:
        return LayerFlops(0, 0, (f"activation '{fn}' has no FLOP formula",))
    return _elementwise(ACTIVATION_FWD_FLOPS[fn] * elements,
                        ACTIVATION_BWD_FLOPS[fn] * elements, input_needs_grad)


def merge_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape], input_needs_grad: bool
                ) -> LayerFlops:
    """Add/Subtract/Multiply/Average/Maximum/Minimum: (n_inputs - 1) per output element; bwd 1x."""
    fwd = (len(ins) - 1) * prod(outs[0])
    return _elementwise(fwd, ELEMENTWISE_BWD_MULTIPLE * fwd, input_needs_grad)


def rescaling_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape],
                    input_needs_grad: bool) -> LayerFlops:
    """Rescaling (``x * scale + offset``): 2 per element forward, 1 per element backward."""
    elements = prod(outs[0])
    return _elementwise(RESCALING_FWD_FLOPS_PER_ELEMENT * elements,
                        RESCALING_BWD_FLOPS_PER_ELEMENT * elements, input_needs_grad)


def zero_flops(layer: Any, ins: Sequence[Shape], outs: Sequence[Shape], input_needs_grad: bool
               ) -> LayerFlops:
    """Data movement only (Concatenate, Flatten, Reshape, Dropout, Embedding, ...): 0 by convention."""
    return LayerFlops(0, 0)


Formula = Callable[[Any, Sequence[Shape], Sequence[Shape], bool], LayerFlops]

_FORMULA_NAMES: dict[str, tuple[str, ...]] = {
    "dense_flops": ("Dense",),
    "conv_flops": ("Conv1D", "Conv2D", "Conv3D"),
    "conv_transpose_flops": ("Conv1DTranspose", "Conv2DTranspose", "Conv3DTranspose"),
    "depthwise_conv_flops": ("DepthwiseConv1D", "DepthwiseConv2D"),
    "separable_conv_flops": ("SeparableConv1D", "SeparableConv2D"),
    "pooling_flops": tuple(f"{k}Pooling{d}D" for k in ("Max", "Average") for d in (1, 2, 3)),
    "global_pooling_flops": tuple(f"Global{k}Pooling{d}D" for k in ("Max", "Average")
                                  for d in (1, 2, 3)),
    "normalization_flops": ("BatchNormalization", "LayerNormalization", "RMSNormalization"),
    "activation_layer_flops": ("Activation", "ReLU", "LeakyReLU", "ELU", "Softmax"),
    "merge_flops": ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum"),
    "rescaling_flops": ("Rescaling",),
    "zero_flops": ("Concatenate", "Flatten", "Reshape", "Dropout", "SpatialDropout1D",
                   "SpatialDropout2D", "SpatialDropout3D", "InputLayer", "Permute",
                   "ZeroPadding1D", "ZeroPadding2D", "ZeroPadding3D", "Cropping1D",
                   "Cropping2D", "Cropping3D", "Embedding", "RepeatVector", "Identity"),
}

_REGISTRY: dict[type, Formula] | None = None


def _registry() -> dict[type, Formula]:
    """Keras layer class -> formula, built on first use (importing keras is slow)."""
    global _REGISTRY
    if _REGISTRY is None:
        import keras

        _REGISTRY = {}
        for fn_name, class_names in _FORMULA_NAMES.items():
            for class_name in class_names:
                cls = getattr(keras.layers, class_name, None)
                if cls is not None:
                    _REGISTRY[cls] = globals()[fn_name]
    return _REGISTRY


def formula_for(layer: Any) -> Formula | None:
    """The formula for ``layer``: its own Keras class's, or an ancestor's if ``call`` is inherited.

    A user subclass that overrides ``call`` computes something we cannot know,
    so it gets no formula (and is reported in ``not_counted``).
    """
    registry = _registry()
    for cls in type(layer).__mro__:
        if cls in registry:
            return registry[cls] if type(layer).call is cls.call else None
    return None


def layer_flops(layer: Any, input_shapes: Sequence[Shape], output_shapes: Sequence[Shape], *,
                input_needs_grad: bool) -> LayerFlops:
    """FLOPs of one call of ``layer`` (shapes include the batch axis N first).

    ``input_needs_grad``: whether any input tensor of this call depends on a
    trainable weight (if not, autodiff computes no input gradient here).
    """
    formula = formula_for(layer)
    if formula is None:
        return LayerFlops(0, 0, (f"no FLOP formula for layer type {type(layer).__name__}",))
    return formula(layer, input_shapes, output_shapes, input_needs_grad)
