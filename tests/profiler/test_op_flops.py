"""Per-op FLOP formulas on hand-made shapes (no TensorFlow), and the einsum rule."""
from __future__ import annotations

import pytest

from tfplan.profiler.einsum import einsum_flops
from tfplan.profiler.op_flops import FORMULAS, ZERO_FLOP_OPS, OpInfo, count_op


def op(type_, ins=(), outs=(), **attrs):
    return OpInfo(f"layer/{type_}", type_, tuple(ins), tuple(outs), attrs)


def flops(type_, ins=(), outs=(), **attrs):
    c = count_op(op(type_, ins, outs, **attrs))
    assert c.problem is None, c.problem
    return c.flops


def test_matmul_and_batch_matmul_count_two_flops_per_multiply_add():
    m, k, n = 5, 7, 3
    assert flops("MatMul", [(m, k), (k, n)], [(m, n)]) == 2 * m * k * n
    assert flops("MatMul", [(k, m), (k, n)], [(m, n)], transpose_a=True) == 2 * m * k * n
    b = 4
    assert flops("BatchMatMulV2", [(b, m, k), (k, n)], [(b, m, n)]) == 2 * b * m * k * n
    # adj_x: K is the second-to-last axis of x (TensorFlow's registry reads transpose_a here)
    assert flops("BatchMatMulV2", [(b, k, m), (b, k, n)], [(b, m, n)], adj_x=True) == \
        2 * b * m * k * n


@pytest.mark.parametrize("equation,shapes,expected", [
    ("ij,jk->ik", [(5, 7), (7, 3)], 2 * 5 * 7 * 3),                      # MatMul
    ("BTNH,BSNH->BNTS", [(2, 8, 4, 16), (2, 6, 4, 16)], 2 * 2 * 8 * 6 * 4 * 16),  # scores
    ("abc,cde->abde", [(2, 10, 32), (32, 4, 8)], 2 * 2 * 10 * 32 * 4 * 8),   # EinsumDense
    ("...ij,...jk->...ik", [(3, 1, 5, 7), (4, 7, 2)], 2 * 3 * 4 * 5 * 7 * 2),  # broadcast
    ("bij,bjk", [(3, 5, 7), (3, 7, 2)], 2 * 3 * 5 * 7 * 2),             # implicit output
    ("i,j->ij", [(5,), (6,)], 5 * 6),                                  # outer: multiplies only
    ("ij,ij->ij", [(5, 6), (5, 6)], 5 * 6),                            # elementwise
    ("ij->i", [(5, 6)], 5 * 6 - 5),                                    # reduction, like Sum
    ("ij->ji", [(5, 6)], 0),                                           # transpose moves data
    ("ii->i", [(4, 4)], 0),                                            # diagonal
    ("ii->", [(4, 4)], 4 - 1),                                         # trace
])
def test_einsum_any_equation(equation, shapes, expected):
    assert einsum_flops(equation, shapes) == expected
    assert flops("Einsum", shapes, [None], equation=equation) == expected


@pytest.mark.parametrize("equation,shapes,message", [
    ("ij,jk->ik", [(5, 7), (6, 3)], "sizes 7 and 6"),
    ("ij,jk,kl->il", [(2, 3), (3, 4), (4, 5)], "3 operands"),
    ("ij->ik", [(2, 3)], "appear in no operand"),
    ("ijk->i", [(2, 3)], "3 indices for a rank-2"),
    ("i..j->i", [(2, 3)], "unexpected character"),
])
def test_einsum_fails_loudly(equation, shapes, message):
    with pytest.raises(ValueError, match=message):
        einsum_flops(equation, shapes)
    c = count_op(op("Einsum", shapes, [None], equation=equation))
    assert c.flops == 0 and message in c.problem


