"""The collective groups of a plan: one table, computed once, naming every group's devices and key.

Pipeline position: the bottom of ``apply`` beside ``apply.mode`` (it imports no other
``apply`` module but device names): ``groups_of(plan)`` is derived from the plan alone,
so every worker that reads the same plan builds the same table, with the same keys, and
its collectives meet. ``apply.collective_ops`` launches collectives over these groups;
``apply.audit`` names the kind of each measured transfer by them.

Device order (``planner.plan``): stage s lists dp x cp x tp devices, tensor rank
innermost; "replica" q = r cp + c (data-parallel rank r, context rank c) holds
``stages[s].devices[q tp:(q + 1) tp]``. The groups of each stage:

* ``tp``: one replica's tensor ranks, ``devices[q tp:(q + 1) tp]`` (Megatron's tensor
  model parallel group); the f/g all-reduces, sequence parallelism's gathers and scatters;
* ``dp``: tensor rank t of every replica, ``devices[q tp + t]`` for q < dp x cp (the
  gradient reduction, ZeRO's scatters and gathers; context ranks hold the same weights);
* ``cp``: the context ranks of one data-parallel rank and tensor rank (keys and values);
* ``ep``: ep consecutive data-parallel ranks r // ep == g (they hold different experts:
  ``planner.plan.Strategy.ep``), the token all-to-alls (one group per context rank); ``edp``:
  the replicas holding the same experts, r % ep == e, every context rank (their gradients'
  reduction);
* ``pp``: a device of chunk k and the same position of chunk k + 1 (a pipeline hop); in a
  general placement (one device per stage, layers in any pattern) every pair of its devices.

Groups of one device are left out (nothing to exchange). A group's key is a function of
its devices alone (``group_key``: ``KEY_BASE`` plus their CRC-32): TensorFlow's collective
runtime keeps one size per key for the whole process, so two plans (or kinds) over the
same devices share the group, and every worker computes the same key without talking.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Iterable

from tfplan.planner.plan import Plan

KEY_BASE = 1 << 20  # collective group keys below are left to tf.distribute and the profiler
# the order a transfer between two devices is attributed in when they share several groups
PAIR_ORDER = ("tp", "pp", "cp", "dp", "ep", "edp")


@dataclass(frozen=True)
class Group:
    """One collective group: its ``kind`` (module docstring), devices (in rank order) and
    ``key`` (the ``group_key`` every member's collective uses)."""

    kind: str
    devices: tuple[str, ...]
    key: int

    @property
    def size(self) -> int:
        return len(self.devices)


@dataclass(frozen=True)
class Groups:
    """Every group of a plan (``groups_of``)."""

    groups: tuple[Group, ...]

    def of_kind(self, kind: str) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if g.kind == kind)

    def containing(self, device: str, kind: str) -> Group | None:
        """The group of ``kind`` that ``device`` is a member of (None: none, or alone)."""
        return next((g for g in self.groups if g.kind == kind and device in g.devices), None)

    def kind_of_pair(self, a: str, b: str) -> str:
        """The kind of a transfer from ``a`` to ``b``: the first kind of ``PAIR_ORDER`` with a
        group holding both ("edp" reads as "dp"); "other" when none does."""
        for kind in PAIR_ORDER:
            if any(a in g.devices and b in g.devices for g in self.of_kind(kind)):
                return "dp" if kind == "edp" else kind
        return "other"

    def kind_of_group_size(self, device: str, n: int) -> str:
        """The kind of a collective of ``n`` members that ``device`` takes part in, when the
        collective does not say (one built by tf.distribute): the first kind, data-parallel
        first, with a group of that size holding ``device``; "other" when none does."""
        for kind in ("dp", "tp", "cp", "ep", "edp", "pp"):
            if any(device in g.devices and g.size == n for g in self.of_kind(kind)):
                return "dp" if kind == "edp" else kind
        return "other"

    def to_dict(self) -> list[dict]:
        return [{"kind": g.kind, "devices": list(g.devices), "key": g.key} for g in self.groups]


def groups_of(plan: Plan) -> Groups:
    """The group table of ``plan`` (module docstring)."""
    s = plan.strategy
    tp, cp, dp = max(1, s.tp), max(1, s.cp), max(1, s.dp)
    ep = max(1, s.ep)
    replicas = dp * cp
    found: list[tuple[str, tuple[str, ...]]] = []
    if plan.placement != "stages":  # a general placement: one device per stage, whose
        # activations may go to any other's (a pipeline hop each: kind pp)
        devices = [stage.devices[0] for stage in plan.stages if stage.devices]
        return Groups(tuple(Group(kind, pair, group_key(pair)) for kind, pair in _unique(
            ("pp", (x, y)) for i, x in enumerate(devices) for y in devices[i + 1:])))
    for stage in plan.stages:
        d = stage.devices
        if len(d) != replicas * tp:
            continue  # a plan of another shape than its strategy says (validate refuses it)
        found += [("tp", tuple(d[q * tp:(q + 1) * tp])) for q in range(replicas)]
        found += [("dp", tuple(d[q * tp + t] for q in range(replicas))) for t in range(tp)]
        found += [("cp", tuple(d[(r * cp + c) * tp + t] for c in range(cp)))
                  for r in range(dp) for t in range(tp)]
        if ep > 1:
            found += [("ep", tuple(d[(r * cp + c) * tp + t] for r in range(g * ep, (g + 1) * ep)))
                      for g in range(dp // ep) for c in range(cp) for t in range(tp)]
            # every replica holding the same experts: ep rank e of every dp rank's group,
            # every context rank (they hold the same weights)
            found += [("edp", tuple(d[(r * cp + c) * tp + t] for r in range(e, dp, ep)
                                    for c in range(cp)))
                      for e in range(ep) for t in range(tp)]
    for a, b in zip(plan.stages, plan.stages[1:]):
        found += [("pp", (x, y)) for x, y in zip(a.devices, b.devices) if x != y]
    return Groups(tuple(Group(kind, devices, group_key(devices))
                        for kind, devices in _unique(found)))


def group_key(devices: tuple[str, ...]) -> int:
    """The collective group key of ``devices`` (in member order): KEY_BASE + CRC-32 of
    their names, below 2^31 (a 32-bit attribute)."""
    return KEY_BASE + zlib.crc32("|".join(devices).encode()) % ((1 << 31) - KEY_BASE)


def _unique(found: Iterable[tuple[str, tuple[str, ...]]]) -> list[tuple[str, tuple[str, ...]]]:
    """Groups of two or more devices, each (kind, devices) once, in order."""
    return list(dict.fromkeys((k, d) for k, d in found if len(set(d)) > 1))
