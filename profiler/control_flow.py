"""FLOPs of While loops and function calls: the ops of their bodies, times how often they run.

Pipeline position: inside ``profiler.op_attribution``, which counts every traced op
with ``profiler.op_flops``; an op that runs a function -- ``While``/``StatelessWhile``
(``tf.while_loop``, so Keras' LSTM/GRU/SimpleRNN on TensorFlow, ``keras.ops.scan``,
``fori_loop``, ``while_loop``, and the gradient loop ``tf.gradients`` makes for each)
or ``PartitionedCall``/``StatefulPartitionedCall`` (a nested ``tf.function``: Keras
runs a grouped convolution as an XLA-compiled one, and its gradient is another) --
is counted here from the ops of its function graphs (``compat.function_graph``), with
their static shapes, by the same formulas, recursively.

* A function call runs its function once; only the ops that the call's used outputs
  depend on are counted (TensorFlow prunes the others when it inlines the call, XLA
  removes them as dead code): e.g. a grouped convolution that reads a model input
  has no input gradient, as a plain convolution there has none.
* A While loop runs its body ``trips`` times and its condition ``trips + 1`` times;
  every op of both is counted (the loop-counter increments and the condition's scalar
  comparisons included, 1 FLOP each). ``trips`` is static when the loop variables the
  condition reads start from static values and the body computes them from static
  values only (a counter against a length, ``maximum_iterations``, a gradient loop
  against its forward loop's final counter): the loop is then run on those scalars
  alone, here, up to ``MAX_TRIPS`` iterations. Otherwise (the condition reads data, or
  a length only known at run time) the loop counts 0, its op is named in
  ``not_counted`` with the reason, and ``unknown_trips`` lists it for the profile's
  warnings.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np

from tfplan import compat
from tfplan.profiler.op_flops import OpCount, OpInfo, count_op, is_matmul

WHILE_OPS = frozenset(("While", "StatelessWhile"))
CALL_OPS = frozenset(("PartitionedCall", "StatefulPartitionedCall"))
MAX_TRIPS = 1_000_000  # iterations simulated before a trip count is called unknown
_MAX_ELEMENTS = 64  # tensors evaluated statically are loop scalars and small shape vectors


@dataclass(frozen=True)
class BodyCount:
    """What one control-flow op does: its functions' ops, times how often they run."""

    flops: int = 0
    matmul_flops: int = 0
    traffic_bytes: int = 0
    problems: tuple[str, ...] = ()  # ops inside that have no count
    unknown: str | None = None  # why the op itself counts 0 (a While's trip count)

    def __add__(self, other: "BodyCount") -> "BodyCount":
        return BodyCount(self.flops + other.flops, self.matmul_flops + other.matmul_flops,
                         self.traffic_bytes + other.traffic_bytes,
                         self.problems + other.problems, self.unknown or other.unknown)

    def times(self, n: int) -> "BodyCount":
        return BodyCount(self.flops * n, self.matmul_flops * n, self.traffic_bytes * n,
                         self.problems, self.unknown)


@dataclass(frozen=True)
class Loop:
    """A While op's static trip count (None: unknown, ``reason`` says why) and the final
    values of the loop variables that were simulated (index -> value)."""

    trips: int | None
    finals: Mapping[int, Any]
    reason: str = ""


