"""A device column's model cut into its pipeline chunks: the steps of its graph, chunk by chunk.

Pipeline position: ``apply.spmd.copies`` builds one ``StageProgram`` per column copy of a
pipeline plan; ``apply.spmd.pipeline`` runs it one (micro-batch, chunk) slot at a time.

Keras' Functional graph is walked as ``Function._run_through_graph`` walks it (nodes from
the inputs, each operation called on its arguments filled in from the values computed so
far), but cut into steps by chunk, so one chunk of one micro-batch runs (is traced) at a
time, in the schedule's order, on its own device:

* A planned layer's step runs on its chunk (``stage_of``); any other operation (a
  ``keras.ops`` call, an unplanned layer) on the latest chunk among its inputs'
  producers; a planned layer on an earlier chunk than an input's producer is refused (the
  plan's chunks must cut the graph in order).
* A nested model (a keras_hub backbone) whose layers lie on several chunks is walked
  inside, its inputs and outputs bound to the outer node's by two steps without
  computation; on one chunk it is one step.
* ``received(k)``: the values chunk k reads from earlier chunks (a pipeline hop each);
  ``sent(k)``: those chunk k makes for later chunks. The model's outputs are read on the
  last chunk (where the loss is).

A general placement (each layer on any device, branches at once) runs as such a program
too: ``placement_segments`` walks the graph in the same order and starts a new chunk
wherever the device changes, so its chunks cut the graph in order, one device each (a
device may hold several), and the pipeline machinery runs them with one micro-batch
(TensorFlow's executor still runs independent branches on their devices at once).

Only graph models (Functional, or Sequential with an input shape) can be cut: a
subclassed model's ``call`` is one Python function.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import keras

from tfplan import compat
from tfplan.apply.cloning import is_graph_model
from tfplan.core.errors import PlannerError


@dataclass
class Step:
    """One node of the graph (or the binding of a nested model's inputs or outputs)."""

    chunk: int
    inputs: tuple[int, ...]  # ids of the symbolic tensors it reads
    outputs: tuple[int, ...]  # ids of those it makes
    run: Callable[[dict[int, Any], bool], None]  # (values, training): writes its outputs
    layer: Any = None  # the operation called (its added losses), None for bindings


@dataclass
class StageProgram:
    """One column copy's graph as steps by chunk (module docstring)."""

    graph: Any  # the Functional the model runs
    chunks: int
    steps: list[Step] = field(default_factory=list)
    producer: dict[int, int] = field(default_factory=dict)  # tensor id -> chunk making it
    tensors: dict[int, Any] = field(default_factory=dict)  # tensor id -> its KerasTensor
    _received: dict[int, list[int]] = field(default_factory=dict)  # cached per chunk
    _made: dict[int, list[int]] = field(default_factory=dict)

    def feed(self, values: dict[int, Any], x: Any) -> None:
        """The model's inputs ``x`` bound to its graph's input tensors."""
        flat = compat.standardize_functional_inputs(self.graph, x)
        for tensor, value in zip(self.graph.inputs, flat):
            values[id(tensor)] = value

    def run_chunk(self, k: int, values: dict[int, Any], training: bool) -> list[Any]:
        """Run chunk k's steps on ``values`` (its received values in place); the layers
        it called (their ``losses`` are this call's)."""
        called = []
        for step in self.steps:
            if step.chunk == k:
                step.run(values, training)
                if step.layer is not None:
                    called.append(step.layer)
        return called

    def outputs(self, values: dict[int, Any]) -> Any:
        return compat.functional_outputs(self.graph, [values[id(t)] for t in self.graph.outputs])

    def received(self, k: int) -> list[int]:
        """Ids of the values chunk k reads that earlier chunks make (in first-read order);
        on the last chunk, the model's outputs made earlier too."""
        if k not in self._received:
            reads = [i for step in self.steps if step.chunk == k for i in step.inputs]
            if k == self.chunks - 1:
                reads += [id(t) for t in self.graph.outputs]
            self._received[k] = list(dict.fromkeys(
                i for i in reads if i in self.producer and self.producer[i] < k))
        return self._received[k]

    def sent(self, k: int) -> list[int]:
        """Ids of the values chunk k makes that later chunks read."""
        return list(dict.fromkeys(i for j in range(k + 1, self.chunks)
                                  for i in self.received(j) if self.producer[i] == k))

    def made(self, k: int) -> list[int]:
        """Ids of the values chunk k's steps make."""
        if k not in self._made:
            self._made[k] = [i for i, chunk in self.producer.items() if chunk == k]
        return self._made[k]

    def layers_of(self, k: int) -> list[Any]:
        return [s.layer for s in self.steps if s.chunk == k and s.layer is not None]


def stage_program(model: Any, chunk_of_layer: Mapping[int, int], chunks: int,
                  plan_name: str) -> StageProgram:
    """``model``'s graph as steps by chunk; ``chunk_of_layer``: {id(layer): chunk} of the
    plan's layers in this copy."""
    graph = _functional(model)
    if graph is None:
        raise PlannerError(
            f"Plan {plan_name!r} cuts the model into pipeline stages, which needs its layer "
            f"graph; a {type(model).__name__} (subclassed) has none. Build the model with "
            "the Functional API or keras.Sequential (with an Input), or re-plan with pp=1.")
    program = StageProgram(graph, chunks)
    for tensor in graph.inputs:
        program.producer[id(tensor)] = 0
        program.tensors[id(tensor)] = tensor
    _walk(graph, program, chunk_of_layer, plan_name)
    _check_weights(program, plan_name)
    return program


def _walk(graph: Any, program: StageProgram, chunk_of_layer: Mapping[int, int],
          plan_name: str) -> None:
    nodes = compat.nodes_by_depth(graph)
    for depth in sorted(nodes, reverse=True):  # from the inputs, as Keras walks it
        for node in nodes[depth]:
            op = node.operation
            if op is None or node.is_input:
                continue
            inputs = tuple(id(t) for t in node.input_tensors)
            if any(i not in program.producer for i in inputs):
                continue  # not computable from this graph's inputs (Keras skips it too)
            floor = max((program.producer[i] for i in inputs), default=0)
            inner = _chunks_inside(op, chunk_of_layer)
            if id(op) in chunk_of_layer:
                chunk = chunk_of_layer[id(op)]
            elif len(inner) > 1 and is_graph_model(op):
                _walk_nested(node, op, floor, program, chunk_of_layer, plan_name)
                continue
            else:
                chunk = max(inner | {floor})
            if chunk < floor:
                raise PlannerError(
                    f"Plan {plan_name!r} puts layer {getattr(op, 'name', op)!r} on pipeline "
                    f"stage {chunk}, but it reads a value made on stage {floor}: the stages "
                    "must cut the model's graph in order. Re-plan for this model.")
            _add(program, Step(chunk, inputs, tuple(id(t) for t in node.outputs),
                               _node_call(node, op), op), node.outputs)


def placement_segments(model: Any, device_of_layer: Mapping[int, str], plan_name: str
                       ) -> tuple[dict[int, int], tuple[str, ...]]:
    """A general placement's chunks (module docstring): {id(layer): chunk} of the planned
    layers in ``device_of_layer`` ({id(layer): device}) and each chunk's device."""
    graph = _functional(model)
    if graph is None:
        raise PlannerError(
            f"Plan {plan_name!r} places the model's layers on several devices, which needs "
            f"its layer graph; a {type(model).__name__} (subclassed) has none. Build the "
            "model with the Functional API or keras.Sequential (with an Input), or re-plan "
            "with one device.")
    chunk_of: dict[int, int] = {}
    devices: list[str] = []
    _segment(graph, device_of_layer, chunk_of, devices, plan_name)
    return chunk_of, tuple(devices) or ("",)


def _segment(graph: Any, device_of_layer: Mapping[int, str], chunk_of: dict[int, int],
             devices: list[str], plan_name: str) -> None:
    """``placement_segments``' walk, in ``_walk``'s order."""
    nodes = compat.nodes_by_depth(graph)
    for depth in sorted(nodes, reverse=True):
        for node in nodes[depth]:
            op = node.operation
            if op is None or node.is_input:
                continue
            inner = _chunks_inside(op, device_of_layer)  # the devices of its planned layers
            if id(op) not in device_of_layer and len(inner) > 1 and is_graph_model(op):
                _segment(_functional(op), device_of_layer, chunk_of, devices, plan_name)
                continue
            own = {device_of_layer[id(op)]} if id(op) in device_of_layer else inner
            if len(own) > 1:
                raise PlannerError(
                    f"Plan {plan_name!r} places the layers inside {op.name!r} on devices "
                    f"{sorted(own)}; a block runs whole on one device. Re-plan for this "
                    "model.")
            if own and (not devices or devices[-1] != next(iter(own))):
                devices.append(next(iter(own)))
            if id(op) in device_of_layer:
                chunk_of[id(op)] = len(devices) - 1
            for layer in compat.flatten_layers(op) if inner else ():
                if id(layer) in device_of_layer:
                    chunk_of[id(layer)] = len(devices) - 1


def _walk_nested(node: Any, op: Any, floor: int, program: StageProgram,
                 chunk_of_layer: Mapping[int, int], plan_name: str) -> None:
    """A nested graph model on several chunks, walked inside (module docstring)."""
    inner = _functional(op)
    inputs = tuple(id(t) for t in node.input_tensors)

    def bind_inputs(values: dict[int, Any], training: bool) -> None:
        args, _ = compat.fill_in_arguments(node, values)
        flat = compat.standardize_functional_inputs(inner, args[0])
        for tensor, value in zip(inner.inputs, flat):
            values[id(tensor)] = value

    _add(program, Step(floor, inputs, tuple(id(t) for t in inner.inputs), bind_inputs),
         inner.inputs)
    _walk(inner, program, chunk_of_layer, plan_name)
    made = tuple(id(t) for t in inner.outputs)

    def bind_outputs(values: dict[int, Any], training: bool) -> None:
        for outer, i in zip(node.outputs, made):
            values[id(outer)] = values[i]

    last = max(program.producer[i] for i in made)
    _add(program, Step(last, made, tuple(id(t) for t in node.outputs), bind_outputs),
         node.outputs)


def _functional(model: Any) -> Any | None:
    """The Functional graph ``model`` runs (a Sequential's inner one; None: no graph)."""
    if not is_graph_model(model):
        return None
    return compat.inner_functional(model) if isinstance(model, keras.Sequential) else model


def _add(program: StageProgram, step: Step, tensors: Any) -> None:
    program.steps.append(step)
    for i in step.outputs:
        program.producer[i] = step.chunk
    for tensor in keras.tree.flatten(tensors):
        program.tensors[id(tensor)] = tensor


def _node_call(node: Any, op: Any) -> Callable[[dict[int, Any], bool], None]:
    def run(values: dict[int, Any], training: bool) -> None:
        args, kwargs = compat.fill_in_arguments(node, values)
        outputs = compat.functional_operation(op, training=training)(*args, **kwargs)
        for tensor, value in zip(node.outputs, keras.tree.flatten(outputs)):
            values[id(tensor)] = value
    return run


def _chunks_inside(op: Any, chunk_of_layer: Mapping[int, Any]) -> set[Any]:
    """The chunks (or devices: ``placement_segments``) of the plan's layers inside ``op``
    (a block or nested model)."""
    if not isinstance(op, keras.layers.Layer):
        return set()
    return {chunk_of_layer[id(layer)] for layer in compat.flatten_layers(op)
            if id(layer) in chunk_of_layer and layer is not op}


def _check_weights(program: StageProgram, plan_name: str) -> None:
    """Each weight is used on one chunk (a layer called on two, as a tied embedding read
    back as the output projection, would need its gradients summed across stages)."""
    chunk_of: dict[int, tuple[int, str]] = {}
    for step in program.steps:
        for v in getattr(step.layer, "weights", ()) if step.layer is not None else ():
            seen = chunk_of.setdefault(id(v), (step.chunk, step.layer.name))
            if seen[0] != step.chunk:
                raise PlannerError(
                    f"Plan {plan_name!r}: weight {v.path!r} is used on pipeline stages "
                    f"{seen[0]} ({seen[1]!r}) and {step.chunk} ({step.layer.name!r}); the "
                    "SPMD engine keeps each weight on one stage. Re-plan with both calls on "
                    "one stage, or untie the weights.")
