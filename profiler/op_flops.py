"""FLOPs of one TensorFlow op, from its type, attributes and static shapes.

Pipeline position: ``profiler.op_graph`` traces a model's training step into a
graph and describes each op as an ``OpInfo`` (plain tuples, no TensorFlow
objects); ``count_op`` here turns it into FLOPs; ``profiler.static`` sums them
per layer into ``LayerProfile.flops_fwd`` / ``flops_bwd``. This module imports
no TensorFlow, so every formula can be tested on hand-made shapes.

Conventions (the tests hand-compute totals from exactly these rules):

* A multiply-add is 2 FLOPs, as in TensorFlow's own profiler
  (its ``flops_registry.py``, in TensorFlow's profiler/internal sources, "the registry"
  below), Kaplan et al. 2020 "Scaling Laws" and nanoGPT's ``estimate_mfu``.
  Where the registry has a formula we use the same one, so the two agree op by
  op; where it has none, or gets it wrong, the rule below says what we do.
* Contractions. ``MatMul``: 2*K*prod(out) (registry). ``BatchMatMul*``:
  2*K*prod(out), K from ``adj_x`` (the registry reads ``transpose_a``, an
  attribute V2/V3 do not have, so it is wrong for adjoint inputs).
  ``Einsum`` (any equation, ``...`` included; the registry has none): with P
  the product of the sizes of all distinct indices, two operands cost 2*P when
  some index is summed out, else P (one multiply per output element); one
  operand costs P - prod(out) additions when indices are summed out, else 0
  (a transpose or diagonal moves data). Broadcast sizes (1 against n) take n.
* Convolutions. ``Conv2D``/``Conv3D``: 2*prod(out)*prod(filter[:-1]) (registry;
  filter[:-1] is the window times the input channels of one group). The
  backprop ops do exactly the forward multiply-adds again:
  ``Conv{2,3}DBackpropInput``/``Filter``: 2*prod(out_backprop)*prod(filter[:-1]).
  The registry's backprop formula divides input size by stride instead, which
  matches this only for 'SAME' padding on sizes divisible by the stride.
  ``DepthwiseConv2dNative``: 2*prod(out)*kh*kw (registry); its two backprop ops
  2*prod(out_backprop)*kh*kw each (the registry has none), so a depthwise
  convolution's backward is 2x its forward. ``Conv2DTranspose`` is
  ``Conv2DBackpropInput`` in its forward pass and is counted as one.
* Pooling (registry): ``MaxPool``/``AvgPool`` (2-D and 3-D) prod(ksize)*prod(out);
  ``MaxPoolGrad`` prod(ksize)*prod(orig_out) + prod(orig_out); ``AvgPoolGrad``
  2*prod(ksize)*prod(out_backprop).
* Normalization. Keras 3 emits batch and layer normalization as the elementwise
  and reduction ops below. ``FusedBatchNormV3`` (other code): 6 per input element
  when training (mean 1, squared difference 2, variance 1, scale 1, shift 1 --
  the decomposed ops' count), 2 in inference; ``FusedBatchNormGradV3``: 9 per
  element when training (sums of dy and dy*x_hat: 3, dx: 6), 3 in inference.
* Elementwise, per output element: 1 for every arithmetic, comparison, logical
  and pointwise-function op (``Add``, ``Mul``, ``RealDiv``, ``Maximum``,
  ``Relu``, ``Tanh``, ``Exp``, ``Erf``...), whatever its machine cost, as the
  registry does for ``Log``/``Neg``/``Reciprocal``; exceptions: ``Rsqrt`` 2,
  ``SquaredDifference`` 2, ``RsqrtGrad`` 4 (registry), ``ClipByValue`` 2.
  ``BiasAdd`` 1 per input element (registry). The ``*Grad`` ops multiply the
  upstream gradient by the derivative written with the saved tensor:
  ``ReluGrad``/``Relu6Grad``/``LeakyReluGrad`` 1 (a select), ``EluGrad`` 2
  (dy*(y+1)), ``SqrtGrad`` 2 (dy*0.5/y), ``SigmoidGrad``/``TanhGrad``/
  ``ReciprocalGrad``/``SeluGrad``/``SoftplusGrad`` 3, ``SoftsignGrad`` 4.
  ``Softmax``/``LogSoftmax``: 5 per element (registry); their gradients are
  ordinary Mul/Sum/Sub ops. ``AddN``: (n-1)*prod(out) (registry).
* Reductions (registry): ``Sum``/``Max``/``Min``/``Prod``/``ArgMax``/``ArgMin``/
  ``All``/``Any``/``BiasAddGrad``: prod(in) - prod(out); ``Mean``: prod(in).
  ``UnsortedSegmentSum`` (gradients of gathers): prod(data). ``Cumsum``/
  ``Cumprod``: prod(out). Variable updates ``AssignAdd*``/``AssignSub*``:
  prod(value) (registry).
* ``ZERO_FLOP_OPS`` move, select, reshape, generate or read data and do no
  arithmetic: 0 FLOPs by convention (their cost is memory traffic). ``Cast`` is
  one of them: a conversion, not arithmetic (the registry counts 0 too); so are
  the random-number generators (bits, not floating-point arithmetic).
* Ops that run a function (``While``, ``PartitionedCall``...) are counted by
  ``profiler.control_flow`` from their bodies, with these formulas.
* Any other op type has no formula: it counts 0 and ``count_op`` says so in
  ``OpCount.problem``, which the profile lists under ``not_counted``. Nothing
  is ever silently zero. The same holds for a formula that needs a shape the
  graph does not know.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from tfplan.profiler.einsum import einsum_flops

Shape = tuple  # a tuple of ints; an unknown dimension is None; an unknown rank is None


@dataclass(frozen=True)
class OpInfo:
    """What a FLOP formula may read about one op: no TensorFlow objects inside."""

    name: str
    type: str
    input_shapes: tuple[Shape | None, ...] = ()
    output_shapes: tuple[Shape | None, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class OpCount:
    """FLOPs of one op; ``problem`` says why they could not be counted (then flops is 0)."""

    flops: int
    problem: str | None = None


class _Uncountable(Exception):
    """Raised inside a formula: the op's shapes or attributes do not allow a count."""


