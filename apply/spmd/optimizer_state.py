"""The SPMD engine's optimizer state as one device's: what weight files and saved models hold.

Pipeline position: beside ``apply.spmd.model``: ``SpmdModel`` saves and loads through a model
of the user's structure on the host (the template); ``OptimizerState`` gives that model an
optimizer of the same class and configuration whose slots hold one device's state, and
writes such a state back into the engine's slots.

Where the engine keeps a weight's slots (each slot made for one variable:
``apply.placement.build_optimizer_on_devices`` says which): in every replica's copy of it
(the replicas' states are equal: they apply the same summed gradients), cut like the weight
across tensor ranks (``Copies.axes``), and under ZeRO (``apply.spmd.zero``) in the dp shards'
slots (rows [q r, (q+1) r) of the weight's first axis, padded), and for an expert shard
(``apply.spmd.experts``) in the replicas of its ep rank. One device's slot is replica
0's, the ranks' pieces joined along the weight's axis, the shards' rows joined and trimmed,
the ep ranks' experts (replicas 0..ep-1) joined along axis 0; written back, each piece goes
to every replica (or its rows to their shard, its experts to their ep rank's replicas). The optimizer's
other variables (its iteration count, a loss scale) are matched by position: the same class
and configuration make them in the same order.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tfplan.apply.placement import build_optimizer_on_devices
from tfplan.core.errors import PlannerError


class SlotTable:
    """Each variable's slots, in the order the optimizer made them."""

    def __init__(self, optimizer: Any, pairs: list[tuple[Any, Any]]) -> None:
        self.optimizer = optimizer
        self._of: dict[int, list[Any]] = {}
        for slot, reference in pairs:
            self._of.setdefault(id(reference), []).append(slot)
        made = {id(slot) for slot, _ in pairs}
        self.others = [v for v in optimizer.variables if id(v) not in made]

    def slots(self, variable: Any) -> list[Any]:
        return self._of.get(id(variable), [])


