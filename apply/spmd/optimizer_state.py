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
        for j, variable in enumerate(template.trainable_variables):
            for k, slot in enumerate(table.slots(variable)):
                slot.assign(self._joined(j, k))
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

    def _rank_piece(self, t: int, j: int, k: int) -> np.ndarray:
        run = self.copies.run
        if j in self.ep_cut:  # the experts of every ep rank, each from a replica holding it
            return np.concatenate([self._replica_piece(self.copies.reader(t, e), t, j, k)
                                   for e in range(run.ep)], axis=0)
        return self._replica_piece(self.copies.reader(t, 0), t, j, k)

    def _replica_piece(self, q: int, t: int, j: int, k: int) -> np.ndarray:
        """Replica q's state of weight j (tensor rank t): its slot, or under ZeRO the
        shards of every replica holding the same weight joined."""
        if self.zero is None:
            return np.asarray(self.engine.slots(self._holders(q, t, j))[k].numpy())
        kind = self.zero.kinds[q][t][j]
        self.zero.check_local(q, t, kind)
        return self.zero.cuts[q][t][j].unpadded(np.concatenate(
            [np.asarray(self.engine.slots(self._holders(r, t, j))[k].numpy())
             for r in self.zero.holders(q, kind)], axis=0))

    def _joined(self, j: int, k: int) -> np.ndarray:
        pieces = [self._rank_piece(t, j, k) for t in range(self.copies.run.tp)]
        axis = self.axes[j]
        return pieces[0] if axis is None else np.concatenate(pieces, axis=axis)

    def _spread(self, j: int, k: int, full: np.ndarray) -> None:
        run = self.copies.run
        axis = self.axes[j]
        pieces = [full] * run.tp if axis is None else np.split(full, run.tp, axis=axis)
        for t, piece in enumerate(pieces):
            experts = np.split(piece, run.ep, axis=0) if j in self.ep_cut else None
            for q in range(run.dp):
                if not run.drives(q, t):  # another worker's
                    continue
                slot = self.engine.slots(self._holders(q, t, j))[k]
                mine = piece if experts is None else experts[run.ep_rank(q)]
                if self.zero is None:
                    slot.assign(mine)
                else:
                    kind = self.zero.kinds[q][t][j]
                    slot.assign(self.zero.cuts[q][t][j].shard_of(
                        mine, self.zero.position(q, kind)))