def prod(values: Sequence[int]) -> int:
    return math.prod(int(v) for v in values)


# --- shapes ----------------------------------------------------------------------------------
def _known(shape: Shape | None, what: str) -> tuple[int, ...]:
    if shape is None or any(d is None for d in shape):
        raise _Uncountable(f"{what} shape {_fmt(shape)} is not fully defined")
    return tuple(int(d) for d in shape)


def _fmt(shape: Shape | None) -> str:
    return "<unknown rank>" if shape is None else "(" + ", ".join(
        "?" if d is None else str(d) for d in shape) + ")"


def _in(op: OpInfo, i: int) -> tuple[int, ...]:
    if i >= len(op.input_shapes):
        raise _Uncountable(f"expected an input #{i}, the op has {len(op.input_shapes)}")
    return _known(op.input_shapes[i], f"input #{i}")


def _out(op: OpInfo, i: int = 0) -> tuple[int, ...]:
    if i >= len(op.output_shapes):
        raise _Uncountable(f"expected an output #{i}, the op has {len(op.output_shapes)}")
    return _known(op.output_shapes[i], f"output #{i}")


def _attr(op: OpInfo, name: str, default: Any = None) -> Any:
    value = op.attrs.get(name, default)
    if value is None:
        raise _Uncountable(f"attribute {name!r} is unknown")
    return value


# --- formulas --------------------------------------------------------------------------------
def _matmul(op: OpInfo) -> int:
    a = _in(op, 0)
    k = a[0] if op.attrs.get("transpose_a") else a[1]
    return 2 * k * prod(_out(op))


def _batch_matmul(op: OpInfo) -> int:
    a = _in(op, 0)
    adjoint = op.attrs.get("adj_x", op.attrs.get("transpose_a", False))
    k = a[-2] if adjoint else a[-1]
    return 2 * k * prod(_out(op))


def _conv(op: OpInfo) -> int:
    return 2 * prod(_out(op)) * prod(_in(op, 1)[:-1])


def _conv_backprop_input(op: OpInfo) -> int:  # inputs: input_sizes, filter, out_backprop
    return 2 * prod(_in(op, 2)) * prod(_in(op, 1)[:-1])