class OptimizerState:
    """One device's optimizer state for the template model (module docstring)."""

    def __init__(self, copies: Any, zero: Any) -> None:
        self.copies, self.zero = copies, zero
        copy = copies.mine[0]  # every copy lists its weights in the same order
        index = {id(w): i for i, w in enumerate(copy.weights)}
        # the axis each trainable weight is cut along across tensor ranks (None: whole)
        self.axes = [copies.axes[index[id(v)]] for v in copy.trainable_variables]
        # the trainable weights cut over the ep ranks (expert shards: axis 0)
        self.ep_cut = {j for j, v in enumerate(copy.trainable_variables)
                       if index[id(v)] in copies.ep_cut}
        self.weight_index = [index[id(v)] for v in copy.trainable_variables]
        self.engine: SlotTable | None = None
        self.template: SlotTable | None = None

    def built(self, optimizer: Any, pairs: list[tuple[Any, Any]]) -> None:
        """Record the engine optimizer's slots (``SpmdModel.compile``)."""
        self.engine = SlotTable(optimizer, pairs)
        self.template = None

    # ------------------------------------------------------------------ template side
    def to_template(self, template: Any, loss: Any) -> None:
        """Compile ``template`` with a fresh optimizer like the engine's (once) and write one
        device's state into it."""
        if self.engine is None:
            return
        table = self._template_table(template, loss)
        piece = self._pieces(template, table)
        for j, variable in enumerate(template.trainable_variables):
            for k, slot in enumerate(table.slots(variable)):
                slot.assign(self._joined(j, k, piece))
        for mine, theirs in self._others(table):
            mine.assign(theirs.numpy())

    def from_template(self, template: Any) -> None:
        """Write the template's optimizer state (just loaded) into the engine's slots."""
        if self.engine is None or self.template is None:
            return
        for j, variable in enumerate(template.trainable_variables):
            for k, slot in enumerate(self.template.slots(variable)):
                self._spread(j, k, np.asarray(slot.numpy()))
        for mine, theirs in self._others(self.template):
            theirs.assign(mine.numpy())

    def _template_table(self, template: Any, loss: Any) -> SlotTable:
        if self.template is None:
            engine = self.engine.optimizer
            optimizer = type(engine).from_config(engine.get_config())
            template.compile(optimizer=optimizer, loss=loss)
            pairs = build_optimizer_on_devices(optimizer, template.trainable_variables)
            self.template = SlotTable(optimizer, pairs)
        return self.template

    def _others(self, table: SlotTable) -> list[tuple[Any, Any]]:
        ours, theirs = table.others, self.engine.others
        if len(ours) != len(theirs) or any(
                tuple(a.shape) != tuple(b.shape) for a, b in zip(ours, theirs)):
            raise PlannerError(
                f"The optimizer {type(self.engine.optimizer).__name__} made different "
                "variables for the model and for the SPMD engine; its state cannot be saved "
                "as one device's. Save the weights alone (model.save_weights of the plain "
                "model) and report this.")
        return list(zip(ours, theirs))

    # ------------------------------------------------------------------ engine side
    def _holders(self, q: int, t: int, j: int) -> Any:
        """The variable whose slots hold (q, t)'s state of trainable weight j."""
        if self.zero is not None:
            return self.zero.shards[q][t][j]
        return self.copies.models[q][t].trainable_variables[j]

    def _pieces(self, template: Any, table: SlotTable) -> Any:
        """``piece(q, t, j, k)``: replica q's state k of trainable weight j (tensor rank t):
        its slot, or under ZeRO the shards' slots of every replica holding the same weight
        joined. One program per worker: another worker's from its owner (``apply.spmd.
        across.exchanged``; every worker calls this with the same pieces)."""
        run = self.copies.run
        slot = lambda variable, k: np.asarray(self.engine.slots(variable)[k].numpy())  # noqa: E731
        if self.zero is not None:
            if run.every_column_here:
                return lambda q, t, j, k: self.zero.joined(q, t, j, lambda s: slot(s, k))
            fetched = {}
            q0, t0 = run.local_columns[0]
            first = self.zero.shards[q0][t0][self.zero.own(q0, t0)[0]]
            for k in range(len(self.engine.slots(first))):
                self.zero.fetch(lambda s, k=k: slot(s, k))
                fetched[k] = self.zero.fetched
            self.zero.fetched = {}

            def joined(q: int, t: int, j: int, k: int) -> np.ndarray:
                self.zero.fetched = fetched[k]
                try:
                    return self.zero.joined(q, t, j, lambda s: slot(s, k))
                finally:
                    self.zero.fetched = {}
            return joined
        if run.every_column_here:
            return lambda q, t, j, k: slot(self._holders(q, t, j), k)
        from tfplan.apply.spmd.across import exchanged

        keys, entries = [], []
        for j, variable in enumerate(template.trainable_variables):
            for k, like in enumerate(table.slots(variable)):
                if tuple(like.shape) != tuple(variable.shape):
                    raise PlannerError(
                        f"The optimizer {type(self.engine.optimizer).__name__} keeps state of "
                        f"another shape than its weight ({tuple(like.shape)} for "
                        f"{tuple(variable.shape)}); across workers its pieces cannot be "
                        "joined into one device's. Save the weights alone, or use an "
                        "elementwise optimizer (Adam, SGD, ...).")
                for t, e in self._rank_keys(j):
                    q = self.copies.canonical(e)
                    keys.append((q, t, j, k))
                    entries.append((self.copies.owner(q, t, self.weight_index[j]),
                                    self.copies.rank_shape(t, self.weight_index[j]),
                                    lambda q=q, t=t, j=j, k=k: slot(self._holders(q, t, j), k)))
        got = dict(zip(keys, exchanged(run, entries)))
        return lambda q, t, j, k: got[(q, t, j, k)]

    def _rank_keys(self, j: int) -> list[tuple[int, int]]:
        """The (tensor rank, ep rank) pieces trainable weight j is joined from (``_joined``)."""
        return [(t, e) for t in self._ranks(j)
                for e in (range(self.copies.run.ep) if j in self.ep_cut else (0,))]

    def _ranks(self, j: int) -> range:
        """The tensor ranks whose pieces make trainable weight j (rank 0 where it is whole)."""
        return range(self.copies.run.tp) if self.axes[j] is not None else range(1)

    def _replica(self, t: int, e: int) -> int:
        """The replica whose rank-t piece of ep rank e is read: one of this process's on one
        host; across workers the canonical one (its owner gives it)."""
        if self.copies.run.every_column_here:
            return self.copies.reader(t, e)
        return self.copies.canonical(e)

    def _rank_piece(self, t: int, j: int, k: int, piece: Any) -> np.ndarray:
        run = self.copies.run
        if j in self.ep_cut:  # the experts of every ep rank, each from a replica holding it
            return np.concatenate([piece(self._replica(t, e), t, j, k) for e in range(run.ep)],
                                  axis=0)
        return piece(self._replica(t, 0), t, j, k)

    def _joined(self, j: int, k: int, piece: Any) -> np.ndarray:
        pieces = [self._rank_piece(t, j, k, piece) for t in self._ranks(j)]
        axis = self.axes[j]
        return pieces[0] if axis is None else np.concatenate(pieces, axis=axis)

    def _spread(self, j: int, k: int, full: np.ndarray) -> None:
        run = self.copies.run
        axis = self.axes[j]
        pieces = [full] * run.tp if axis is None else np.split(full, run.tp, axis=axis)
        for t, piece in enumerate(pieces):
            experts = np.split(piece, run.ep, axis=0) if j in self.ep_cut else None
            for q in range(run.dp):
                if not run.drives(q, t) or self._holders(q, t, j) is None \
                        or id(self._holders(q, t, j)) in self.copies.foreign:
                    continue  # another worker's (column, or chunk: its shards are there)
                slot = self.engine.slots(self._holders(q, t, j))[k]
                mine = piece if experts is None else experts[run.ep_rank(q)]
                if self.zero is None:
                    slot.assign(mine)
                else:
                    kind = self.zero.kinds[q][t][j]
                    slot.assign(self.zero.cuts[q][t][j].shard_of(
                        mine, self.zero.position(q, kind)))
