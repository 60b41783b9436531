"""Hybrid strategies: enumerate dp x tp x pp strategies with micro-batching, schedule,
activation recomputation and ZeRO-1 (``hybrid_choices``), and price each one in closed
form, without an ILP (``Pricer``).

Pipeline position: called by ``planner.search`` for every candidate beyond the
single-device, plain data-parallel and plain GPipe ones (those keep their own
pricing in ``search``), and for a strategy fixed with ``--fix``. Reads the
per-layer numbers of a ``ModelProfile`` and prices them with ``planner.cost_model``.

Model of a strategy (device layout ``Choice.layout``, innermost first: "tp-dp-pp",
Megatron-LM's, or "tp-pp-dp", "dp-outer"; see "Device layouts" below):

- Tensor parallelism splits the *splittable* layers (Dense/EinsumDense/Conv1-3D column or
  row, attention by heads, Embedding by vocabulary: ``profiler.comm``) over tp
  devices: their FLOPs, weights, gradients, optimizer state and saved activations
  are divided by tp; every other layer is replicated. Which layers split, and how,
  is the Alpa intra-operator ILP's answer at each tp (``planner.tp_splits``,
  ``Pricer.splits_for``), priced with this module's own per-layer times; a tp at
  which no layer is worth splitting is not offered. Each split's Megatron f/g
  all-reduces (``profiler.comm.layer_comm``) run on the intra-node link.
- Pipeline stages: pp x v contiguous runs of the topological layer order (v model
  chunks per device: 1, or 2-4 under the interleaved schedule), run k on pipeline
  device k % pp, balancing the devices' work per micro-batch (min-max bisection,
  exact for v = 1; for v > 1 also an even split, whichever leaves the busiest device
  less); the memory of the result is then checked, not optimised. A chunk's output
  crosses to the next device scattered over the tp ranks and gathered there
  (``cost_model.pipeline_send_time_s``).
- Step = m x t_stage + (pp - 1)/v x t_stage + exposed dp all-reduce + optimizer
  (GPipe and 1F1B: v = 1; interleaved 1F1B: v > 1, m a multiple of pp; Narayanan et
  al., SC'21, Sec. 2.2); 1F1B holds min(pp - s, m) micro-batches of activations on
  stage s, interleaved that times 1 + (pp-1)/(pp v), GPipe all m. With pp = 1 and
  m > 1 the micro-batches are gradient accumulation: one micro-batch's activations
  at a time.
- Devices that share cores (logical CPUs: ``ClusterSpec.devices_per_compute_pool``)
  wait for each other: ``cost_model.with_shared_cores``.
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

Device layouts (``planner.plan.stage_devices``; devices node-major, d devices per node):

- "tp-dp-pp" (Megatron-LM's order): stage s, replica r, tensor rank t on device
  s dp tp + r tp + t. The dp group of a stage has stride tp: a ring inside a node
  when dp tp <= d, else hierarchical with d / tp members per node. The pipeline is
  outermost, so a stage boundary crosses nodes when its two stages' groups are on
  different nodes. Megatron-LM chooses this because a boundary moves only one
  micro-batch's activations point to point, 2 m A / tp bytes per rank per step
  (A: boundary activation bytes per micro-batch; forward and back), while the
  all-reduce moves every gradient of the stage, 2 (n-1)/n G bytes per device
  (Narayanan et al., SC'21, Sec. 3, takeaways #1 and #2: tensor parallelism inside a
  node, pipeline parallelism to scale across nodes, data parallelism on top).
- "tp-pp-dp" ("dp-outer", dp outermost): device r tp pp + s tp + t, replica r's whole
  pipeline on devices [r tp pp, (r+1) tp pp). When tp pp divides d every replica is
  inside one node, every pipeline send stays on the intra-node link, and the
  alternative's price is paid by the all-reduce instead: its group has stride tp pp,
  k = d / (tp pp) members per node, so across nodes it is hierarchical,
  t = RS_intra(G, k) + AR_inter(G / k, dp / k) + AG_intra(G, k)
  (``cost_model.hierarchical_allreduce_time_s``; k = 1: a plain ring over the
  inter-node link), G = a pipeline device's gradient bytes; a dp that is not a
  multiple of k, or tp pp > d, rings over the inter-node link. This is the layout
  a multi-worker hybrid in ``apply`` needs (each replica inside one worker: dp
  across workers with MultiWorkerMirroredStrategy, the pipeline and tp inside).
  The search offers it next to Megatron's where the two differ and it keeps every
  replica in a node (``dp_outer_differs``).
"""
from __future__ import annotations