def _conv_backprop_filter(op: OpInfo) -> int:  # inputs: input, filter_sizes, out_backprop
    return 2 * prod(_in(op, 2)) * prod(_out(op)[:-1])


def _depthwise(op: OpInfo) -> int:
    kh, kw = _in(op, 1)[:2]
    return 2 * prod(_out(op)) * kh * kw


def _depthwise_backprop_input(op: OpInfo) -> int:
    kh, kw = _in(op, 1)[:2]
    return 2 * prod(_in(op, 2)) * kh * kw


def _depthwise_backprop_filter(op: OpInfo) -> int:
    kh, kw = _out(op)[:2]
    return 2 * prod(_in(op, 2)) * kh * kw


def _ksize(op: OpInfo) -> int:
    return prod(_attr(op, "ksize"))


def _pool(op: OpInfo) -> int:
    return _ksize(op) * prod(_out(op))


def _max_pool_grad(op: OpInfo) -> int:  # inputs: orig_input, orig_output, grad
    orig_out = prod(_in(op, 1))
    return _ksize(op) * orig_out + orig_out


def _avg_pool_grad(op: OpInfo) -> int:  # inputs: orig_input_shape, grad
    return 2 * _ksize(op) * prod(_in(op, 1))


def _per_output(n: int) -> Callable[[OpInfo], int]:
    return lambda op: n * prod(_out(op))


def _per_input(n: int) -> Callable[[OpInfo], int]:
    return lambda op: n * prod(_in(op, 0))


def _reduction(op: OpInfo) -> int:
    return prod(_in(op, 0)) - prod(_out(op))


def _add_n(op: OpInfo) -> int:
    return (len(op.input_shapes) - 1) * prod(_out(op))


def _assign_update(op: OpInfo) -> int:  # AssignAdd(ref, value) / AssignAddVariableOp(res, value)
    return prod(_in(op, 1))


def _fused_batch_norm(op: OpInfo) -> int:
    return (6 if op.attrs.get("is_training", True) else 2) * prod(_in(op, 0))


def _fused_batch_norm_grad(op: OpInfo) -> int:  # inputs: y_backprop, x, scale, ...
    return (9 if op.attrs.get("is_training", True) else 3) * prod(_in(op, 1))


def _einsum(op: OpInfo) -> int:
    try:
        return einsum_flops(_attr(op, "equation"),
                            [_in(op, i) for i in range(len(op.input_shapes))])
    except ValueError as exc:
        raise _Uncountable(str(exc)) from exc


_UNARY_1 = (
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "Ceil", "Cos", "Cosh", "Digamma",
    "Elu", "Erf", "Erfc", "Erfinv", "Exp", "Expm1", "Floor", "Gelu", "Inv", "IsFinite", "IsInf",
    "IsNan", "LeakyRelu", "Lgamma", "Log", "Log1p", "LogicalNot", "Neg", "Ndtri", "Reciprocal",
    "Relu", "Relu6", "Rint", "Round", "Selu", "Sigmoid", "Sign", "Sin", "Sinh", "Softplus",
    "Softsign", "Sqrt", "Square", "Tan", "Tanh",
)
_BINARY_1 = (
    "Add", "AddV2", "Atan2", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Div", "DivNoNan", "Equal",
    "FloorDiv", "FloorMod", "Greater", "GreaterEqual", "Less", "LessEqual", "LogicalAnd",
    "LogicalOr", "Maximum", "Minimum", "Mod", "Mul", "MulNoNan", "NotEqual", "Pow", "RealDiv",
    "Sub", "TruncateDiv", "TruncateMod", "Xdivy", "Xlog1py", "Xlogy",
)