class ControlFlow:
    """Counts control-flow ops of one traced graph (results cached per op)."""

    def __init__(self, describe: Callable[[Any], OpInfo], traffic_bytes: Callable[[Any], int]):
        """``describe``: a TensorFlow op -> its ``OpInfo``; ``traffic_bytes``: the bytes an
        op that is not a contraction reads and writes (``op_attribution``'s rule)."""
        self.describe, self.traffic_bytes = describe, traffic_bytes
        self._loops: dict[tuple[int, str], Loop] = {}
        self.unknown_trips: list[tuple[str, str]] = []  # (op name, reason), outermost ops

    # --- counting -------------------------------------------------------------------------
    def count(self, op: Any, used_outputs: set[int] | None = None) -> BodyCount | None:
        """The count of ``op`` if it runs a function (else None). ``used_outputs``: the
        output indices something reads (None: all)."""
        if op.type in WHILE_OPS:
            return self._while(op)
        if op.type in CALL_OPS:
            fg = compat.function_graph(op.graph, op.get_attr("f").name)
            if fg is None:
                return BodyCount(unknown=f"function {op.get_attr('f').name} not found")
            wanted = list(fg.outputs) if used_outputs is None else \
                [fg.outputs[i] for i in sorted(used_outputs) if i < len(fg.outputs)]
            live = _ancestors([t.op for t in wanted] + list(fg.control_outputs))
            return self._graph(fg, op.name, live)
        return None

    def _while(self, op: Any) -> BodyCount:
        cond = compat.function_graph(op.graph, op.get_attr("cond").name)
        body = compat.function_graph(op.graph, op.get_attr("body").name)
        if cond is None or body is None:
            return BodyCount(unknown="its body or condition function was not found")
        per_trip = self._graph(body, op.name, None)
        per_test = self._graph(cond, op.name, None)
        loop = self.loop(op)
        if loop.trips is None:
            reason = (f"trip count unknown: {loop.reason} (its body does {per_trip.flops} "
                      "FLOPs per iteration)")
            return BodyCount(problems=per_trip.problems + per_test.problems, unknown=reason)
        return per_trip.times(loop.trips) + per_test.times(loop.trips + 1)

    def _graph(self, fg: Any, prefix: str, live: set[Any] | None) -> BodyCount:
        total = BodyCount()
        for inner in fg.get_operations():
            if live is not None and inner not in live:
                continue
            nested = self.count(inner)
            if nested is not None:
                problems = nested.problems + ((f"{prefix}/{inner.name} ({inner.type}): "
                                               f"{nested.unknown}",) if nested.unknown else ())
                total = total + BodyCount(nested.flops, nested.matmul_flops,
                                          nested.traffic_bytes, problems)
                continue
            info = self.describe(inner)
            counted: OpCount = count_op(info)
            matmul = is_matmul(info)
            problem = () if counted.problem is None else (
                (f"{prefix}/{inner.name} ({inner.type})"
                 + ("" if counted.problem == "no FLOP formula for this op type"
                    else f": {counted.problem}")),)
            total = total + BodyCount(counted.flops, counted.flops if matmul else 0,
                                      0 if matmul else self.traffic_bytes(inner), problem)
        return total

    def accumulated_bytes(self, t: Any, bytes_of: Callable[[Any], int | None]) -> int:
        """Bytes a forward While loop's output ``t`` holds when it is one of the tensor
        lists its body pushes a tensor onto every iteration for the gradient loop: trips
        x the tensor's bytes; 0 for anything else, for an unknown trip count, and for
        pushed variable reads (the variable's own buffer, counted as a weight)."""
        op = t.op
        if op.type not in WHILE_OPS or t.dtype.name != "variant":
            return 0
        trips = self.loop(op).trips
        body = compat.function_graph(op.graph, op.get_attr("body").name)
        if not trips or body is None or t.value_index >= len(body.outputs):
            return 0
        push = body.outputs[t.value_index].op
        if push.type != "TensorListPushBack":
            return 0
        element = push.inputs[1]
        while element.op.type in ("Identity", "Snapshot") and element.op.inputs:
            element = element.op.inputs[0]
        if element.op.type == "ReadVariableOp":
            return 0
        return trips * (bytes_of(element) or 0)

    # --- trip counts ----------------------------------------------------------------------
    def loop(self, op: Any) -> Loop:
        """The trip count of While op ``op`` (see the module docstring)."""
        key = (id(op.graph), op.name)
        if key not in self._loops:
            self._loops[key] = Loop(None, {}, "its trip count depends on itself")
            self._loops[key] = self._simulate(op)
        return self._loops[key]

    def _simulate(self, op: Any) -> Loop:
        cond = compat.function_graph(op.graph, op.get_attr("cond").name)
        body = compat.function_graph(op.graph, op.get_attr("body").name)
        n = len(op.inputs)
        if cond is None or body is None or not (
                len(cond.inputs) == len(body.inputs) == len(body.outputs) == n):
            return Loop(None, {}, "its functions do not match its loop variables")
        need = _closure(_reads(cond.outputs[0], cond.inputs), body)
        # while_v2's loop counter (input #0), also when the condition does not read it:
        # a gradient loop runs as many times as its forward loop's final counter says
        extra = _closure({0}, body) - need
        state = {k: self.value(op.inputs[k]) for k in need | extra}
        if any(state[k] is None for k in extra):
            extra = set()
            state = {k: state[k] for k in need}
        bound = self._bound(op)
        missing = sorted(k for k, v in state.items() if v is None)
        if missing:
            return Loop(None, {}, f"its condition depends on loop variable(s) "
                        f"{', '.join(op.inputs[k].name for k in missing)}, not static{bound}")
        trips = 0
        while True:
            go = self.value(cond.outputs[0], {cond.inputs[k].name: v for k, v in state.items()})
            if go is None:
                return Loop(None, {}, f"its condition is decided by data{bound}")
            if not bool(np.all(go)):
                return Loop(trips, state)
            if trips >= MAX_TRIPS:
                return Loop(None, {}, f"more than {MAX_TRIPS} iterations{bound}")
            env = {body.inputs[k].name: v for k, v in state.items()}
            cache: dict[str, Any] = {}
            state = {k: self.value(body.outputs[k], env, cache) for k in need | extra}
            if any(state[k] is None for k in need):
                return Loop(None, {}, f"its body computes the loop variables its condition "
                            f"reads from data{bound}")
            if any(state[k] is None for k in extra):
                extra = set()
                state = {k: state[k] for k in need}
            trips += 1

    def _bound(self, op: Any) -> str:
        """``; at most N (maximum_iterations)`` when while_v2's input #1 is a static limit."""
        limit = self.value(op.inputs[1]) if len(op.inputs) > 1 else None
        if limit is None or np.ndim(limit) or not np.issubdtype(np.asarray(limit).dtype,
                                                                 np.integer) or limit < 0:
            return ""
        return f"; at most {int(limit)} (its maximum_iterations)"

    def value(self, t: Any, env: Mapping[str, Any] | None = None,
              cache: dict[str, Any] | None = None, depth: int = 0) -> Any:
        """The value of a small tensor computable from constants (and ``env``: tensor name
        -> value for a function's inputs), else None."""
        if env is not None and t.name in env:
            return env[t.name]
        cache = {} if cache is None else cache
        if t.name in cache:
            return cache[t.name]
        cache[t.name] = result = self._value(t, env, cache, depth)
        return result

    def _value(self, t: Any, env: Mapping[str, Any] | None, cache: dict[str, Any],
               depth: int) -> Any:
        import tensorflow as tf

        op = t.op
        if op.type in ("Shape", "Size", "Rank"):
            shape = op.inputs[0].shape
            if not shape.is_fully_defined():
                return None
            dims = shape.as_list()
            raw = {"Shape": dims, "Size": int(np.prod(dims)), "Rank": len(dims)}[op.type]
            return np.asarray(raw, dtype=t.dtype.as_numpy_dtype)
        if not t.shape.is_fully_defined() or t.shape.num_elements() > _MAX_ELEMENTS \
                or t.dtype.name in ("resource", "variant") or depth > 200:
            return None
        if op.type == "Const":
            return tf.make_ndarray(op.get_attr("value"))
        if op.type in WHILE_OPS:
            return self.loop(op).finals.get(t.value_index)
        rule = _EVAL.get(op.type)
        if rule is None:
            return None
        args = [self.value(x, env, cache, depth + 1) for x in op.inputs]
        try:
            return rule(op, args)
        except (TypeError, ValueError, IndexError):
            return None