import bisect
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from tfplan.planner import cost_model as cm
from tfplan.core.cluster import ClusterSpec
from tfplan.planner.plan import (DEFAULT_LAYOUT, Breakdown, Plan, Prediction, Stage, Strategy,
                          stage_devices)
from tfplan.profiler.comm import COLUMN_ROW_TYPES, HEAD_SPLIT_TYPES, VOCAB_SPLIT_TYPES, layer_comm

if TYPE_CHECKING:  # pragma: no cover
    from tfplan.planner.search import _Context

KEEP_PER_SHAPE = 2  # hybrid candidates kept per (dp, tp, pp)
MAX_MICROBATCH_SIZE = 16  # micro-batch sizes tried: powers of two up to this
PARTITION_MICROBATCH = 8  # samples per micro-batch at which stages are balanced
INTERLEAVE_CHOICES = (2, 3, 4)  # model chunks per device tried for the interleaved schedule


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
    schedule: str = "none"  # "none" (pp == 1), "gpipe", "1f1b", "interleaved"
    recompute: str = "none"  # "none", "selective", "full"
    optimizer_sharding: bool = False
    virtual_stages: int = 1  # model chunks per pipeline device ("interleaved": > 1)
    layout: str = DEFAULT_LAYOUT  # planner.plan.LAYOUTS; "tp-pp-dp" shows as "dp-outer"

    @property
    def name(self) -> str:
        parts = [f"dp={self.dp} tp={self.tp} pp={self.pp}", f"mbs={self.microbatch_size}",
                 f"m={self.num_microbatches}"]
        if self.pp > 1:
            parts.append(self.schedule + (f" v={self.virtual_stages}"
                                          if self.virtual_stages > 1 else ""))
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.optimizer_sharding:
            parts.append("zero1")
        if self.layout == "tp-pp-dp":
            parts.append("dp-outer")
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

    def __init__(self, ctx: "_Context", tp_time_limit_s: float = 5.0) -> None:
        self.ctx = ctx
        self.tp_time_limit_s = tp_time_limit_s  # per tensor-parallel ILP (planner.tp_splits)
        self.split_choices: dict = {}  # tp -> planner.tp_splits.SplitChoice
        p = ctx.profile
        self.layers = p.layers
        self.b = p.batch_size
        self.n = len(p.layers)
        from tfplan.profiler.comm import input_bytes_of
        self.comm = tuple(layer_comm(l, input_bytes_of(l, p)) for l in p.layers)
        self.attention = np.array([l.type in HEAD_SPLIT_TYPES for l in p.layers])
        self.input_bytes = np.array(ctx.input_bytes, dtype=float)
        self.cache: dict = {}
        self.total_flops = float(p.flops_fwd + p.flops_bwd)

    def splits_for(self, tp: int) -> tuple[str, ...]:
        """Each layer's split at tensor-parallel degree ``tp`` ("" = replicated): the
        tensor-parallel ILP's (``planner.tp_splits``), priced with this Pricer's own
        replicated per-layer forward + backward times (``arrays(1, samples)``) and its
        own data-parallel gradient all-reduce (``_dp_allreduce_s``, dp = devices / tp);
        cached per tp."""
        if tp == 1:
            return ("",) * self.n
        if tp not in self.split_choices:
            from tfplan.planner.tp_splits import reference_samples, solve_splits
            ctx = self.ctx

            def replicated_time_s(samples: int) -> np.ndarray:
                a = self.arrays(1, samples)
                return a["fwd"] + a["bwd"]

            samples = reference_samples(ctx.global_batch, ctx.cluster.num_devices, tp)
            data_parallel = Choice(max(1, ctx.cluster.num_devices // tp), tp, 1, samples, 1)
            self.split_choices[tp] = solve_splits(
                ctx.profile, ctx.cluster, tp, layer_time_s=replicated_time_s, samples=samples,
                time_limit_s=self.tp_time_limit_s,
                grad_allreduce_s=lambda nbytes: self._dp_allreduce_s(nbytes, data_parallel))
        return self.split_choices[tp].splits

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
            t_fwd, t_bwd = cm.layer_fwd_bwd_time_s(l, mbs, b, device, precision, k,
                                                   ctx.profile.measured_batch_size)
            fwd.append(t_fwd)
            bwd.append(t_bwd)
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

    def partition(self, tp: int, mbs: int, pp: int, recompute: str,
                  virtual_stages: int = 1) -> tuple[tuple[int, int], ...]:
        """pp x v contiguous runs of the layer order, run k on pipeline device k % pp,
        balancing the devices' work per micro-batch: the min-max split (exact for v = 1)
        or, for v > 1, the even split when its busiest device has less work.

        The balance is struck once per (tp, pp, recompute, v) on the layers' work at a
        reference micro-batch of PARTITION_MICROBATCH samples, not per micro-batch size:
        a layer's time is linear in the samples plus a small fixed overhead, so the
        split that balances one size balances the others (and the search's cost stays
        flat as micro-batch sizes are added)."""
        key = ("part", tp, pp, recompute, virtual_stages)
        if key not in self.cache:
            a = self.arrays(tp, PARTITION_MICROBATCH)
            rc = self.recompute_mask(recompute)
            w = a["fwd"] + a["bwd"] + a["tpf"] + a["tpb"] + rc * (a["fwd"] + a["tpf"])
            parts = pp * virtual_stages
            options = [min_max_partition(tuple(w.tolist()), parts)]
            if virtual_stages > 1:
                options.append(even_partition(tuple(w.tolist()), parts))
            self.cache[key] = min(options, key=lambda b: max(device_loads(w, b, pp)))
        return self.cache[key]

    def devices(self, tp: int, mbs: int, pp: int, recompute: str, v: int, dp: int,
                layout: str = DEFAULT_LAYOUT) -> dict[str, np.ndarray]:
        """Per pipeline device, per micro-batch: the sums over its chunks of every
        per-layer number ``estimate`` needs (numpy, one entry per device), cached by
        everything they depend on; ``estimate`` then only applies the schedule, the
        micro-batch count and ZeRO-1. Only the boundary sends ("send") depend on dp and
        the layout: the rest is computed once per (tp, mbs, pp, recompute, v)."""
        key = ("dev", tp, mbs, pp, recompute, v, dp, layout)
        if key in self.cache:
            return self.cache[key]
        base = self._chunk_sums(tp, mbs, pp, recompute, v)
        cluster = self.ctx.cluster
        send = np.zeros(pp * v)
        for k, nbytes in enumerate(base["boundary_bytes"]):
            if nbytes:
                s = k % pp
                link = _stage_link(cluster, layout, dp, tp, pp, s, (s + 1) % pp)
                send[k] = 2 * cm.pipeline_send_time_s(nbytes, tp, link, cluster.intra_node_link)
        d = dict(base)
        d["send"] = send.reshape(v, pp).sum(axis=0)  # chunk k on device k % pp
        self.cache[key] = d
        return d

    def _chunk_sums(self, tp: int, mbs: int, pp: int, recompute: str, v: int
                    ) -> dict[str, np.ndarray]:
        """``devices`` without the sends, plus each chunk's boundary bytes per micro-batch
        (0 for the last chunk); cached."""
        key = ("sums", tp, mbs, pp, recompute, v)
        if key in self.cache:
            return self.cache[key]
        a = self.arrays(tp, mbs)
        rc = self.recompute_mask(recompute)
        bounds = self.partition(tp, mbs, pp, recompute, v)
        lo = np.array([b[0] for b in bounds])
        hi = np.array([b[1] for b in bounds])

        def per_device(chunk_values: np.ndarray, how=np.sum) -> np.ndarray:
            return how(chunk_values.reshape(v, pp), axis=0)  # chunk k on device k % pp

        def chunk_sums(name: str) -> np.ndarray:
            prefix = a["sum_" + name]
            return prefix[hi] - prefix[lo]

        sums = {name: chunk_sums(name) for name in (
            "fwd", "bwd", "tpf", "tpb", "state", "opt", "grad", "act", "param")}
        d = {name: per_device(values) for name, values in sums.items()}
        if recompute == "full":
            d["recompute"] = d["fwd"] + d["tpf"]
        elif recompute == "selective":
            d["recompute"] = per_device(np.add.reduceat((a["fwd"] + a["tpf"]) * rc, lo))
        else:
            d["recompute"] = np.zeros(pp)
        # activations held per micro-batch in flight, and the working set on top
        if recompute == "full":  # chunk inputs kept; one chunk recomputed at a time
            d["kept"] = per_device(a["inp"][lo])
            d["working"] = per_device(sums["act"], np.max)
        elif recompute == "selective":
            kept = a["act"] * ~rc + a["inp"] * rc
            d["kept"] = per_device(np.add.reduceat(kept, lo))
            d["working"] = per_device(np.maximum.reduceat(a["act"] * rc, lo), np.max)
        else:
            d["kept"], d["working"] = d["act"], np.zeros(pp)
        # boundary transfers (``devices``): each chunk's output forward, its gradient back
        d["boundary_bytes"] = tuple(float(self.layers[end - 1].activation_bytes) * mbs / self.b
                                    if end < self.n else 0.0 for end in hi)
        # all but the first layer's backward hides the gradient all-reduce
        d["overlap"] = d["bwd"] - a["bwd"][lo[:pp]]
        d["bounds"] = bounds
        self.cache[key] = d
        return d

    def estimate(self, c: Choice) -> Estimate:
        ctx = self.ctx
        v, pp, m = c.virtual_stages, c.pp, c.num_microbatches
        d = self.devices(c.tp, c.microbatch_size, pp, c.recompute, v, c.dp, c.layout)
        compute = d["fwd"] + d["bwd"]
        comm = d["tpf"] + d["tpb"] + d["send"]
        stage_times = compute + comm + d["recompute"]
        k = np.array([cm.microbatches_in_flight(c.schedule, pp - s, m, v) for s in range(pp)])
        shard = c.dp if c.optimizer_sharding else 1
        opt = d["opt"] / shard
        memories = np.ceil(cm.with_margin_bytes(d["state"] + opt + k * d["kept"]
                                                + d["working"]))
        opt_s = cm.optimizer_time_s(d["param"] / shard, d["grad"] / shard, opt,
                                    ctx.cluster.device)
        slow = int(np.argmax(stage_times))
        t_stage = float(stage_times[slow])
        dp_s = float(np.max(np.maximum(0.0, self._dp_allreduce_s(d["grad"], c) - d["overlap"])))
        breakdown = Breakdown(compute_s=m * float(compute[slow]),
                              communication_s=m * float(comm[slow]) + dp_s,
                              bubble_s=cm.pipeline_bubble_s(pp, t_stage, v),
                              recompute_s=m * float(d["recompute"][slow]),
                              optimizer_s=float(np.max(opt_s)))
        if ctx.cluster.devices_per_compute_pool > 1:  # else with_shared_cores changes nothing
            busy = m * (compute + d["recompute"]) + opt_s  # per pipeline device
            # in device order: stage-major (tp-dp-pp) or replica-major (tp-pp-dp)
            in_order = np.repeat(busy, c.dp * c.tp) if c.layout != "tp-pp-dp" \
                else np.tile(np.repeat(busy, c.tp), c.dp)
            breakdown = cm.with_shared_cores(breakdown, in_order.tolist(), ctx.cluster)
        breakdown = cm.with_step_overhead(breakdown, ctx.profile.measured_step_overhead_s)
        p = ctx.profile
        hw = (self.total_flops + self.recomputed_flops(c.recompute)) / self.b * ctx.global_batch
        bounds = d["bounds"]
        # memory per stage of the plan: each chunk reports its device's peak
        return Estimate(c, breakdown, bounds, tuple(int(memories[k % pp])
                                                    for k in range(len(bounds))), hw)

    def _dp_allreduce_s(self, nbytes: float, c: Choice) -> float:
        """Gradient all-reduce over the dp group (stride tp; dp-outer: stride tp pp):
        hierarchical when it spans nodes (module docstring, "Device layouts"). ZeRO-1's
        reduce-scatter + all-gather moves the same bytes (SC'20 Sec. 7)."""
        cluster = self.ctx.cluster
        if c.dp == 1:
            return 0.0
        if c.layout == "tp-pp-dp":
            return _dp_outer_allreduce_s(cluster, nbytes, c.dp, c.tp * c.pp)
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
        stages = tuple(Stage(layers=names[lo:hi],
                             devices=stage_devices(devices, c.layout, c.dp, c.tp, c.pp,
                                                   k % c.pp))
                       for k, (lo, hi) in enumerate(e.stage_bounds))
        memory = tuple((d, e.stage_memory_bytes[s]) for s, st in enumerate(stages[:c.pp])
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
                              optimizer_sharding=c.optimizer_sharding,
                              virtual_stages=c.virtual_stages, layout=c.layout),
            stages=stages,
            predicted=Prediction(
                step_time_s=step, breakdown=e.breakdown, peak_memory_bytes_per_device=memory,
                memory_capacity_bytes=ctx.cluster.device.memory_bytes,
                samples_per_s=ctx.global_batch / step,
                model_tflops_per_device=cm.model_tflops_per_device(
                    (p.flops_fwd + p.flops_bwd) / p.batch_size, ctx.global_batch, step, n_dev),
                hardware_tflops_per_device=cm.hardware_tflops_per_device(
                    e.hardware_flops, step, n_dev)),
            solver=f"closed form ({self._split_solver(c.tp)}; stages by min-max bisection "
                   "over the topological order)",
            tp_splits=tuple((name, split) for name, split in zip(names, self.splits_for(c.tp))
                            if split))

    def _split_solver(self, tp: int) -> str:
        """How the splits at ``tp`` were chosen, for Plan.solver."""
        self.splits_for(tp)
        return self.split_choices[tp].solver if tp in self.split_choices \
            else "no tensor parallelism"


def _link_between(cluster: ClusterSpec, a: int, b: int, group: int):
    """Point-to-point link between pipeline devices ``a`` and ``b`` (groups of ``group``
    devices, node-major): inside a node or across nodes."""
    same = a * group // cluster.devices_per_node == b * group // cluster.devices_per_node
    return cluster.p2p_link(same_node=same)


def _stage_link(cluster: ClusterSpec, layout: str, dp: int, tp: int, pp: int, a: int, b: int):
    """Point-to-point link from pipeline stage ``a`` to stage ``b`` under ``layout``.
    tp-dp-pp: stage groups of dp tp devices (``_link_between``, as before layouts).
    tp-pp-dp: replica r's stage s starts at r tp pp + s tp; the slowest link over the
    replicas (inside a node for all of them when tp pp divides devices_per_node)."""
    if layout != "tp-pp-dp":
        return _link_between(cluster, a, b, dp * tp)
    per_node = cluster.devices_per_node
    same = all((r * tp * pp + a * tp) // per_node == (r * tp * pp + b * tp) // per_node
               for r in range(dp))
    return cluster.p2p_link(same_node=same)


def _dp_outer_allreduce_s(cluster: ClusterSpec, nbytes: float, dp: int, stride: int) -> float:
    """All-reduce of ``nbytes`` over ``dp`` devices ``stride`` = tp pp apart (dp-outer):
    k = devices_per_node // stride of them per node. All in one node (dp <= k): a ring
    on the intra-node link; dp a multiple of k: hierarchical over dp / k nodes
    (``cost_model.hierarchical_allreduce_time_s``; k = 1 leaves the inter-node ring);
    otherwise a ring on the inter-node link."""
    k = cluster.devices_per_node // stride
    if cluster.inter_node_link is None or dp <= k:
        return cm.ring_allreduce_time_s(nbytes, dp, cluster.intra_node_link)
    if k >= 1 and dp % k == 0:
        return cm.hierarchical_allreduce_time_s(nbytes, k, dp // k, cluster.intra_node_link,
                                                cluster.inter_node_link)
    return cm.ring_allreduce_time_s(nbytes, dp, cluster.inter_node_link)


def dp_outer_differs(cluster: ClusterSpec, dp: int, tp: int, pp: int) -> bool:
    """Whether the search also prices ``dp, tp, pp`` with the dp-outer layout (tp-pp-dp).

    The two layouts put stage s, replica r, rank t on s dp tp + r tp + t and on
    r tp pp + s tp + t: the same device for every (s, r, t) exactly when dp == 1 or
    pp == 1 (tp only scales both). When all dp tp pp devices lie in one node (the
    grid starts at device 0, so dp tp pp <= devices_per_node) every link is the
    intra-node one and the two are priced alike. Otherwise the grid spans nodes and
    they differ (Megatron's order sends across nodes or all-reduces with more members
    per node; dp-outer all-reduces across nodes). It is offered only when tp pp
    divides devices_per_node, so that every replica sits inside one node, which is
    what the layout is for."""
    per_node = cluster.devices_per_node
    return dp > 1 and pp > 1 and dp * tp * pp > per_node and per_node % (tp * pp) == 0


@lru_cache(maxsize=4096)
def min_max_partition(weights: tuple[float, ...], parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``weights`` into ``parts`` non-empty contiguous runs minimising the largest sum.

    Bisection on the bottleneck T with a greedy fill that leaves at least one item
    per remaining part (feasible iff some partition has max <= T, weights >= 0), to a
    relative precision of 1e-7 (``bisect`` on a Python list: the fill is the search's
    inner loop).
    """
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} parts of {n} items; expected 1 <= parts <= items")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def fill(t: float):
        bounds, lo = [], 0
        slack = t * (1 + 1e-12) + 1e-18
        for s in range(parts):
            if s == parts - 1:
                hi = n
            else:
                hi = bisect.bisect_right(prefix, prefix[lo] + t) - 1
                hi = min(max(lo + 1, hi), n - (parts - s - 1))
            if prefix[hi] - prefix[lo] > slack:
                return None
            bounds.append((lo, hi))
            lo = hi
        return tuple(bounds)

    lo_t, hi_t = max(weights), prefix[-1]
    best = fill(hi_t) if parts == 1 else None
    for _ in range(60):
        if best is not None and hi_t - lo_t <= 1e-7 * hi_t:
            break
        mid = (lo_t + hi_t) / 2
        got = fill(mid)
        if got is None:
            lo_t = mid
        else:
            best, hi_t = got, mid
    if best is None:
        best = fill(hi_t) or fill(prefix[-1] * 1.000001)
    return best


def even_partition(weights: tuple[float, ...], parts: int) -> tuple[tuple[int, int], ...]:
    """Split ``weights`` into ``parts`` non-empty contiguous runs whose sums are each as
    close as the item boundaries allow to total / parts: cut k at the prefix sum nearest
    k x total / parts. Unlike the min-max split (which packs the early runs full and can
    leave the last ones nearly empty), every run gets about the same work -- what an
    interleaved pipeline needs, where a device's load is the sum of v runs."""
    n = len(weights)
    if not 1 <= parts <= n:
        raise ValueError(f"{parts} parts of {n} items; expected 1 <= parts <= items")
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    cuts, lo = [0], 0
    for k in range(1, parts):
        target = prefix[-1] * k / parts
        i = int(np.searchsorted(prefix, target))
        if i > 0 and abs(prefix[i - 1] - target) <= abs(prefix[min(i, n)] - target):
            i -= 1
        i = min(max(i, lo + 1), n - (parts - k))  # non-empty runs on both sides
        cuts.append(i)
        lo = i
    cuts.append(n)
    return tuple((cuts[k], cuts[k + 1]) for k in range(parts))


def device_loads(weights: np.ndarray, bounds: tuple[tuple[int, int], ...], pp: int) -> list[float]:
    """Work of each of ``pp`` pipeline devices when run k of ``bounds`` is on device k % pp."""
    prefix = np.concatenate([[0.0], np.cumsum(weights)])
    loads = [0.0] * pp
    for k, (lo, hi) in enumerate(bounds):
        loads[k % pp] += float(prefix[hi] - prefix[lo])
    return loads


# --- the hybrid strategy space --------------------------------------------------------------

def hybrid_choices(ctx: "_Context", knobs: Mapping[str, Any], *, skip_classic: bool,
                    shape: tuple[int, int, int] | None = None) -> list[Choice]:
    """Every dp x tp x pp factorization of the devices (tp a divisor of devices_per_node,
    pp <= layers, dp | global batch) x layout x micro-batch size x schedule x recompute x
    ZeRO-1, restricted by ``knobs``; ``shape`` fixes (dp, tp, pp) (then it need not use
    every device). ``skip_classic`` leaves out what the classic candidates already price.

    Layout: Megatron's tp-dp-pp, and also dp-outer tp-pp-dp where ``dp_outer_differs``.
    ``knobs["layout"]`` fixes it for every shape where the two put devices differently
    (dp > 1 and pp > 1); elsewhere they are the same plan, named tp-dp-pp."""
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
        # pp == 1: the whole local batch at once, or gradient accumulation over
        # micro-batches of up to MAX_MICROBATCH_SIZE samples (less activation memory)
        sizes = sorted({2**k for k in range(MAX_MICROBATCH_SIZE.bit_length())
                        if 2**k <= MAX_MICROBATCH_SIZE and local % 2**k == 0}
                       | ({local} if pp == 1 else set()))
        if "microbatch_size" in knobs:
            sizes = [knobs["microbatch_size"]]
        if dp > 1 and pp > 1 and "layout" in knobs:
            layouts: tuple[str, ...] = (knobs["layout"],)
        else:
            layouts = (DEFAULT_LAYOUT,) + (("tp-pp-dp",) if "layout" not in knobs and
                                           dp_outer_differs(cluster, dp, tp, pp) else ())
        for mbs in sizes:
            if local % mbs:
                continue
            m = local // mbs
            schedules = ("none",) if pp == 1 else ("1f1b", "gpipe", "interleaved")
            if "schedule" in knobs and pp > 1:
                schedules = (knobs["schedule"],)
            for schedule, v in _with_virtual_stages(schedules, knobs, pp, m, layers):
                for rc in ((knobs["recompute"],) if "recompute" in knobs
                           else ("none", "selective", "full") if has_attention
                           else ("none", "full")):
                    for zero in ((knobs["optimizer_sharding"],) if "optimizer_sharding" in knobs
                                 else ((False, True) if dp > 1 else (False,))):
                        classic = tp == 1 and rc == "none" and not zero and (
                            (pp == 1 and m == 1) or (dp == 1 and schedule == "gpipe"))
                        if skip_classic and classic:
                            continue
                        out += [Choice(dp, tp, pp, mbs, m, schedule, rc, bool(zero), v, layout)
                                for layout in layouts]
    return out


def _with_virtual_stages(schedules: tuple[str, ...], knobs: Mapping[str, Any], pp: int,
                         m: int, layers: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) pairs: v = 1 for GPipe and 1F1B; for the interleaved
    schedule v in INTERLEAVE_CHOICES (or the fixed ``virtual_stages``), where Megatron-LM
    allows it: m a multiple of pp (Narayanan et al., SC'21, Sec. 2.2.2) and at least two
    layers per chunk."""
    out = []
    for schedule in schedules:
        if schedule != "interleaved":
            out.append((schedule, 1))
            continue
        vs = (knobs["virtual_stages"],) if "virtual_stages" in knobs else INTERLEAVE_CHOICES
        out += [(schedule, v) for v in vs
                if v > 1 and m % pp == 0 and 2 * pp * v <= layers]
    return out


def best_per_shape(estimates: list[Estimate], capacity: int) -> list[Estimate]:
    """The KEEP_PER_SHAPE fastest that fit for each (dp, tp, pp, layout), else its
    least-memory one."""
    groups: dict[tuple[int, int, int, str], list[Estimate]] = {}
    for e in estimates:
        groups.setdefault((e.choice.dp, e.choice.tp, e.choice.pp, e.choice.layout),
                          []).append(e)
    kept = []
    for key in sorted(groups):
        group = groups[key]
        fit = sorted((e for e in group if e.fits(capacity)),
                     key=lambda e: (e.step_time_s, e.choice.name))
        kept += fit[:KEEP_PER_SHAPE] or [min(group, key=lambda e: (max(e.stage_memory_bytes),
                                                                    e.choice.name))]
    return kept