#: Op type -> formula. Every entry is described in the module docstring.
FORMULAS: dict[str, Callable[[OpInfo], int]] = {
    "MatMul": _matmul,
    **{t: _batch_matmul for t in ("BatchMatMul", "BatchMatMulV2", "BatchMatMulV3")},
    "Einsum": _einsum,
    **{t: _conv for t in ("Conv2D", "Conv3D")},
    **{t: _conv_backprop_input for t in ("Conv2DBackpropInput", "Conv2DBackpropInputV2",
                                          "Conv3DBackpropInputV2")},
    **{t: _conv_backprop_filter for t in ("Conv2DBackpropFilter", "Conv2DBackpropFilterV2",
                                           "Conv3DBackpropFilterV2")},
    "DepthwiseConv2dNative": _depthwise,
    "DepthwiseConv2dNativeBackpropInput": _depthwise_backprop_input,
    "DepthwiseConv2dNativeBackpropFilter": _depthwise_backprop_filter,
    **{t: _pool for t in ("MaxPool", "MaxPoolV2", "AvgPool", "MaxPool3D", "AvgPool3D")},
    **{t: _max_pool_grad for t in ("MaxPoolGrad", "MaxPoolGradV2", "MaxPool3DGrad")},
    **{t: _avg_pool_grad for t in ("AvgPoolGrad", "AvgPool3DGrad")},
    **{t: _fused_batch_norm for t in ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")},
    **{t: _fused_batch_norm_grad for t in ("FusedBatchNormGrad", "FusedBatchNormGradV2",
                                            "FusedBatchNormGradV3")},
    **{t: _per_output(1) for t in _UNARY_1 + _BINARY_1},
    "Rsqrt": _per_output(2),
    "SquaredDifference": _per_output(2),
    "ClipByValue": _per_output(2),
    "BiasAdd": _per_input(1),
    "BiasAddV1": _per_input(1),
    **{t: _per_output(1) for t in ("ReluGrad", "Relu6Grad", "LeakyReluGrad")},
    **{t: _per_output(2) for t in ("EluGrad", "SqrtGrad")},
    **{t: _per_output(3) for t in ("SigmoidGrad", "TanhGrad", "ReciprocalGrad", "InvGrad",
                                    "SeluGrad", "SoftplusGrad")},
    "SoftsignGrad": _per_output(4),
    "RsqrtGrad": _per_output(4),
    **{t: _per_input(5) for t in ("Softmax", "LogSoftmax")},
    "AddN": _add_n,
    **{t: _reduction for t in ("Sum", "Max", "Min", "Prod", "ArgMax", "ArgMin", "All", "Any",
                                "BiasAddGrad", "EuclideanNorm")},
    "Mean": _per_input(1),
    "UnsortedSegmentSum": _per_input(1),
    **{t: _per_output(1) for t in ("Cumsum", "Cumprod")},
    **{t: _assign_update for t in ("AssignAdd", "AssignSub", "AssignAddVariableOp",
                                    "AssignSubVariableOp")},
}

#: Ops that do no arithmetic: 0 FLOPs by convention (see the module docstring).
ZERO_FLOP_OPS: frozenset[str] = frozenset((
    # graph plumbing and checks
    "NoOp", "Identity", "IdentityN", "Placeholder", "PlaceholderWithDefault", "Const",
    "StopGradient", "PreventGradient", "Snapshot", "EnsureShape", "CheckNumerics",
    "CheckNumericsV2", "Assert", "Print", "PrintV2", "ControlTrigger",
    # variables and resources
    "VarHandleOp", "ReadVariableOp", "AssignVariableOp", "VarIsInitializedOp", "VariableShape",
    "DestroyResourceOp", "ResourceGather", "ResourceGatherNd", "VariableV2", "Assign",
    # shape metadata
    "Shape", "ShapeN", "Size", "Rank", "BroadcastArgs", "BroadcastGradientArgs",
    # layout and data movement
    "Reshape", "Squeeze", "ExpandDims", "Transpose", "ConjugateTranspose", "ConcatV2", "Concat",
    "ConcatOffset", "Split", "SplitV", "Pack", "Unpack", "Slice", "StridedSlice",
    "StridedSliceGrad", "ResourceStridedSliceAssign", "Tile", "BroadcastTo", "Fill",
    "ZerosLike", "OnesLike", "Pad", "PadV2", "MirrorPad", "Reverse", "ReverseV2", "Gather",
    "GatherV2", "GatherNd", "ScatterNd", "TensorScatterUpdate", "Range", "OneHot", "Select",
    "SelectV2", "Where", "DepthToSpace", "SpaceToDepth", "SpaceToBatchND", "BatchToSpaceND",
    "MatrixBandPart", "MatrixDiag", "MatrixDiagV3", "MatrixDiagPart", "MatrixDiagPartV3",
    "MatrixSetDiag", "MatrixSetDiagV3", "InvertPermutation", "DynamicStitch",
    "ParallelDynamicStitch", "Bitcast", "Cast", "ResizeNearestNeighbor", "Unique",
    "ListDiff", "TensorListFromTensor", "TensorListStack", "Roll",
    # tensor lists (the TensorArrays of While loops) hold tensors, they compute nothing
    "EmptyTensorList", "TensorListReserve", "TensorListGetItem", "TensorListSetItem",
    "TensorListPushBack", "TensorListPopBack", "TensorListLength", "TensorListElementShape",
    "TensorListConcatV2", "TensorListSplit", "TensorListGather", "TensorListScatterV2",
    "TensorListScatterIntoExistingList", "TensorListResize",
    # random numbers
    "RandomUniform", "RandomUniformInt", "RandomStandardNormal", "TruncatedNormal",
    "RandomShuffle", "Multinomial", "StatelessRandomUniform", "StatelessRandomNormal",
    "StatelessTruncatedNormal", "StatelessRandomUniformInt", "StatelessRandomUniformV2",
    "StatelessRandomNormalV2", "StatelessTruncatedNormalV2", "StatelessRandomUniformIntV2",
    "StatelessRandomUniformFullIntV2", "StatelessRandomGetKeyCounter",
    "StatelessRandomGetKeyCounterAlg", "StatelessRandomGetAlg", "RngReadAndSkip", "RngSkip",
))


#: Dense contractions that run on the matrix units (tensor cores; blocked GEMM on a CPU):
#: priced by FLOPs / achieved matmul FLOP/s. A one-operand Einsum is a transpose or a
#: reduction, not a contraction (``is_matmul``).
MATMUL_OPS: frozenset[str] = frozenset((
    "MatMul", "BatchMatMul", "BatchMatMulV2", "BatchMatMulV3", "Einsum", "Conv2D", "Conv3D",
    "Conv2DBackpropInput", "Conv2DBackpropInputV2", "Conv3DBackpropInputV2",
    "Conv2DBackpropFilter", "Conv2DBackpropFilterV2", "Conv3DBackpropFilterV2",
))

#: Ops that move no tensor data: graph plumbing, metadata, views (a reshape or an
#: identity aliases its input's buffer in TensorFlow's executor), variable handles and
#: reads (a ReadVariableOp returns the variable's buffer). Every other op that is not a
#: contraction is priced by the bytes it reads and writes (``profiler.op_attribution``).
NO_TRAFFIC_OPS: frozenset[str] = frozenset((
    "NoOp", "Identity", "IdentityN", "Placeholder", "PlaceholderWithDefault", "Const",
    "StopGradient", "PreventGradient", "Snapshot", "EnsureShape", "CheckNumerics",
    "CheckNumericsV2", "Assert", "Print", "PrintV2", "ControlTrigger",
    "VarHandleOp", "ReadVariableOp", "VarIsInitializedOp", "VariableShape",
    "DestroyResourceOp", "VariableV2", "Shape", "ShapeN", "Size", "Rank", "BroadcastArgs",
    "BroadcastGradientArgs", "Reshape", "Squeeze", "ExpandDims", "ConcatOffset",
    "InvertPermutation", "Range", "Bitcast", "StatelessRandomGetKeyCounter",
    "StatelessRandomGetKeyCounterAlg", "StatelessRandomGetAlg", "RngReadAndSkip", "RngSkip",
))


def is_matmul(op: OpInfo) -> bool:
    """Whether ``op`` is a contraction priced at matmul speed (``MATMUL_OPS``)."""
    return op.type in MATMUL_OPS and (op.type != "Einsum" or len(op.input_shapes) >= 2)


def count_op(op: OpInfo) -> OpCount:
    """FLOPs of ``op`` by the conventions above; a ``problem`` instead of a silent zero."""
    if op.type in ZERO_FLOP_OPS:
        return OpCount(0)
    formula = FORMULAS.get(op.type)
    if formula is None:
        return OpCount(0, "no FLOP formula for this op type")
    try:
        return OpCount(int(formula(op)))
    except _Uncountable as exc:
        return OpCount(0, str(exc))


def has_formula(op_type: str) -> bool:
    """Whether ``op_type`` is counted (a formula or the zero list)."""
    return op_type in ZERO_FLOP_OPS or op_type in FORMULAS