def test_convolution_backprops_repeat_the_forward_multiply_adds():
    n, h, w, cin, cout, k = 2, 9, 9, 3, 8, 3
    out = (n, 4, 4, cout)  # stride 2, valid
    filt = (k, k, cin, cout)
    fwd = flops("Conv2D", [(n, h, w, cin), filt], [out])
    assert fwd == 2 * (n * 4 * 4 * cout) * k * k * cin
    assert flops("Conv2DBackpropInput", [(4,), filt, out], [(n, h, w, cin)]) == fwd
    assert flops("Conv2DBackpropFilter", [(n, h, w, cin), (4,), out], [filt]) == fwd
    grouped = (k, k, cin // 3, cout)  # groups=3: each output sees Cin/3 channels
    assert flops("Conv2D", [(n, h, w, cin), grouped], [out]) == fwd // 3
    filt3 = (2, 3, 3, 4, 5)
    out3 = (1, 3, 4, 4, 5)
    fwd3 = flops("Conv3D", [(1, 4, 6, 6, 4), filt3], [out3])
    assert fwd3 == 2 * (3 * 4 * 4 * 5) * (2 * 3 * 3 * 4)
    assert flops("Conv3DBackpropInputV2", [(5,), filt3, out3], [(1, 4, 6, 6, 4)]) == fwd3
    assert flops("Conv3DBackpropFilterV2", [(1, 4, 6, 6, 4), (5,), out3], [filt3]) == fwd3


def test_depthwise_backward_is_twice_forward_not_a_full_convolution():
    n, hw, c, dm, k = 1, 16, 32, 2, 3
    filt, out = (k, k, c, dm), (n, hw, hw, c * dm)
    fwd = flops("DepthwiseConv2dNative", [(n, hw, hw, c), filt], [out])
    assert fwd == 2 * n * hw * hw * c * dm * k * k
    bwd = (flops("DepthwiseConv2dNativeBackpropInput", [(4,), filt, out], [(n, hw, hw, c)])
           + flops("DepthwiseConv2dNativeBackpropFilter", [(n, hw, hw, c), (4,), out], [filt]))
    assert bwd == 2 * fwd  # a conv2d formula would give c times more


def test_pooling_reductions_and_elementwise():
    out = (2, 4, 4, 3)
    assert flops("MaxPool", [(2, 8, 8, 3)], [out], ksize=[1, 2, 2, 1]) == 4 * 96
    assert flops("MaxPoolGrad", [(2, 8, 8, 3), out, out], [(2, 8, 8, 3)],
                 ksize=[1, 2, 2, 1]) == 4 * 96 + 96
    assert flops("AvgPoolGrad", [(4,), out], [(2, 8, 8, 3)], ksize=[1, 2, 2, 1]) == 2 * 4 * 96
    assert flops("Sum", [(6, 5), (1,)], [(5,)]) == 30 - 5
    assert flops("BiasAddGrad", [(6, 5)], [(5,)]) == 30 - 5
    assert flops("Mean", [(6, 5), (1,)], [(1, 5)]) == 30
    assert flops("AddN", [(3, 4)] * 3, [(3, 4)]) == 2 * 12
    assert flops("AddV2", [(3, 4), (4,)], [(3, 4)]) == 12  # per output element
    assert flops("Rsqrt", [(3, 4)], [(3, 4)]) == 24
    assert flops("SquaredDifference", [(3, 4), (1, 4)], [(3, 4)]) == 24
    assert flops("Softmax", [(3, 4)], [(3, 4)]) == 5 * 12
    assert flops("TanhGrad", [(3, 4), (3, 4)], [(3, 4)]) == 3 * 12
    assert flops("ReluGrad", [(3, 4), (3, 4)], [(3, 4)]) == 12
    assert flops("BiasAdd", [(3, 4), (4,)], [(3, 4)]) == 12
    assert flops("FusedBatchNormV3", [(2, 4, 4, 3)] + [(3,)] * 4, [(2, 4, 4, 3)],
                 is_training=True) == 6 * 96
    for zero in ("Reshape", "Cast", "Transpose", "ConcatV2", "GatherV2", "ReadVariableOp",
                 "StatelessRandomUniformV2", "SelectV2"):
        assert zero in ZERO_FLOP_OPS and flops(zero, [(3, 4)], [(3, 4)]) == 0


def test_unknown_types_and_shapes_are_reported_never_silently_zero():
    c = count_op(op("MatrixDeterminant", [(3, 3)], [()]))
    assert (c.flops, c.problem) == (0, "no FLOP formula for this op type")
    c = count_op(op("MatMul", [(None, 4), (4, 2)], [(None, 2)]))
    assert c.flops == 0 and "input #0 shape (?, 4) is not fully defined" in c.problem
    c = count_op(op("Relu", [None], [None]))
    assert c.flops == 0 and "<unknown rank>" in c.problem
    assert not set(FORMULAS) & ZERO_FLOP_OPS
