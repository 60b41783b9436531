"""Pipeline parallelism on the SPMD engine: each column's chunks run slot by slot, in the
schedule's order, each on its own device.

Pipeline position: ``apply.spmd.model.SpmdModel`` runs its steps through ``ColumnPass``
for plans with several chunks (``RunDescription.chunks > 1``); each column copy's graph is
cut by ``apply.spmd.stages``.

* **Order** (``slot_order``): the slots (forward or backward of micro-batch j on chunk k)
  are traced in one order that keeps every pipeline device's own order
  (``planner.pipeline_order``: GPipe, 1F1B, interleaved 1F1B) and the data flow (a forward
  after the same micro-batch's forward on the chunk before; a backward after the forward
  on its chunk and the backward on the chunk after). TensorFlow's collective ordering
  token then runs each device's tensor-parallel collectives in its schedule's order.
* **Memory bound**: under 1F1B and interleaved, a forward waits (control dependencies)
  for the backward slots its device's order puts before it (``apply.schedule
  .forward_waits``; a chain of markers per pipeline device), as Megatron's schedules bound
  the micro-batches in flight.
* **Hops**: a chunk reads each value an earlier chunk made through one ``tf.identity`` on
  its own device (the activation's one transfer, kind pp, with its Keras mask); the
  producer keeps its original, so a value read by two later chunks goes to each directly,
  once per device (a device's later chunk reads the copy its earlier one received, and
  the gradients its chunks return for it are added there before going back).
  In training the copy is of the value's ``stop_gradient``, watched by the tape: the
  backward of chunk k ends at the values it received (else the tape would go on into the
  earlier chunks' operations from chunk k's device).
* **Hops between workers** (one program per worker, a column whose chunks lie on several
  workers): each worker traces every slot in the same order but runs only its own chunks;
  a value made on one worker and read on another's device moves by a two-member
  collective (``member_send`` on the producer's device at the reader's forward slot,
  ``member_receive`` on the reader's: the shape from the graph's symbolic tensor, the
  batch from the part's rows; a shape known only as it runs, as a nested backbone's
  sequence length, is sent first; a Keras mask the graph shows on it follows it, as int32),
  and its gradient comes back the same way at the reader's
  backward slot (zeros where the reader's backward gives none). Every send and receive of
  a pair of devices is counted in the same order on both workers, so their instance keys
  meet; the sends' outputs are kept (``sends``) for the step to depend on (``tf.function``
  would prune them).
* **Backward** of slot (j, k): one ``GradientTape.gradient`` on chunk k's device, of chunk
  k's targets (the values it sent, weighted by the gradients its consumers returned; on
  the last chunk the part's loss; its layers' added losses) with respect to its weights
  and the values it received, whose gradients go back to their producers (the backward
  hop). Gradients add up per weight across micro-batches on the weight's device (ZeRO-2:
  each slot's reduce-scattered first, the shards adding up; ZeRO-3: the gradients of the
  shards the layers gathered, reduce-scattered by the gathers' backward).
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import keras
import tensorflow as tf

from tfplan import compat
from tfplan.apply.collective_ops import member_receive, member_send
from tfplan.apply.gradients import sum_gradients
from tfplan.apply.groups import Group, group_key
from tfplan.apply.schedule import forward_waits
from tfplan.apply.spmd.run import RunDescription
from tfplan.apply.spmd.stages import StageProgram
from tfplan.core.errors import PlannerError
from tfplan.planner.pipeline_order import Slot, device_order


def device_orders(run: RunDescription) -> tuple[tuple[Slot, ...], ...]:
    return tuple(device_order(run.schedule, d, run.pp, run.virtual_stages,
                              run.num_microbatches) for d in range(run.pp))


def slot_order(run: RunDescription) -> list[Slot]:
    """Every slot once, in an order that keeps each pipeline device's order and the data
    flow (module docstring): round robin over the devices, each taking its next slot
    once what it needs is done."""
    orders = [list(o) for o in device_orders(run)]
    last = run.chunks - 1
    done: set[tuple[str, int, int]] = set()
    out: list[Slot] = []
    position = [0] * len(orders)

    def ready(s: Slot) -> bool:
        if s.kind == "F":
            return s.stage == 0 or ("F", s.microbatch, s.stage - 1) in done
        after = ("F", s.microbatch, last) if s.stage == last else ("B", s.microbatch,
                                                                   s.stage + 1)
        return ("F", s.microbatch, s.stage) in done and after in done

    while len(out) < sum(map(len, orders)):
        moved = False
        for d, order in enumerate(orders):
            if position[d] < len(order) and ready(order[position[d]]):
                slot = order[position[d]]
                out.append(slot)
                done.add((slot.kind, slot.microbatch, slot.stage))
                position[d] += 1
                moved = True
        if not moved:
            raise PlannerError(f"Plan {run.plan_name!r}: the {run.schedule} schedule's "
                               "device orders wait for each other (a deadlock). Re-plan with "
                               "--schedule 1f1b or gpipe.")
    return out


def pp_group(devices: Sequence[str]) -> Group:
    """A group of a column's devices outside the plan's table (a hop's pair, producer
    first; a column's devices, chunk order): its key from the devices in that order, the
    same on every worker."""
    devices = tuple(devices)
    return Group("pp", devices, group_key(devices))


def _masked(spec: Any) -> bool:
    """Whether the graph's value ``spec`` (a KerasTensor) carries a Keras mask."""
    return compat.get_keras_mask(spec) is not None


class ColumnPass:
    """One column's micro-batches through its chunks, slot by slot (module docstring).

    ``loss_terms(x, y, y_pred, sw, valid, aux)``: a part's loss terms on the last chunk
    (``SpmdModel._loss_terms``' dict); ``aux``: the part's added losses of every chunk."""

    def __init__(self, run: RunDescription, program: StageProgram, column: Sequence[str],
                 parts: Sequence[Any], flags: Sequence[Any], training: bool,
                 loss_terms: Callable[..., dict[str, Any]],
                 shard_of: Callable[[Any], Any] | None = None,
                 reduce: Callable[[list[Any], list[Any]], list[Any]] | None = None,
                 sends: list[Any] | None = None) -> None:
        self.run, self.program, self.column = run, program, tuple(column)
        self.local = run.is_local  # this process's devices (one program per worker)
        self.sends = sends if sends is not None else []  # what the step depends on
        self._sent: list[set[tuple[int, str]]] = [set() for _ in parts]  # (value, device)
        self.parts, self.flags, self.training = parts, flags, training
        self.loss_terms = loss_terms
        m, chunks = len(parts), program.chunks
        self.values: list[dict[int, Any]] = [{} for _ in range(m)]  # producers' values
        self.received: list[list[list[tuple[int, Any]]]] = [
            [[] for _ in range(chunks)] for _ in range(m)]
        self.returned: list[dict[int, list[Any]]] = [{} for _ in range(m)]  # backward hops
        self.copies: list[dict[tuple[int, str], Any]] = [{} for _ in range(m)]  # (id, device)
        self.aux: list[list[list[Any]]] = [[[] for _ in range(chunks)] for _ in range(m)]
        self.results: list[dict[str, Any] | None] = [None] * m
        # each chunk's weights, and what its backward differentiates: the weights, or under
        # ZeRO-3 (``shard_of`` without ``reduce``) their shards, read through the gathers;
        # ``reduce``: each slot's gradients reduced at once (ZeRO-2: reduce-scattered to
        # this rank's shards, ``shard_of``'s shapes)
        self.owners = [_chunk_weights(program, k) for k in range(chunks)]
        self.weights = [[shard_of(w) for w in ws] if shard_of and not reduce else ws
                        for ws in self.owners]
        self.shard_of, self.reduce = shard_of, reduce
        self.grads: list[dict[int, Any]] = [{} for _ in range(chunks)]  # id(var) -> sum
        self._chains: list[list[Any]] = [[] for _ in range(run.pp)]
        self._finished: dict[tuple[int, int], list[Any]] = {}
        scheduled = run.schedule in ("1f1b", "interleaved")
        self._waits = forward_waits(device_orders(run), run.schedule) if scheduled else {}
        self._backwards = [[s for s in o if s.kind == "B"] for o in device_orders(run)]

    # ------------------------------------------------------------------ forward
    def forward(self, j: int, k: int, tape: Any = None) -> None:
        """Forward slot (j, k); ``tape``: the step's, which then starts chunk k's part of
        the graph at the values it received (the backward slot stops there)."""
        device = self.column[k]
        x, y, sw = _unpack(self.parts[j])
        if not self.local(device):  # another worker's chunk: send it what this one made
            self._send_forward(j, k)
            return
        with tf.device(device), tf.control_dependencies(self._wait(j, k)):
            if k == 0:
                self.program.feed(self.values[j], x)
            view = dict(self.values[j])
            for i in self.program.received(k):
                copy = self.copies[j].get((i, device))
                source = self.column[self.program.producer[i]]
                if copy is None and not self.local(source):  # made on another worker
                    copy = self._receive_forward(j, i, source, device, x, tape)
                elif copy is None:  # one copy per receiving device (a device's later
                    value = view[i]  # chunks read it there)
                    cut = tape is not None and value.dtype.is_floating
                    copy = tf.identity(tf.stop_gradient(value) if cut else value)
                    if cut:
                        tape.watch(copy)
                    mask = compat.get_keras_mask(value)
                    if mask is not None:
                        compat.set_keras_mask(copy, tf.identity(mask))
                    self.copies[j][(i, device)] = copy
                view[i] = copy
                self.received[j][k].append((i, copy))
            called = self.program.run_chunk(k, view, self.training)
            for i in self.program.made(k):
                if i in view:
                    self.values[j][i] = view[i]
            self.aux[j][k] = [loss for layer in called for loss in getattr(layer, "losses", ())]
            if k == self.program.chunks - 1:
                y_pred = self.program.outputs(view)
                aux = [a for chunk in self.aux[j] for a in chunk]
                self.results[j] = self.loss_terms(x, y, y_pred, sw, self.flags[j], aux)

    # ------------------------------------------------------------------ hops between workers
    def _hop(self, producer: str, reader: str) -> Group:
        """The two-device group of a hop (producer first: the same on both workers)."""
        return pp_group((producer, reader))

    def _send_forward(self, j: int, k: int) -> None:
        """Forward slot (j, k) of another worker's chunk: the values this worker's chunks
        made that it reads, each sent once to its device."""
        reader = self.column[k]
        for i in self.program.received(k):
            source = self.column[self.program.producer[i]]
            if not self.local(source) or (i, reader) in self._sent[j]:
                continue
            self._sent[j].add((i, reader))
            value = self.values[j][i]
            spec = self.program.tensors[i]
            mask = compat.get_keras_mask(value)
            if (mask is not None) != _masked(spec):  # the receiver goes by the graph's
                raise PlannerError(
                    f"Plan {self.run.plan_name!r} sends a value from {source} to {reader}, on "
                    "another worker, whose Keras mask the model's graph does not show "
                    "(the receiver could not expect it). Keep those layers' stages on one "
                    "worker, or re-plan.")
            group = self._hop(source, reader)
            if not _static_tail(spec):  # its shape first (known as it runs)
                self.sends.append(member_send(tf.shape(value, out_type=tf.int64), group,
                                              source))
            self.sends.append(member_send(value, group, source))
            if mask is not None:  # then its Keras mask (as int32: no bool collectives)
                self.sends.append(member_send(tf.cast(mask, tf.int32), group, source))

    def _receive_forward(self, j: int, i: int, source: str, device: str, x: Any,
                         tape: Any) -> Any:
        """Value i of part j, made on another worker's ``source``, received on ``device``
        (its shape from the graph, the batch from the part's rows)."""
        spec = self.program.tensors[i]
        tail = tuple(spec.shape[1:])
        group = self._hop(source, device)
        if _static_tail(spec):  # the batch from the part's rows, the rest from the graph
            rows = tf.shape(tf.nest.flatten(x)[0])[0]
            shape = tf.concat([[rows], tf.constant(tail, tf.int32)], 0)
        else:  # a length known only as it runs (a nested backbone's sequence): sent first
            shape = member_receive(tf.constant([len(spec.shape)]), tf.int64, group, device)
        dtype = tf.as_dtype(spec.dtype)
        copy = member_receive(shape, dtype, group, device)
        copy.set_shape((tf.nest.flatten(x)[0].shape[0], *tail))
        if _masked(spec):  # its Keras mask follows it (the graph says it has one)
            mask_spec = compat.get_keras_mask(spec)
            mask_tail = tuple(mask_spec.shape[1:])
            mask_shape = (tf.concat([shape[:1], tf.constant(mask_tail, shape.dtype)], 0)
                          if None not in mask_tail  # else the value's leading axes (a
                          else shape[:len(mask_spec.shape)])  # [batch, seq] mask)
            mask = tf.cast(member_receive(mask_shape, tf.int32, group, device), tf.bool)
            mask.set_shape((copy.shape[0], *mask_spec.shape[1:]))
            compat.set_keras_mask(copy, mask)
        if tape is not None and dtype.is_floating:
            tape.watch(copy)
        self.copies[j][(i, device)] = copy
        return copy

    def _receive_backward(self, j: int, k: int) -> None:
        """Backward slot (j, k) of another worker's chunk: the gradients it returns for the
        values this worker's chunks sent it."""
        reader = self.column[k]
        for i in self.program.received(k):
            source = self.column[self.program.producer[i]]
            value = self.values[j].get(i)
            if not self.local(source) or value is None or not value.dtype.is_floating:
                continue
            with tf.device(source):
                g = member_receive(tf.shape(value), value.dtype, self._hop(source, reader),
                                   source)
                g.set_shape(value.shape)
            self.returned[j].setdefault(i, []).append(g)

    def forward_all(self) -> list[dict[str, Any]]:
        """Every micro-batch through every chunk (evaluation, prediction: no backward)."""
        for j in range(len(self.parts)):
            for k in range(self.program.chunks):
                self.forward(j, k)
        return list(self.results)

    def _wait(self, j: int, k: int) -> list[Any]:
        """The marker forward (j, k) waits for: its pipeline device's first n backward
        slots done (``forward_waits``), [] where it waits for none."""
        n = self._waits.get((j, k), 0)
        if n == 0:
            return []
        d = k % self.run.pp
        chain = self._chains[d]
        while len(chain) < n:
            slot = self._backwards[d][len(chain)]
            with tf.device(self.column[slot.stage]), tf.control_dependencies(
                    chain[-1:] + self._finished.get((slot.microbatch, slot.stage), [])):
                chain.append(tf.no_op(name=f"pipeline_backward_mb{slot.microbatch}"
                                           f"_stage{slot.stage}_done"))
        return [chain[n - 1]]

    # ------------------------------------------------------------------ backward
    def backward(self, j: int, k: int, tape: Any, targets: Sequence[Any]) -> None:
        """Slot (j, k)'s backward (module docstring); ``targets``: its loss terms already
        weighted and scaled (the part's loss on the last chunk, its added losses)."""
        device = self.column[k]
        if not self.local(device):  # another worker's chunk: the gradients it returns
            self._receive_backward(j, k)
            self._finished[(j, k)] = []
            return
        ys, seeds = list(targets), []
        with tf.device(device):
            seeds = [tf.ones_like(y) for y in ys]
            for i in self.program.sent(k):
                back = self.returned[j].get(i)
                if back:
                    ys.append(self.values[j][i])
                    seeds.append(_summed_by_device(back))
        received = [(i, r) for i, r in self.received[j][k] if r.dtype.is_floating]
        weights = self.weights[k]
        with tf.device(device), tape.stop_recording():
            if not ys:
                for i, r in received:  # a remote producer waits for a gradient: zeros
                    self._send_back(i, tf.zeros_like(r), device)
                self._finished[(j, k)] = []
                return
            grads = tape.gradient(ys, list(weights) + [r for _, r in received],
                                  output_gradients=seeds)
            mine = list(grads[:len(weights)])
            if self.reduce is not None and weights:
                mine = self.reduce(list(weights), [tf.zeros_like(w) if g is None else g
                                                   for w, g in zip(weights, mine)])
            done = []
            for w, g in zip(self.owners[k], mine):
                if g is None:
                    continue
                before = self.grads[k].get(id(w))
                self.grads[k][id(w)] = g if before is None else sum_gradients([before, g])
                done.append(g.op)
            for (i, r), g in zip(received, grads[len(weights):]):
                if self._send_back(i, tf.zeros_like(r) if g is None else g, device):
                    continue
                if g is not None:
                    self.returned[j].setdefault(i, []).append(g)
                    done.append(g.op)
        self._finished[(j, k)] = done

    def _send_back(self, i: int, g: Any, device: str) -> bool:
        """Value i's gradient sent back to its producer when that is another worker's
        device (True); False where the producer is this worker's."""
        source = self.column[self.program.producer[i]]
        if self.local(source):
            return False
        self.sends.append(member_send(tf.convert_to_tensor(g), self._hop(source, device),
                                      device))
        return True

    def weight_grads(self) -> dict[str, tuple[list[Any], list[Any]]]:
        """{device: (gradients, weights)} of this column: every chunk's trainable weights on
        its device, in chunk order (zeros where no slot reached one); under ZeRO-2/3 the
        gradients are of the weights' shards."""
        out: dict[str, tuple[list[Any], list[Any]]] = {}
        for k, weights in enumerate(self.owners):
            device = self.column[k]
            if not self.local(device):  # another worker's chunk: its weights are its
                continue
            gs, vs = out.setdefault(device, ([], []))
            with tf.device(device):
                for w in weights:
                    g = self.grads[k].get(id(w))
                    if g is None:
                        g = tf.zeros_like(self.shard_of(w) if self.shard_of else w)
                    gs.append(g)
                    vs.append(w)
        return out


def _static_tail(spec: Any) -> bool:
    """Whether a symbolic tensor's shape beyond the batch is known from the graph."""
    return all(d is not None for d in tuple(spec.shape[1:]))


def _summed_by_device(grads: Sequence[Any]) -> Any:
    """The sum of the gradients chunks returned for one value: those of one device's chunks
    added there first, so each device sends one gradient back."""
    by_device: dict[str, list[Any]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    parts = []
    for device, gs in by_device.items():
        with tf.device(device):
            parts.append(gs[0] if len(gs) == 1 else tf.add_n(gs))
    return parts[0] if len(parts) == 1 else tf.add_n(parts)


def _chunk_weights(program: StageProgram, k: int) -> list[Any]:
    """Chunk k's trainable weights, each once, in the order its layers run."""
    seen: dict[int, Any] = {}
    for layer in program.layers_of(k):
        for w in getattr(layer, "trainable_weights", ()):
            seen.setdefault(id(w), w)
    return list(seen.values())


def _unpack(part: Any) -> tuple[Any, Any, Any]:
    return keras.utils.unpack_x_y_sample_weight(part)
