"""One ep group's shard of stacked expert weights: what every expert-parallel twin shares.

Pipeline position: under ``apply.expert_parallel`` (``ExpertParallelMoE``, the twin of
``tfplan.layers.MixtureOfExperts``) and ``apply.expert_parallel_hub`` (the shards of
keras_hub's Mixtral and Qwen-MoE expert banks). ``ExpertShards`` is mixed into a Keras
layer that holds experts ``rank*E/ep .. (rank+1)*E/ep - 1`` of ``E`` as ``[E/ep, ...]``
slices of each stacked expert weight (``shard_variables``). After every replica is built,
``apply.expert_parallel`` links the ep twins of each group (``link``); ``on_ranks`` then
runs chunk j of a dispatch buffer ``[E, C, d]`` under ``tf.device`` of rank j with rank
j's shard, and concatenates the outputs where it was called (the placed all-to-all:
``apply.expert_parallel``'s docstring). The links are a plain object Keras does not see,
so each twin tracks, builds and saves only its own shard; unsplit weights (``[E, ...]``,
group order) go through ``apply.sharded_base.Sharded``'s ``full_pieces``.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import tensorflow as tf

from tfplan.apply.sharded_base import assign_pieces
from tfplan.core.errors import PlanMismatchError

EXPERT_SPLIT = "experts"  # an expert twin's ``tp_split`` (apply.sharded_base.Sharded)


class ExpertParallelError(PlanMismatchError):
    """An expert-parallel plan this model or strategy cannot run (``apply.expert_parallel``)."""


class _Exchange:
    """The SPMD engine's collectives standing in for ``on_ranks``' placed transfers (a
    plain object: Keras does not track it)."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn


class _Group:
    """The twins of one ep group, rank order (a plain object: Keras does not track it)."""

    def __init__(self, twins: Sequence[Any]) -> None:
        self.twins = tuple(twins)


class ExpertShards:
    """Mixed into a Keras layer (with ``apply.sharded_base.Sharded``) holding one ep rank's
    experts; ``shard_variables`` names its stacked ``[E/ep, ...]`` weights in the unsplit
    layer's order."""

    ep: int = 1
    ep_rank: int = 0
    ep_device: str = ""

    def init_ep(self, ep: int, rank: int, device: str) -> None:
        self.ep, self.ep_rank, self.ep_device = ep, rank, device
        self._init_tp(EXPERT_SPLIT, (device,))  # type: ignore[attr-defined]  # Sharded
        self._group = _Group(())

    def exchange_with(self, fn: Callable[[tf.Tensor, Callable[[tf.Tensor], tf.Tensor]],
                                         tf.Tensor]) -> None:
        """Run ``on_ranks`` SPMD: ``fn(xe, run_own_experts)`` exchanges the dispatch buffer
        over the ep group with collectives (``apply.spmd.experts``); no links to peers."""
        self._exchange = _Exchange(fn)

    def link(self, twins: Sequence["ExpertShards"]) -> None:
        """The group's twins, rank order (this one at ``ep_rank``)."""
        self._group = _Group(twins)

    def peers(self) -> tuple[Any, ...]:
        """The group's twins, rank order; empty before ``link`` (a method, not an
        attribute: Keras' weight files walk a layer's attributes)."""
        return self._group.twins

    def shard_variables(self) -> list[Any]:
        raise NotImplementedError

    def on_ranks(self, xe: tf.Tensor, fn: Callable[[Any, tf.Tensor], tf.Tensor]) -> tf.Tensor:
        """``fn(twin_j, chunk_j)`` for the ep chunks of ``xe`` along its first axis (the
        experts), each under rank j's device; the outputs concatenated here."""
        exchange = getattr(self, "_exchange", None)
        if exchange is not None:  # the SPMD engine: this rank's experts, collectives
            return exchange.fn(xe, lambda rows: fn(self, rows))
        peers = self.peers()
        if len(peers) != self.ep:
            raise ExpertParallelError(
                f"Expert-parallel layer {getattr(self, 'name', '?')!r} was called before its "
                f"ep group was linked (received {len(peers)} twins, expected ep={self.ep}); "
                "build it through apply.wrap (apply.expert_parallel).")
        outputs = []
        for peer, chunk in zip(peers, tf.split(xe, self.ep, axis=0)):
            with tf.device(peer.ep_device):  # that rank's experts, on its device
                outputs.append(fn(peer, chunk))
        return tf.concat(outputs, axis=0)  # back where the layer runs

    # --- unsplit stacked weights ---------------------------------------------------------
    def stacked_pieces(self) -> list[tuple[tuple[Any, ...], int | None]]:
        """Each stacked weight as (its group's shards in rank order, axis 0); before
        ``link``, (this rank's shard, None)."""
        i_of = range(len(self.shard_variables()))
        peers = self.peers()
        if not peers:
            return [((v,), None) for v in self.shard_variables()]
        return [(tuple(p.shard_variables()[i] for p in peers), 0) for i in i_of]

    def check_linked(self) -> None:
        if not self.peers() and self.ep > 1:
            raise ExpertParallelError(
                f"Expert-parallel layer {getattr(self, 'name', '?')!r} holds 1/{self.ep} of "
                f"the experts and its ep group is not linked (received no group, expected "
                f"ep={self.ep} twins): its unsplit weights cannot be read. Wrap the model "
                "with apply.wrap.")

    def assign_stacked(self, arrays: Sequence[Any]) -> None:
        """The unsplit ``[E, ...]`` arrays: every rank of the group its slice, or (before
        ``link``, while the replicas are built) this rank's slice."""
        peers = self.peers()
        for i, full in enumerate(arrays):
            full = np.asarray(full)
            if peers:
                assign_pieces([p.shard_variables()[i] for p in peers], full, 0)
            else:
                n = full.shape[0] // self.ep
                self.shard_variables()[i].assign(full[self.ep_rank * n:(self.ep_rank + 1) * n])