def _reads(t: Any, inputs: Any) -> set[int]:
    """Indices of the function inputs (placeholders) that ``t`` depends on."""
    position = {x.name: i for i, x in enumerate(inputs)}
    found, seen, todo = set(), set(), [t.op]
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        for out in op.outputs:
            if out.name in position:
                found.add(position[out.name])
        todo.extend(x.op for x in op.inputs)
    return found


def _closure(start: set[int], body: Any) -> set[int]:
    """``start`` and every loop variable the body computes them from, transitively."""
    need, todo = set(start), list(start)
    while todo:
        for j in _reads(body.outputs[todo.pop()], body.inputs) - need:
            need.add(j)
            todo.append(j)
    return need


def _ancestors(ops: list[Any]) -> set[Any]:
    seen: set[Any] = set()
    todo = list(ops)
    while todo:
        op = todo.pop()
        if op in seen:
            continue
        seen.add(op)
        todo.extend(x.op for x in op.inputs)
        todo.extend(op.control_inputs)
    return seen


# --- static evaluation of small integer/boolean tensors ------------------------------------
def _all_known(fn: Callable[..., Any]) -> Callable[[Any, list[Any]], Any]:
    return lambda op, a: None if any(x is None for x in a) else np.asarray(fn(*a))


def _logical(combine: Callable[..., Any], absorbing: bool) -> Callable[[Any, list[Any]], Any]:
    """And/or in three-valued logic: one absorbing operand decides, unknown or not."""
    def rule(op: Any, a: list[Any]) -> Any:
        if any(x is not None and np.ndim(x) == 0 and bool(x) == absorbing for x in a):
            return np.asarray(absorbing)
        return None if any(x is None for x in a) else np.asarray(combine(*a))
    return rule


