"""Hybrid strategies: enumerate dp x tp x pp strategies with micro-batching, schedule,
activation recomputation and ZeRO-1 (``hybrid_choices``), and price each one in closed
form, without an ILP (``Pricer``).

Pipeline position: called by ``planner.search`` for every candidate beyond the
single-device, plain data-parallel and plain GPipe ones (those keep their own
pricing in ``search``), and for a strategy fixed with ``--fix``. Reads the
per-layer numbers of a ``ModelProfile`` and prices them with ``planner.cost_model``.

Model of a strategy (device layout tp innermost, then dp, then pp, as Megatron-LM
lays out its groups: Narayanan et al., SC'21, Sec. 3):

- Tensor parallelism splits the *splittable* layers (Dense/EinsumDense column or
  row, attention by heads, Embedding by vocabulary: ``profiler.comm``) over tp
  devices: their FLOPs, weights, gradients, optimizer state and saved activations
  are divided by tp; every other layer is replicated. Split rule for this cut:
  consecutive Dense layers alternate column, row (the Megatron MLP pair), reset by
  any other splittable layer; attention by heads; Embedding by vocabulary (the
  per-layer ILP of ``planner.tp_ilp`` is to plug in here). Each split's Megatron
  f/g all-reduces (``profiler.comm.layer_comm``) run on the intra-node link.
- Pipeline stages: contiguous runs of the topological layer order that minimise
  the slowest stage's time per micro-batch (binary search on the bottleneck with a
  greedy fill, exact for contiguous min-max partitions of positive weights); the
  memory of the result is then checked, not optimised.
- Step = (m + pp - 1) x t_stage + exposed dp all-reduce + optimizer, for GPipe and
  1F1B alike (Narayanan et al., SC'21, Sec. 2.2.1); 1F1B holds min(pp - s, m)
  micro-batches of activations on stage s, GPipe all m.
- Recomputation: "selective" recomputes the attention layers' forward and keeps
  only their inputs (Korthikanti et al., 2022; our profile holds attention as one
  layer, so its projections are recomputed too: an overestimate of the cost);
  "full" keeps only each stage's input per micro-batch in flight and runs one
  extra forward, holding one micro-batch of the stage's activations while it
  recomputes (Chen et al., 2016, "Training deep nets with sublinear memory cost";
  Megatron-LM checkpoints every transformer block instead, which needs less
  working memory when a stage holds many blocks).
- ZeRO-1 (Rajbhandari et al., SC'20): optimizer state and its update divided by
  dp; reduce-scatter + all-gather instead of the all-reduce, the same bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from planner import cost_model as cm
from planner.cluster import ClusterSpec
from planner.plan import Breakdown, Plan, Prediction, Stage, Strategy
from profiler.comm import COLUMN_ROW_TYPES, HEAD_SPLIT_TYPES, VOCAB_SPLIT_TYPES, layer_comm

if TYPE_CHECKING:  # pragma: no cover
    from planner.search import _Context

KEEP_PER_SHAPE = 2  # hybrid candidates kept per (dp, tp, pp)
MAX_MICROBATCH_SIZE = 16  # micro-batch sizes tried: powers of two up to this


def divisors(n: int) -> list[int]:
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted(set(small) | {n // d for d in small})


@dataclass(frozen=True)
class Choice:
    """One point of the strategy space."""

    dp: int
    tp: int
    pp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str = "none"  # "none" (pp == 1), "gpipe", "1f1b"
    recompute: str = "none"  # "none", "selective", "full"
    optimizer_sharding: bool = False

    @property
    def name(self) -> str:
        parts = [f"dp={self.dp} tp={self.tp} pp={self.pp}", f"mbs={self.microbatch_size}",
                 f"m={self.num_microbatches}"]
        if self.pp > 1:
            parts.append(self.schedule)
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.optimizer_sharding:
            parts.append("zero1")
        return "hybrid " + " ".join(parts)


@dataclass(frozen=True)
class Estimate:
    """A priced Choice: cheap to make in bulk; ``to_plan`` builds the full Plan."""

    choice: Choice
    breakdown: Breakdown
    stage_bounds: tuple[tuple[int, int], ...]  # [start, stop) per stage in topological order
    stage_memory_bytes: tuple[int, ...]
    hardware_flops: float  # per step, whole cluster, recomputation included

    @property
    def step_time_s(self) -> float:
        return self.breakdown.total_s

    def fits(self, capacity: int) -> bool:
        return max(self.stage_memory_bytes) <= capacity


def tp_split_rule(types: tuple[str, ...]) -> tuple[str, ...]:
    """The split of each layer under tp > 1 ("" = replicated), by the simple rule above."""
    out, last_dense = [], "row"
    for t in types:
        if t in COLUMN_ROW_TYPES:
            last_dense = "column" if last_dense == "row" else "row"
            out.append(last_dense)
        elif t in HEAD_SPLIT_TYPES:
            out.append("heads")
            last_dense = "row"
        elif t in VOCAB_SPLIT_TYPES:
            out.append("vocab")
            last_dense = "row"
        else:
            out.append("")
    return tuple(out)


class Pricer:
    """Per-layer arrays for one search context, cached by (tp, micro-batch size)."""

    def __init__(self, ctx: "_Context") -> None:
        self.ctx = ctx
        p = ctx.profile
        self.layers = p.layers
        self.b = p.batch_size
        self.n = len(p.layers)
        self.rule_splits = tp_split_rule(tuple(l.type for l in p.layers))
        from profiler.comm import input_bytes_of
        self.comm = tuple(layer_comm(l, input_bytes_of(l, p)) for l in p.layers)
        self.attention = np.array([l.type in HEAD_SPLIT_TYPES for l in p.layers])
        self.input_bytes = np.array(ctx.input_bytes, dtype=float)
        self.cache: dict = {}

    def splits_for(self, tp: int) -> tuple[str, ...]:
        """Each layer's split at tensor-parallel degree ``tp`` ("" = replicated)."""
        if tp == 1:
            return ("",) * self.n
        return self.rule_splits

    def arrays(self, tp: int, mbs: int) -> dict[str, np.ndarray]:
        key = (tp, mbs)
        if key in self.cache:
            return self.cache[key]
        ctx, b = self.ctx, self.b
        device, precision, link = ctx.cluster.device, ctx.profile.precision, \
            ctx.cluster.intra_node_link
        f = mbs / b
        splits = self.splits_for(tp)
        fwd, bwd, tpf, tpb, state, opt, grad, act, inp, layer_in = ([] for _ in range(10))
        for i, l in enumerate(self.layers):
            split = splits[i]
            k = tp if split else 1
            fwd.append(cm.compute_time_s(l.flops_fwd * f / k, device, precision)
                       + cm.LAYER_OVERHEAD_S / 2)
            bwd.append(cm.compute_time_s(l.flops_bwd * f / k, device, precision)
                       + cm.LAYER_OVERHEAD_S / 2)
            s = next((x for x in self.comm[i].tp_splits if x.split == split), None)
            tpf.append(cm.ring_allreduce_time_s(s.fwd_allreduce_bytes * f, tp, link)
                       if s and s.fwd_allreduce_bytes else 0.0)
            tpb.append(cm.ring_allreduce_time_s(s.bwd_allreduce_bytes * f, tp, link)
                       if s and s.bwd_allreduce_bytes else 0.0)
            state.append((l.param_bytes + l.compute_weight_bytes + l.grad_bytes) / k)
            opt.append(l.optimizer_bytes / k)
            grad.append(l.grad_bytes / k)
            act.append(cm.saved_activation_bytes(l) * f / k + self.input_bytes[i] * f)
            layer_in.append((l.input_bytes or (self.layers[i - 1].activation_bytes if i else 0)
                             or self.input_bytes[i]) * f)
            # what a stage starting at layer i receives: the previous layer's output
            inp.append((self.layers[i - 1].activation_bytes if i else
                        max(self.input_bytes[0], l.input_bytes)) * f)
        arr = {k: np.array(v, dtype=float) for k, v in dict(
            fwd=fwd, bwd=bwd, tpf=tpf, tpb=tpb, state=state, opt=opt, grad=grad, act=act,
            inp=inp, layer_in=layer_in).items()}
        arr["param"] = np.array([l.param_bytes / (tp if splits[i] else 1)
                                 for i, l in enumerate(self.layers)], dtype=float)
        for name in ("fwd", "bwd", "tpf", "tpb", "state", "opt", "grad", "act", "param"):
            arr["sum_" + name] = np.concatenate([[0.0], np.cumsum(arr[name])])
        self.cache[key] = arr
        return arr

    def recompute_mask(self, recompute: str) -> np.ndarray:
        if recompute == "full":
            return np.ones(self.n, dtype=bool)
        if recompute == "selective":
            return self.attention
        return np.zeros(self.n, dtype=bool)

    def recomputed_flops(self, recompute: str) -> float:
        """Forward FLOPs recomputed per profile batch (whole model)."""
        key = ("rcflops", recompute)
        if key not in self.cache:
            rc = self.recompute_mask(recompute)
            self.cache[key] = float(sum(l.flops_fwd for l, r in zip(self.layers, rc) if r))
        return self.cache[key]

    def partition(self, tp: int, mbs: int, pp: int, recompute: str) -> tuple[tuple[int, int], ...]:
        key = ("part", tp, mbs, pp, recompute)
        if key not in self.cache:
            a = self.arrays(tp, mbs)
            rc = self.recompute_mask(recompute)
            w = a["fwd"] + a["bwd"] + a["tpf"] + a["tpb"] + rc * (a["fwd"] + a["tpf"])
            self.cache[key] = min_max_partition(tuple(w.tolist()), pp)
        return self.cache[key]

    def estimate(self, c: Choice) -> Estimate:
        ctx = self.ctx
        cluster, device = ctx.cluster, ctx.cluster.device
        a = self.arrays(c.tp, c.microbatch_size)
        rc = self.recompute_mask(c.recompute)
        bounds = self.partition(c.tp, c.microbatch_size, c.pp, c.recompute)
        stage_times, stage_parts, memories, grads, opt_s, overlap = [], [], [], [], [], []
        def total(name: str, lo: int, hi: int) -> float:  # sum over layers [lo, hi), O(1)
            prefix = a["sum_" + name]
            return float(prefix[hi] - prefix[lo])

        for s, (lo, hi) in enumerate(bounds):
            sl = slice(lo, hi)
            compute = total("fwd", lo, hi) + total("bwd", lo, hi)
            tpcomm = total("tpf", lo, hi) + total("tpb", lo, hi)
            if c.recompute == "full":
                recompute = total("fwd", lo, hi) + total("tpf", lo, hi)
            elif c.recompute == "selective":
                recompute = float(((a["fwd"][sl] + a["tpf"][sl]) * rc[sl]).sum())
            else:
                recompute = 0.0
            send = 0.0
            if s < c.pp - 1:
                link = _boundary_link(cluster, s, c.dp * c.tp)
                send = 2 * cm.p2p_time_s(float(self.layers[hi - 1].activation_bytes)
                                         * c.microbatch_size / self.b, link)
            stage_parts.append((compute, tpcomm + send, recompute))
            stage_times.append(compute + tpcomm + send + recompute)
            k = cm.microbatches_in_flight(c.schedule, c.pp - s, c.num_microbatches)
            if c.recompute == "full":  # the stage input kept; one micro-batch recomputed
                activations = k * float(a["inp"][lo]) + total("act", lo, hi)
            elif c.recompute == "selective":
                acts, att = a["act"][sl], rc[sl]
                kept = float((acts * ~att).sum() + (a["inp"][sl] * att).sum())
                activations = k * kept + float((acts * att).max(initial=0.0))
            else:
                activations = k * total("act", lo, hi)
            opt = total("opt", lo, hi) / (c.dp if c.optimizer_sharding else 1)
            memories.append(math.ceil(cm.with_margin_bytes(
                total("state", lo, hi) + opt + activations)))
            grads.append(total("grad", lo, hi))
            shard = c.dp if c.optimizer_sharding else 1
            opt_s.append(cm.optimizer_time_s(total("param", lo, hi) / shard, grads[-1] / shard,
                                             opt, device))
            overlap.append(total("bwd", lo + 1, hi) if hi > lo + 1 else 0.0)
        slow = int(np.argmax(stage_times))
        t_stage = stage_times[slow]
        compute, comm, recompute = stage_parts[slow]
        m = c.num_microbatches
        dp_s = max(cm.exposed_allreduce_s(self._dp_allreduce_s(g, c), ov)
                   for g, ov in zip(grads, overlap))
        breakdown = Breakdown(compute_s=m * compute, communication_s=m * comm + dp_s,
                              bubble_s=(c.pp - 1) * t_stage, recompute_s=m * recompute,
                              optimizer_s=max(opt_s))
        p = ctx.profile
        hw = (p.flops_fwd + p.flops_bwd + self.recomputed_flops(c.recompute)) / self.b \
            * ctx.global_batch
        return Estimate(c, breakdown, bounds, tuple(memories), hw)

    def _dp_allreduce_s(self, nbytes: float, c: Choice) -> float:
        """Gradient all-reduce over the dp group (stride tp): hierarchical when it spans
        nodes. ZeRO-1's reduce-scatter + all-gather moves the same bytes (SC'20 Sec. 7)."""
        cluster = self.ctx.cluster
        if c.dp == 1:
            return 0.0
        if c.dp * c.tp <= cluster.devices_per_node or cluster.inter_node_link is None:
            return cm.ring_allreduce_time_s(nbytes, c.dp, cluster.intra_node_link)
        per_node = max(1, cluster.devices_per_node // c.tp)
        return cm.hierarchical_allreduce_time_s(nbytes, per_node, c.dp // per_node,
                                                cluster.intra_node_link,
                                                cluster.inter_node_link)

    def to_plan(self, e: Estimate) -> Plan:
        ctx, c = self.ctx, e.choice
        names = ctx.names
        devices = ctx.cluster.device_names()
        group = c.dp * c.tp
        stages = tuple(Stage(layers=names[lo:hi], devices=devices[s * group:(s + 1) * group])
                       for s, (lo, hi) in enumerate(e.stage_bounds))
        memory = tuple((d, e.stage_memory_bytes[s]) for s, st in enumerate(stages)
                       for d in st.devices)
        step = e.step_time_s
        p = ctx.profile
        n_dev = c.dp * c.tp * c.pp
        return Plan(
            name=c.name, model_name=p.model_name, model_fingerprint=p.fingerprint,
            model_signature=p.signature(), cluster=ctx.cluster, global_batch=ctx.global_batch,
            precision=p.precision, optimizer=p.optimizer,
            strategy=Strategy(dp=c.dp, tp=c.tp, pp=c.pp, microbatch_size=c.microbatch_size,
                              num_microbatches=c.num_microbatches, schedule=c.schedule,
                              recompute=c.recompute,
                              optimizer_sharding=c.optimizer_sharding),
            stages=stages,
            predicted=Prediction(
                step_time_s=step, breakdown=e.breakdown, peak_memory_bytes_per_device=memory,
                memory_capacity_bytes=ctx.cluster.device.memory_bytes,
                samples_per_s=ctx.global_batch / step,
                model_tflops_per_device=cm.model_tflops_per_device(
                    (p.flops_fwd + p.flops_bwd) / p.batch_size, ctx.global_batch, step, n_dev),
                hardware_tflops_per_device=cm.hardware_tflops_per_device(
                    e.hardware_flops, step, n_dev)),
            solver="closed form (tp split rule; stages by min-max bisection over the "
                   "topological order)")


def _boundary_link(cluster: ClusterSpec, stage: int, group: int):
    """Link between stage ``stage`` and ``stage + 1`` (each ``group`` devices, node-major)."""
    a, b = stage * group, (stage + 1) * group
    same = a // cluster.devices_per_node == b // cluster.devices_per_node
    return cluster.intra_node_link if same or cluster.inter_node_link is None \
        else cluster.inter_node_link


@lru_cache(maxsize=4096)
def min_max_partition(weights: tuple[float, ...], parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``weights`` into ``parts`` non-empty contiguous runs minimising the largest sum.

    Bisection on the bottleneck T with a greedy fill that leaves at least one item
    per remaining part (feasible iff some partition has max <= T, weights >= 0).
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} parts of {n} items; expected 1 <= parts <= items")
    prefix = np.concatenate([[0.0], np.cumsum(weights)])

    def fill(t: float):
        bounds, lo = [], 0
        for s in range(parts):
            last = n - (parts - s - 1)
            if s == parts - 1:
                hi = n
            else:
                hi = int(np.searchsorted(prefix, prefix[lo] + t, side="right")) - 1
                hi = max(lo + 1, min(hi, last - 0))
                hi = min(hi, n - (parts - s - 1))
            if prefix[hi] - prefix[lo] > t * (1 + 1e-12) + 1e-18:
                return None
            bounds.append((lo, hi))
            lo = hi
        return tuple(bounds)

    lo_t, hi_t = max(weights), float(prefix[-1])
    best = fill(hi_t) if parts == 1 else None
    for _ in range(60):
        if best is not None and hi_t - lo_t <= 1e-9 * hi_t:
            break
        mid = (lo_t + hi_t) / 2
        got = fill(mid)
        if got is None:
            lo_t = mid
        else:
            best, hi_t = got, mid
    if best is None:
        best = fill(hi_t) or fill(float(prefix[-1]) * 1.000001)
    return best


# --- the hybrid strategy space --------------------------------------------------------------

def hybrid_choices(ctx: "_Context", knobs: Mapping[str, Any], *, skip_classic: bool,
                    shape: tuple[int, int, int] | None = None) -> list[Choice]:
    """Every dp x tp x pp factorization of the devices (tp a divisor of devices_per_node,
    pp <= layers, dp | global batch) x micro-batch size x schedule x recompute x ZeRO-1,
    restricted by ``knobs``; ``shape`` fixes (dp, tp, pp) (then it need not use every
    device). ``skip_classic`` leaves out what the classic candidates already price."""
    cluster, b, layers = ctx.cluster, ctx.global_batch, len(ctx.names)
    n, per_node = cluster.num_devices, cluster.devices_per_node
    if shape is not None:
        shapes = [shape]
    else:
        shapes = [(n // (tp * pp), tp, pp) for tp in divisors(per_node)
                  for pp in divisors(n // tp) if pp <= layers]
    has_attention = any(l.type in HEAD_SPLIT_TYPES for l in ctx.profile.layers)
    out = []
    for dp, tp, pp in shapes:
        if b % dp:
            continue
        local = b // dp
        if pp == 1:
            sizes = [local]
        else:
            sizes = [2**k for k in range(MAX_MICROBATCH_SIZE.bit_length())
                     if 2**k <= MAX_MICROBATCH_SIZE and local % 2**k == 0]
        if "microbatch_size" in knobs:
            sizes = [knobs["microbatch_size"]]
        for mbs in sizes:
            if local % mbs:
                continue
            m = local // mbs
            if pp == 1 and m != 1:
                continue
            schedules = ("none",) if pp == 1 else ("1f1b", "gpipe")
            if "schedule" in knobs and pp > 1:
                schedules = (knobs["schedule"],)
            for schedule in schedules:
                for rc in ((knobs["recompute"],) if "recompute" in knobs
                           else ("none", "selective", "full") if has_attention
                           else ("none", "full")):
                    for zero in ((knobs["optimizer_sharding"],) if "optimizer_sharding" in knobs
                                 else ((False, True) if dp > 1 else (False,))):
                        classic = tp == 1 and rc == "none" and not zero and (
                            pp == 1 or (dp == 1 and schedule == "gpipe"))
                        if skip_classic and classic:
                            continue
                        out.append(Choice(dp, tp, pp, mbs, m, schedule, rc, bool(zero)))
    return out


def best_per_shape(estimates: list[Estimate], capacity: int) -> list[Estimate]:
    """The KEEP_PER_SHAPE fastest that fit for each (dp, tp, pp), else its least-memory one."""
    groups: dict[tuple[int, int, int], list[Estimate]] = {}
    for e in estimates:
        groups.setdefault((e.choice.dp, e.choice.tp, e.choice.pp), []).append(e)
    kept = []
    for key in sorted(groups):
        group = groups[key]
        fit = sorted((e for e in group if e.fits(capacity)),
                     key=lambda e: (e.step_time_s, e.choice.name))
        kept += fit[:KEEP_PER_SHAPE] or [min(group, key=lambda e: (max(e.stage_memory_bytes),
                                                                    e.choice.name))]
    return kept
