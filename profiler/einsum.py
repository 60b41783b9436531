"""FLOPs of an einsum equation on concrete operand shapes.

Pipeline position: a helper of ``profiler.op_flops`` (the ``Einsum`` op), which
``profiler.op_graph`` calls for every op of a traced model. No TensorFlow here.

Rule (2 FLOPs per multiply-add, as for MatMul): let P be the product of the
sizes of all distinct indices of the equation.

* two operands: 2*P if some index is summed out (it appears in an input but not
  in the output), else P -- one multiply per element of the broadcast product;
* one operand: P - prod(output) additions if some index is summed out, else 0
  (a transpose, broadcast or diagonal moves data and does no arithmetic).

MatMul ``ij,jk->ik`` is 2*I*J*K, the same as TensorFlow's MatMul count. An
ellipsis ``...`` stands for the leading dimensions each operand has beyond its
named indices; they line up right-aligned, and any index broadcasts (size 1
against n gives n), as in ``tf.einsum``. An equation without ``->`` takes the
numpy output: the ellipsis, then the indices used exactly once, in alphabetical
order. TensorFlow's Einsum op takes one or two operands; anything else, or a
shape that does not fit the equation, raises ValueError naming the problem.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

ELLIPSIS = "..."


def _parse(equation: str, ranks: Sequence[int]) -> tuple[list[list[str]], list[str]]:
    """Operand and output index lists, each ``...`` expanded to ``.0``, ``.1``... labels.

    Ellipsis labels are numbered from the right, so that they line up when
    operands broadcast (``.0`` is the last ellipsis dimension of every operand).
    """
    eq = equation.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    operands = lhs.split(",")
    if len(operands) != len(ranks):
        raise ValueError(f"einsum equation {equation!r} names {len(operands)} operand(s), "
                         f"the op has {len(ranks)}")
    max_ellipsis = 0
    parsed = []
    for term, rank in zip(operands, ranks):
        labels = _labels(term, equation)
        named = sum(1 for lab in labels if lab != ELLIPSIS)
        if ELLIPSIS in labels:
            n = rank - named
            if n < 0:
                raise ValueError(f"einsum operand {term!r} of {equation!r} has rank {rank}, "
                                 f"fewer than its {named} named indices")
            max_ellipsis = max(max_ellipsis, n)
            at = labels.index(ELLIPSIS)
            labels = labels[:at] + [f".{n - 1 - j}" for j in range(n)] + labels[at + 1:]
        elif named != rank:
            raise ValueError(f"einsum operand {term!r} of {equation!r} has {named} indices "
                             f"for a rank-{rank} tensor")
        parsed.append(labels)
    if arrow:
        out = _labels(rhs, equation)
        if ELLIPSIS in out:
            at = out.index(ELLIPSIS)
            out = out[:at] + [f".{max_ellipsis - 1 - j}" for j in range(max_ellipsis)] + \
                out[at + 1:]
    else:
        counts = Counter(lab for labels in parsed for lab in labels if not lab.startswith("."))
        out = [f".{max_ellipsis - 1 - j}" for j in range(max_ellipsis)] + \
            sorted(lab for lab, c in counts.items() if c == 1)
    return parsed, out


def _labels(term: str, equation: str) -> list[str]:
    labels: list[str] = []
    i = 0
    while i < len(term):
        if term.startswith(ELLIPSIS, i):
            if ELLIPSIS in labels:
                raise ValueError(f"einsum term {term!r} of {equation!r} has two ellipses")
            labels.append(ELLIPSIS)
            i += 3
        elif term[i].isalpha():
            labels.append(term[i])
            i += 1
        else:
            raise ValueError(f"einsum equation {equation!r} has an unexpected character "
                             f"{term[i]!r}")
    return labels


def einsum_flops(equation: str, shapes: Sequence[Sequence[int]]) -> int:
    """FLOPs of ``equation`` on operands of ``shapes`` (see the module docstring)."""
    if len(shapes) not in (1, 2):
        raise ValueError(f"einsum with {len(shapes)} operands: TensorFlow's Einsum op takes 1 "
                         "or 2 (tf.einsum splits longer ones into pairs)")
    operands, out = _parse(equation, [len(s) for s in shapes])
    sizes: dict[str, int] = {}
    for labels, shape in zip(operands, shapes):
        for lab, dim in zip(labels, shape):
            dim = int(dim)
            seen = sizes.get(lab)
            if seen is None or seen == 1:
                sizes[lab] = dim
            elif dim not in (seen, 1):
                raise ValueError(f"einsum {equation!r}: index {lab!r} has sizes {seen} and "
                                 f"{dim} in operands of shapes {[tuple(s) for s in shapes]}")
    missing = [lab for lab in out if lab not in sizes]
    if missing:
        raise ValueError(f"einsum {equation!r}: output indices {missing} appear in no operand")
    total = math.prod(sizes.values())
    summed = any(lab not in out for lab in sizes)
    if len(shapes) == 2:
        return 2 * total if summed else total
    return total - math.prod(sizes[lab] for lab in out) if summed else 0