def _reduce(fn: Callable[..., Any]) -> Callable[[Any, list[Any]], Any]:
    def rule(op: Any, a: list[Any]) -> Any:
        if any(x is None for x in a):
            return None
        axis = tuple(int(i) for i in np.atleast_1d(a[1]))
        return np.asarray(fn(a[0], axis=axis, keepdims=bool(op.get_attr("keep_dims"))))
    return rule


def _cast(op: Any, a: list[Any]) -> Any:
    return None if a[0] is None else np.asarray(a[0]).astype(op.outputs[0].dtype.as_numpy_dtype)


def _strided_slice(op: Any, a: list[Any]) -> Any:
    if any(x is None for x in a) or op.get_attr("ellipsis_mask") or op.get_attr("new_axis_mask"):
        return None
    x, begin, end, strides = (np.asarray(v) for v in a)
    bm, em, sm = (op.get_attr(m) for m in ("begin_mask", "end_mask", "shrink_axis_mask"))
    index: list[Any] = []
    for i in range(len(begin)):
        if sm >> i & 1:
            index.append(int(begin[i]))
        else:
            index.append(slice(None if bm >> i & 1 else int(begin[i]),
                               None if em >> i & 1 else int(end[i]), int(strides[i])))
    return np.asarray(x[tuple(index)])


def _pack(op: Any, a: list[Any]) -> Any:
    return None if any(x is None for x in a) else np.stack(a, axis=op.get_attr("axis"))


_EVAL: dict[str, Callable[[Any, list[Any]], Any]] = {
    **{t: (lambda op, a: a[0]) for t in ("Identity", "Snapshot", "StopGradient")},
    **{t: _all_known(np.add) for t in ("Add", "AddV2")},
    "Sub": _all_known(np.subtract), "Mul": _all_known(np.multiply),
    "FloorDiv": _all_known(np.floor_divide), "FloorMod": _all_known(np.mod),
    "Maximum": _all_known(np.maximum), "Minimum": _all_known(np.minimum),
    "Neg": _all_known(np.negative), "Abs": _all_known(np.abs),
    "Less": _all_known(np.less), "LessEqual": _all_known(np.less_equal),
    "Greater": _all_known(np.greater), "GreaterEqual": _all_known(np.greater_equal),
    "Equal": _all_known(np.equal), "NotEqual": _all_known(np.not_equal),
    "LogicalNot": _all_known(np.logical_not),
    "LogicalAnd": _logical(np.logical_and, False), "LogicalOr": _logical(np.logical_or, True),
    "Select": _all_known(np.where), "SelectV2": _all_known(np.where),
    "Range": _all_known(np.arange), "Cast": _cast, "StridedSlice": _strided_slice,
    "Pack": _pack, "Max": _reduce(np.max), "Min": _reduce(np.min), "Sum": _reduce(np.sum),
    "Prod": _reduce(np.prod), "All": _reduce(np.all), "Any": _reduce(np.any),
}
