"""Each device's copy of the model: built on the device, split layers swapped for rank twins.

Pipeline position: after ``apply.spmd.run.describe``; ``build_copies(builder, run,
template)`` gives the ``Copies`` the SPMD model trains (``apply.spmd.model``). The
``builder`` (the user's ``build_model`` function) is called once per device under
``tf.device`` of that device, so every variable is created where it lives and the
user's layers are never re-created (custom layers without ``get_config`` train).

In each copy, every layer the plan splits is replaced by its rank's twin
(``apply.spmd.rank_layers``), built with the unsplit layer's build shapes: a layer of a
Functional or Sequential model by re-wiring the copy's graph around it (its other layers
kept as they are), a block's sub-layer in place (``apply.blocks.swap_in``).

``Copies.get_weights`` / ``set_weights`` read and write the user's model's weights,
unsplit and in its order: weight j of the user's model is weight j of every copy, cut
along the twin's ``rank_axes`` where a twin holds it. The layers the plan recomputes run
under ``tf.recompute_grad`` in every copy (whole, or their attention cores under
"selective": ``apply.recompute``), and under data parallelism its BatchNormalization
layers sum their statistics over the data-parallel group (``apply.spmd.batch_norm``).
Every copy starts from the same unsplit weights (``reference``: the model ``apply.wrap``
built first, on the host), so the replicas agree.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import keras
import numpy as np
import tensorflow as tf

from tfplan import compat
from tfplan.apply.blocks import swap_in
from tfplan.apply.cloning import is_graph_model
from tfplan.apply.layer_tree import scopes_of
from tfplan.apply.offload import host_device
from tfplan.apply.recompute import attention_layers, recompute_call
from tfplan.apply.spmd.attention_block import check_split_blocks, split_block
from tfplan.apply.spmd.batch_norm import group_batch_norm, is_batch_norm
from tfplan.apply.spmd.rank_layers import (Rank, is_attention_block, is_twin, rank_twin,
                                          split_problem)
from tfplan.apply.sequence_parallel import elementwise
from tfplan.apply.spmd.run import RunDescription
from tfplan.apply.context_layers import check_context_parallel_model
from tfplan.apply.spmd.context import context_twin
from tfplan.apply.spmd.experts import expert_twin, is_expert_layer, shard_ids
from tfplan.apply.spmd.layout import GraphLayout, is_layout_layer
from tfplan.apply.spmd.megatron import slice_sizes
from tfplan.apply.spmd.stages import StageProgram, stage_program
from tfplan.core.errors import PlannerError
from tfplan.profiler.signature import SEPARATOR, profiled_layer_paths


@dataclass
class Copies:
    """``models[q][t]``: replica q's copy on its tensor rank t (under pipeline parallelism
    its column: each chunk's layers on that chunk's device, its graph cut by chunk in
    ``programs[q][t]``); ``axes[j]``: the axis weight j of the user's model is cut along in
    the copies (None: whole in each)."""

    models: list[list[Any]]
    axes: list[int | None]
    run: RunDescription
    programs: list[list[StageProgram]] | None = None
    # ids of the weights read on sequence pieces (their gradients are each rank's
    # piece's: summed over the tp group, ``apply.spmd.layout``)
    sequence_weights: frozenset[int] = frozenset()
    # expert parallelism (``apply.spmd.experts``): the indices of the user's weights cut
    # along axis 0 over the ep ranks, and the ids of the copies' variables holding them
    ep_cut: frozenset[int] = frozenset()
    expert_weights: frozenset[int] = frozenset()
    # the user's model's weights' shapes and dtypes (pieces of another worker's copies are
    # sized from them: ``rank_shape``)
    full_shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    _weight_chunks: list[int] | None = None  # ``chunk_of_weight``'s, once
    # ids of the copies' variables of another worker's pipeline chunks (one program per
    # worker: built with the copy, never run here; their storage freed, not trained, not
    # reported: ``SpmdModel`` leaves them out of its variables)
    foreign: frozenset[int] = frozenset()

    def reduction_group(self, variable: Any) -> str:
        """The group a copy's weight's gradient is summed over: "edp" for an expert shard
        (the replicas holding the same experts), "dp" for every other weight."""
        return "edp" if id(variable) in self.expert_weights else "dp"

    def weight_devices(self, q: int, t: int) -> list[str]:
        """The device of each trainable weight of copy (q, t) (its chunk's under pipeline
        parallelism), in ``trainable_variables`` order."""
        model = self.models[q][t]
        if self.programs is None:
            return [self.run.replicas[q][t]] * len(model.trainable_variables)
        column = self.run.column(q, t)
        chunk: dict[int, int] = {}
        for step in self.programs[q][t].steps:
            for w in getattr(step.layer, "weights", ()):
                chunk.setdefault(id(w), step.chunk)
        return [column[chunk.get(id(v), 0)] for v in model.trainable_variables]

    def get_weights(self, read: Any = None) -> list[np.ndarray]:
        """The user's model's weights, unsplit, each piece from a replica this process
        runs (replica 0 on one host); ``read(q, t, variable)``: a copy's weight's value
        where the variable does not hold it (ZeRO-3's shards)."""
        read = read or (lambda q, t, v: np.asarray(v.numpy()))
        run = self.run
        e_of = range(run.ep) if self.ep_cut else range(1)
        if run.every_column_here:
            holder = {(t, e): self.reader(t, e) for t in range(run.tp) for e in e_of}

            def piece(t: int, e: int, j: int) -> np.ndarray:
                q = holder[(t, e)]
                return read(q, t, self.models[q][t].weights[j])
        else:  # one program per worker: every piece from its owner (``across.exchanged``)
            piece = self._exchanged_pieces(read)

        return [np.concatenate([piece(0, e, j) for e in range(run.ep)], axis=0)
                if j in self.ep_cut else piece(0, 0, j) if axis is None else
                np.concatenate([piece(t, 0, j) for t in range(run.tp)], axis=axis)
                for j, axis in enumerate(self.axes)]

    def pieces_of(self, j: int) -> list[tuple[int, int]]:
        """The (tensor rank, ep rank) pieces weight j of the user's model is joined from."""
        if j in self.ep_cut:
            return [(0, e) for e in range(self.run.ep)]
        return [(0, 0)] if self.axes[j] is None else [(t, 0) for t in range(self.run.tp)]

    def canonical(self, e: int) -> int:
        """The first replica holding ep rank e's experts (replica 0 where nothing is cut
        over ep): whose pieces every worker reads across workers."""
        return next(q for q in range(self.run.dp) if not self.ep_cut or self.run.ep_rank(q) == e)

    def owner(self, q: int, t: int, j: int | None = None) -> int | None:
        """The worker task holding column (q, t) (its weight j: its chunk's worker)."""
        from tfplan.apply.spmd.run import task_of

        column = self.run.column(q, t)
        if j is None or len(column) == 1:
            return task_of(column[0])
        return task_of(column[self.chunk_of_weight(j)])

    def chunk_of_weight(self, j: int) -> int:
        """The pipeline chunk whose layers hold weight j of the user's model (the same in
        every copy: read from one of this process's)."""
        if self._weight_chunks is None:
            q, t = self.run.local_columns[0]
            model, program = self.models[q][t], self.programs[q][t]
            chunk: dict[int, int] = {}
            for step in program.steps:
                for w in getattr(step.layer, "weights", ()):
                    chunk.setdefault(id(w), step.chunk)
            self._weight_chunks = [chunk.get(id(w), 0) for w in model.weights]
        return self._weight_chunks[j]

    def rank_shape(self, t: int, j: int) -> tuple[int, ...]:
        """The shape of weight j of the user's model in a copy of tensor rank t."""
        shape = list(self.full_shapes[j])
        axis = self.axes[j]
        if axis is not None:
            shape[axis] = slice_sizes(shape[axis], self.run.tp)[t]
        if j in self.ep_cut:
            shape[0] //= self.run.ep
        return tuple(shape)

    def _exchanged_pieces(self, read: Any) -> Any:
        """``piece(t, e, j)`` of every weight, each read by its owner and exchanged
        (``apply.spmd.across.exchanged``): one program per worker."""
        from tfplan.apply.spmd.across import exchanged

        keys = [(t, e, j) for j in range(len(self.axes)) for t, e in self.pieces_of(j)]
        entries = []
        for t, e, j in keys:
            q = self.canonical(e)
            entries.append((self.owner(q, t, j), self.rank_shape(t, j),
                            lambda q=q, t=t, j=j: read(q, t, self.models[q][t].weights[j])))
        got = dict(zip(keys, exchanged(self.run, entries)))
        return lambda t, e, j: got[(t, e, j)].astype(self.dtypes[j])

    def reader(self, t: int, e: int) -> int:
        """The first replica this process runs that holds tensor rank t of ep rank e's
        experts (every replica holds ep rank 0's where nothing is cut over ep)."""
        run = self.run
        for q in range(run.dp):
            if run.drives(q, t) and (not self.ep_cut or run.ep_rank(q) == e):
                return q
        raise PlannerError(
            f"Plan {run.plan_name!r} runs one program per worker, and no replica of this "
            f"worker holds tensor rank {t}" + (f" of expert-parallel rank {e}" if self.ep_cut
                                               else "") +
            " of the model's weights: reading them whole (get_weights, save_weights, "
            "BackupAndRestore) needs them gathered from the other workers, which is not "
            "built yet. Keep every tensor and expert rank of a replica inside one worker "
            "(plan analyze --layout tp-pp-dp), or train without reading the weights.")

    def set_weights(self, weights: Sequence[Any], write: Any = None) -> None:
        """Write the user's model's (unsplit) ``weights`` into every copy this process
        runs; ``write(q, t, variable, value)`` where the variable does not hold its
        value."""
        if len(weights) != len(self.axes):
            raise ValueError(f"set_weights received {len(weights)} arrays; the model has "
                             f"{len(self.axes)} weights.")
        write = write or (lambda q, t, v, value: v.assign(value))
        for q, replica in enumerate(self.models):
            for t, model in enumerate(replica):
                if model is None:  # another worker's
                    continue
                for j, (var, axis) in enumerate(zip(model.weights, self.axes)):
                    if id(var) in self.foreign:  # another worker's chunk
                        continue
                    full = np.asarray(weights[j])
                    if j in self.ep_cut:  # replica q's ep rank's experts
                        write(q, t, var, np.split(full, self.run.ep)[self.run.ep_rank(q)])
                        continue
                    write(q, t, var, full if axis is None else
                          np.array_split(full, len(replica), axis=axis)[t])

    @property
    def mine(self) -> list[Any]:
        """The copies this process runs."""
        return [m for row in self.models for m in row if m is not None]


def build_copies(builder: Any, run: RunDescription, template: Any) -> Copies:
    """Every device's copy of ``builder()`` (module docstring), each holding the weights of
    ``template`` (the user's model built first, on the host: the plan's layer names are
    its names)."""
    if run.cp > 1:  # every layer but attention acts on each position alone
        check_context_parallel_model(template, run.cp, run.plan_name)
    reference = template.get_weights()
    entries = profiled_layer_paths(template)
    paths = [path for path, _ in entries]
    originals = dict(entries) if run.ep > 1 else {}
    models: list[list[Any]] = []
    programs: list[list[StageProgram]] = []
    on_pieces: list[Any] = []
    foreign: set[int] = set()
    for q, replica in enumerate(run.replicas):
        row, cut = [], []
        for t, device in enumerate(replica):
            if not run.drives(q, t):  # another worker's column (one program per worker)
                row.append(None)
                cut.append(None)
                continue
            # built on this process's first device of the column: under one program per
            # worker the column's chunks on other workers are theirs (their layers stay
            # here, built but never run: ``mine``)
            column = run.column(q, t)
            home = next(d for d in column if run.is_local(d))
            placed = tuple(d if run.is_local(d) else home for d in column)
            with tf.device(home):
                model = builder()
            layers = _layers_by_template_path(model, paths, run)
            model = _swap_splits(model, layers, run, placed, on_pieces, run.ep_rank(q),
                                 originals)
            _recompute(model, layers, run)
            if run.chunks > 1:
                cut.append(_place_chunks(model, paths, run, placed))
                foreign |= _foreign(cut[-1], column, run)
            row.append(model)
        models.append(row)
        programs.append(cut)
    mine = [m for row in models for m in row if m is not None]
    experts = frozenset(i for m in mine for layer in compat.flatten_layers(m)
                        if getattr(layer, "is_expert_twin", False) for i in shard_ids(layer))
    first = run.local_columns[0] if run.local else (0, 0)
    axes, ep_cut = _axes(mine[0], reference, run.tp, run.ep, experts, rank=first[1])
    copies = Copies(models, axes, run, programs if run.chunks > 1 else None,
                    frozenset(id(w) for w in on_pieces), frozenset(ep_cut), experts,
                    tuple(tuple(np.shape(w)) for w in reference),
                    tuple(np.asarray(w).dtype.name for w in reference),
                    foreign=frozenset(foreign))
    copies.set_weights(reference)
    for model in mine:  # another worker's chunks: their storage freed
        for v in model.variables:
            if id(v) in copies.foreign:
                compat.free_storage(v)
    check_split_blocks(models, template, run)
    if run.offload == "optimizer+weights":  # each copy's weights on its host's CPU
        for model in mine:
            for v in model.variables:
                compat.move_variable(v, host_device(v.value.device))
    return copies


def _layers_by_template_path(model: Any, paths: Sequence[str], run: RunDescription
                             ) -> dict[str, tuple[str, Any]]:
    """{the template's layer path: (this copy's path, layer)}. The builder makes the same
    structure each time, but Keras names a layer built without a name by a counter
    (``transformer_encoder``, then ``transformer_encoder_1``, ...), so a copy's layers are
    matched to the plan's names by position, not by name."""
    own = [entry for entry in profiled_layer_paths(model) if not is_layout_layer(entry[1])]
    if len(own) != len(paths):
        raise PlannerError(
            f"Plan {run.plan_name!r}: a call of the model's builder made {len(own)} layers "
            f"and the first {len(paths)}; the builder must make the same model every time "
            "(build the same layers; no structure that depends on a counter or on state).")
    return {path: entry for path, entry in zip(paths, own)}


def _own_top_level(layers: dict[str, tuple[str, Any]], name: str) -> str:
    """The copy's name of the template's top-level layer ``name`` (a nested model is listed
    by its layers' paths, ``name/...``)."""
    if name in layers:
        return layers[name][0]
    inner = next(own for path, (own, _) in layers.items() if path.startswith(name + "/"))
    return inner.split("/", 1)[0]


def _recompute(model: Any, layers: dict[str, tuple[str, Any]], run: RunDescription) -> None:
    """The run's recomputed layers under ``tf.recompute_grad`` in the copy ``model``
    (``apply.recompute.recompute_call``): under "full" each such top-level layer's call,
    on this instance; under "selective" the attention cores inside them. A split layer's
    twin is recomputed with its collectives (the forward's all-reduce runs again in the
    backward, as ``planner.traffic`` prices full recomputation)."""
    if run.zero_stage == 3 and run.recompute == "full":
        return  # ZeRO-3 recomputes every layer with weights already (apply.spmd.zero3)
    for name in run.recomputed:  # top-level layers: a split one is its twin by now
        layer = model.get_layer(_own_top_level(layers, name))
        if run.recompute == "selective":
            for attention in attention_layers(layer):
                if not compat.attention_core_is_wrapped(attention):
                    compat.wrap_attention_core(attention, _recompute_on_tape)
        else:
            layer.call = _recompute_on_tape(layer.call)


def _recompute_on_tape(fn: Any) -> Any:
    return recompute_call(fn, tape_only=True)  # SpmdModel differentiates with a tape


def _place_chunks(model: Any, paths: Sequence[str], run: RunDescription,
                  column: Sequence[str]) -> StageProgram:
    """The copy's graph cut by chunk (``apply.spmd.stages``), each layer's weights moved to
    the device of the chunk that runs it (built on chunk 0's)."""
    chunk_of_path = dict(run.stage_of_entry)
    layers = _layers_by_template_path(model, paths, run)  # the twins in place by now
    chunk_of_layer = {id(layer): chunk_of_path[path] for path, (_, layer) in layers.items()
                      if path in chunk_of_path}
    program = stage_program(model, chunk_of_layer, run.chunks, run.plan_name)
    for step in program.steps:
        if step.layer is not None and step.chunk > 0:
            for w in getattr(step.layer, "weights", ()):
                compat.move_variable(w, column[step.chunk])
    return program


def _foreign(program: StageProgram, column: Sequence[str], run: RunDescription) -> set[int]:
    """Ids of the variables of the chunks of ``column`` on another worker's devices."""
    return {id(w) for step in program.steps if not run.is_local(column[step.chunk])
            for w in getattr(step.layer, "weights", ())}


def _device_of(name: str, run: RunDescription, column: Sequence[str]) -> str:
    """The device of the plan's layer ``name`` (or of the block holding it) in a column
    (its chunk's)."""
    if len(column) == 1:
        return column[0]
    chunks = dict(run.stage_of_entry)
    while name not in chunks and "/" in name:  # a block's sub-layer: the block's chunk
        name = name.rpartition("/")[0]
    return column[chunks.get(name, 0)]


def _swap_splits(model: Any, layers: dict[str, tuple[str, Any]], run: RunDescription,
                 column: Sequence[str], on_pieces: list[Any], ep_rank: int = 0,
                 originals: dict[str, Any] | None = None) -> Any:
    """``model`` with each split layer replaced by its rank's twin (module docstring);
    ``layers``: ``_layers_by_template_path``'s; ``column``: the copy's device per chunk
    (a twin talks in its chunk's tensor-parallel group); the weights it reads on
    sequence pieces are added to ``on_pieces``; ``ep_rank``: the copy's expert-parallel
    rank (its share of every MoE layer's experts); ``originals``: the template's layers
    by path (the user's, under ep)."""
    device = column[0]
    twins = _batch_norm_twins(layers, run, column) + _context_twins(layers, run, device) \
        + _expert_twins(layers, run, column, ep_rank, originals or {})
    if not run.splits and not twins and run.cp == 1:
        return model
    entries = dict(layers.values())
    graph = is_graph_model(model)
    top: dict[int, Any] = {}
    for own, layer, twin in twins:
        if not twin.built:  # (a keras_hub block's twin comes built)
            with tf.device(device), scopes_of(layer):
                twin.build(**compat.build_arguments(layer))
        if SEPARATOR not in own and graph:
            top[id(layer)] = twin
        else:
            swap_in(_parent(model, own, entries), layer, twin)
    for name, split in run.splits:
        own, layer = layers.get(name, (name, None))
        if layer is None:
            raise PlannerError(f"Plan {run.plan_name!r} splits layer {name!r}, which the "
                               "model does not have. Re-plan for this model.")
        why = split_problem(layer, split, run.tp)
        if why:
            raise PlannerError(
                f"Plan {run.plan_name!r} splits layer {name!r} ({type(layer).__name__}) by "
                f"{split!r} over tp={run.tp}, which the SPMD engine cannot run: {why}. "
                "Leave that layer replicated (remove it from tp_splits) or re-plan.")
        own_device = _device_of(name, run, column)
        top_level = SEPARATOR not in own and graph
        # in a graph the layout gathers a column's output where a reader needs it whole
        # (apply.spmd.layout); in a block, unless the next split layer is a row split
        gather = not elementwise(getattr(layer, "activation", None)) if top_level else \
            name not in run.row_fed
        rank = Rank(split, run.chunk_group("tp", own_device), own_device,
                    gather_output=gather, sequence=run.sequence_parallel and top_level,
                    cp_group=run.chunk_group("cp", own_device) if run.cp > 1 else None)
        if split == "heads" and is_attention_block(layer):  # split in place
            with tf.device(device):
                split_block(layer, rank, own_device)
            continue
        with tf.device(device):
            twin = rank_twin(layer, rank)
            with scopes_of(layer):
                twin.build(**compat.build_arguments(layer))
        if top_level:
            top[id(layer)] = twin
            continue
        parent = _parent(model, own, entries)
        swap_in(parent, layer, twin)
    if not top and run.cp == 1:
        return model
    return _rewire(model, top, device, run.sequence_parallel, on_pieces, run.cp)


def _batch_norm_twins(layers: dict[str, tuple[str, Any]], run: RunDescription,
                      column: Sequence[str]) -> list[tuple[str, Any, Any]]:
    """(this copy's path, layer, twin) of every BatchNormalization layer whose statistics
    a step of several parts governs (``apply.spmd.batch_norm``): summed over the data-
    parallel group of the layer's device (its chunk's; dp > 1), or each part's own under
    ``local`` (dp > 1 or micro-batches)."""
    local = run.batch_norm == "local"
    if run.dp == 1 and not (local and run.num_microbatches > 1):
        return []
    out = []
    for name, (own, layer) in layers.items():
        if is_batch_norm(layer):
            device = _device_of(name, run, column)
            out.append((own, layer, group_batch_norm(layer, run.chunk_group("dp", device),
                                                     device, local)))
    return out


def _context_twins(layers: dict[str, tuple[str, Any]], run: RunDescription,
                   device: str) -> list[tuple[str, Any, Any]]:
    """(this copy's path, layer, twin) of every MultiHeadAttention run over the cp group of
    ``device`` (``apply.spmd.context``; cp > 1)."""
    if run.cp == 1:
        return []
    group, split = run.chunk_group("cp", device), dict(run.splits)
    return [(own, layer, context_twin(layer, group, device))
            for path, (own, layer) in layers.items()
            if type(layer) is keras.layers.MultiHeadAttention and path not in split]


def _expert_twins(layers: dict[str, tuple[str, Any]], run: RunDescription,
                  column: Sequence[str], ep_rank: int, originals: dict[str, Any]
                  ) -> list[tuple[str, Any, Any]]:
    """(this copy's path, layer, twin) of every expert layer (``MixtureOfExperts``,
    keras_hub's MoE blocks), holding ep rank ``ep_rank``'s experts and exchanging tokens
    over the ep group of its chunk's device (``apply.spmd.experts``; ep > 1);
    ``originals``: the template's layers by path."""
    if run.ep == 1:
        return []
    out = []
    for path, (own, layer) in layers.items():
        if is_expert_layer(layer):
            device = _device_of(path, run, column)
            out.append((own, layer, expert_twin(layer, originals.get(path, layer), run.ep,
                                                ep_rank, run.chunk_group("ep", device),
                                                device)))
    return out


def _parent(model: Any, name: str, entries: dict[str, Any]) -> Any:
    parts = name.split(SEPARATOR)
    if len(parts) == 1:
        return model
    parent = entries.get(SEPARATOR.join(parts[:-1]))
    if parent is None or is_graph_model(parent):
        raise PlannerError(f"Layer {name!r} sits directly in a nested model, whose graph "
                           "holds it; the SPMD engine splits layers of the top model or "
                           "inside blocks. Leave it replicated.")
    return parent


def _rewire(model: Any, twins: dict[int, Any], device: str, sequence: bool,
            on_pieces: list[Any], cp: int = 1) -> Any:
    """A Functional/Sequential ``model`` whose layers in ``twins`` (by id) are replaced,
    every other layer itself (not re-created); under sequence parallelism (``sequence``)
    the tensors between split layers cut into sequence pieces (``apply.spmd.layout``),
    the weights read on them added to ``on_pieces``; under context parallelism (``cp`` >
    1) on inputs of one chunk of the sequence (``apply.spmd.context``)."""
    layout = GraphLayout(sequence)

    def clone_function(layer: Any) -> Any:
        return twins.get(id(layer), layer)

    def call_function(layer: Any, *args: Any, **kwargs: Any) -> Any:
        with tf.device(device):
            return layout.call(layer, *args, **kwargs)

    if isinstance(model, keras.Sequential):  # clone_model re-wires Functional graphs only
        model = keras.Model(model.inputs, model.outputs, name=model.name)
    inputs = None
    if cp > 1:
        seq = model.inputs[0].shape[1]

        def chunk(x: Any) -> Any:
            shape = list(x.shape)
            if len(shape) > 1 and shape[1] == seq:
                shape[1] = seq // cp
            return keras.Input(batch_shape=tuple(shape), dtype=x.dtype, name=x.name)

        inputs = keras.tree.map_structure(chunk, model.input)
    with tf.device(device):
        rewired = keras.models.clone_model(model, input_tensors=inputs,
                                           clone_function=clone_function,
                                           call_function=call_function)
        on_pieces.extend(layout.weights)
        if not any(id(x) in layout.pieces or id(x) in layout.cut for x in rewired.outputs):
            return rewired
        outputs = keras.tree.map_structure(layout.whole, rewired.output)
        return keras.Model(rewired.inputs, outputs, name=rewired.name)


def _axes(model: Any, reference: Sequence[np.ndarray], tp: int, ep: int = 1,
          experts: frozenset[int] = frozenset(), rank: int = 0
          ) -> tuple[list[int | None], list[int]]:
    """For each weight of ``model`` (a copy, of tensor rank ``rank``), the axis the unsplit
    weight is cut along over the tensor ranks; and the indices of the weights cut along
    axis 0 over the ep ranks (``experts``: the ids of the copies' expert shards)."""
    axis_of: dict[int, int | None] = {}
    for layer in compat.flatten_layers(model):
        if is_twin(layer):
            for var, axis in zip(layer.weights, layer.rank_axes()):
                axis_of[id(var)] = axis
    weights = model.weights
    if len(weights) != len(reference):
        raise PlannerError(f"A device's copy of the model has {len(weights)} weights, the "
                           f"model {len(reference)}: the split layers changed its structure. "
                           "Leave them replicated and report this.")
    axes = [axis_of.get(id(w)) for w in weights]
    ep_cut = [j for j, w in enumerate(weights) if id(w) in experts]
    for j, (w, axis, full) in enumerate(zip(weights, axes, reference)):
        expected = list(np.shape(full))
        if axis is not None:  # the rank's slice (the first ones larger where uneven)
            expected[axis] = slice_sizes(expected[axis], tp)[rank]
        if j in ep_cut:
            expected[0] //= ep
        if list(w.shape) != expected:
            raise PlannerError(f"Weight {w.path!r} of a device's copy has shape "
                               f"{tuple(w.shape)}, the model's {np.shape(full)}. Leave its "
                               "layer replicated and report this.")
    return axes, ep_cut

