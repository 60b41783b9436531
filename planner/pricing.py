"""Pricing a hybrid strategy in closed form, without an ILP: ``Pricer`` and ``Estimate``.

Pipeline position: ``planner.search`` hands every ``planner.candidates.Choice`` (and a
strategy fixed with ``--fix``) to ``Pricer.estimate``, keeps the best per shape
(``best_per_shape``) and turns those into ``Plan``s (``Pricer.to_plan``). Reads the
per-layer numbers of the ``SearchContext``'s ``ModelProfile``; prices compute and
memory with ``planner.cost_model``, every transfer and collective with
``planner.collectives``, links and groups from ``planner.topology``, tensor-parallel
splits from ``planner.tp_splits`` and stage bounds from ``planner.partition``.

Model of a strategy (device layout ``Choice.layout``, innermost first: "tp-dp-pp",
Megatron-LM's, or "tp-pp-dp", "dp-outer"; see "Device layouts" in ``planner.topology``):

- Tensor parallelism splits the *splittable* layers (Dense/EinsumDense/Conv1-3D column or
  row, attention by heads, Embedding by vocabulary: ``profiler.comm``) over tp
  devices: their FLOPs, weights, gradients, optimizer state and saved activations
  are divided by tp; every other layer is replicated. Which layers split, and how,
  is the Alpa intra-operator ILP's answer at each tp (``planner.tp_splits``,
  ``Pricer.splits_for``), priced with this module's own per-layer times; a tp at
  which no layer is worth splitting is not offered. Each split's Megatron f/g
  all-reduces (``profiler.comm.layer_comm``) run on the intra-node link, and a column
  split whose output no row split reads cut (a model's last projection) all-gathers it
  in the forward (``traffic.gathered_outputs``; its backward slices, no communication).
- Pipeline stages: pp x v contiguous runs of the topological layer order, cut between
  blocks only (``graph.pipeline_units``: a custom layer with sub-layers stays whole) (v model
  chunks per device: 1, or 2-4 under the interleaved schedule), run k on pipeline
  device k % pp, balancing the devices' work per micro-batch (min-max bisection,
  exact for v = 1; for v > 1 also an even split, whichever leaves the busiest device
  less); the memory of the result is then checked, not optimised. A chunk's output
  crosses to the next device scattered over the tp ranks and gathered there
  (``collectives.pipeline_send_time_s``).
- Step = m x t_stage + (pp - 1)/v x t_stage + exposed dp all-reduce + optimizer
  (GPipe and 1F1B: v = 1; interleaved 1F1B: v > 1, m a multiple of pp; Narayanan et
  al., SC'21, Sec. 2.2); 1F1B holds min(pp - s, m) micro-batches of activations on
  stage s, interleaved that times 1 + (pp-1)/(pp v), GPipe all m. With pp = 1 and
  m > 1 the micro-batches are gradient accumulation: one micro-batch's activations
  at a time.
- Devices that share cores (logical CPUs: ``ClusterSpec.devices_per_compute_pool``)
  wait for each other: ``cost_model.with_shared_cores``.
- Recomputation: "selective" is Megatron-LM's (Korthikanti et al., 2022, Sec. 5): each
  attention layer's core (scores, softmax, dropout, scores x V) is run again in the
  backward -- its share of the layer's forward time by FLOPs
  (``LayerProfile.attention_core_flops_fwd``) -- and its saved bytes
  (``attention_core_saved_bytes``, 5 a s^2 b in float16 with dropout) are not kept; a
  profile without the core numbers recomputes whole attention layers (an overestimate).
  "full" runs one extra forward of every layer and checkpoints every L layers, L chosen
  per chunk to minimise in-flight x kept + working (``full_recompute_memory``: Chen et
  al., 2016, "Training deep nets with sublinear memory cost"; Megatron-LM checkpoints
  every transformer block, about 7 of our layers).
- ZeRO stages 1-3 and offloading (``planner.sharding``: which tensors each device
  keeps, which collectives each stage runs per micro-batch and what hides them): over the
  dp x cp ranks that hold the same weights; ZeRO-3 gathers and reduce-scatters layer by
  layer, so each weighted layer after the first adds a collective's latency, and it runs
  each layer's forward again in the backward (with its forward collectives), as "full"
  recomputation does: TensorFlow's gradient ops read the weights they were made with, so
  ``apply`` re-gathers them by recomputing the layer (``apply.spmd.zero3``), so each layer
  holding weights keeps only its inputs (weightless layers their activations) and its own
  activations exist while its backward runs.
- Sequence parallelism (``planner.sequence``): the per-token layers the tensor-parallel
  group replicates run on 1/tp of the sequence (time and saved bytes / tp); the f/g
  all-reduces become all-gather + reduce-scatter, the same time. Context parallelism:
  every layer on 1/cp of the sequence; each attention layer all-gathers its keys and
  values over the cp ranks in the forward and reduce-scatters their gradients in the
  backward (``collectives.allgather_time_s``), hidden behind the layer's own compute
  where it can be, and keeps the gathered keys and values for the backward.
- Expert parallelism (``Choice.ep``, ``planner.experts``): each mixture-of-experts layer's
  expert state divided by ep (ZeRO sharding it over the d/ep ranks that hold the same
  experts), four all-to-alls per MoE layer per micro-batch over the ep group of each
  pipeline device (``collectives.all_to_all_time_s``, exposed), and the experts' gradients
  all-reduced over the d/ep ranks holding the same experts; the dense gradients as before.
- Tensor parallelism across nodes (a fixed tp > devices_per_node):
  ``collectives.tensor_group_allreduce_time_s`` (hierarchical over the nodes it spans).
- Data-parallel gradient all-reduce: over the dp group of each pipeline device
  (``topology.dp_group_devices`` under the layout), priced by
  ``collectives.allreduce_time_s`` from its members per node -- a ring inside one
  node, hierarchical when it holds the same number of members on each node it spans,
  a flat ring over the inter-node link otherwise -- the function plain data
  parallelism (``planner.search``) and the tensor-parallel ILP's gradient term use too.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tfplan.planner import collectives as coll
from tfplan.planner import cost_model as cm
from tfplan.planner import experts
from tfplan.planner.candidates import Choice
from tfplan.planner.context import SearchContext
from tfplan.planner.partition import device_loads, even_partition, min_max_partition
from tfplan.planner import sharding
from tfplan.planner.plan import (DEFAULT_LAYOUT, Breakdown, Plan, Prediction, Stage, Strategy,
                                 stage_devices)
from tfplan.planner.sequence import kv_bytes, sequence_parallel_layers
from tfplan.planner.topology import dp_group_devices, members_per_node, stage_link
from tfplan.planner.traffic import gathered_outputs, sent_bytes_per_device
from tfplan.planner.tp_splits import INSIDE, reference_samples, solve_splits
from tfplan.profiler.comm import HEAD_SPLIT_TYPES, profile_comm

KEEP_PER_SHAPE = 2  # hybrid candidates kept per (dp, tp, pp)
PARTITION_MICROBATCH = 8  # samples per micro-batch at which stages are balanced


@dataclass(frozen=True)
class Estimate:
    """A priced Choice: cheap to make in bulk; ``to_plan`` builds the full Plan."""

    choice: Choice
    breakdown: Breakdown
    stage_bounds: tuple[tuple[int, int], ...]  # [start, stop) per stage in topological order
    stage_memory_bytes: tuple[int, ...]
    hardware_flops: float  # per step, whole cluster, recomputation included
    all_to_all_s: float = 0.0  # expert parallelism's all-to-alls per step (slowest device)

    @property
    def step_time_s(self) -> float:
        return self.breakdown.total_s

    def fits(self, capacity: int) -> bool:
        return max(self.stage_memory_bytes) <= capacity


class Pricer:
    """Per-layer arrays for one search context, cached by (tp, micro-batch size)."""

    def __init__(self, ctx: SearchContext, tp_time_limit_s: float = 5.0) -> None:
        self.ctx = ctx
        self.tp_time_limit_s = tp_time_limit_s  # per tensor-parallel ILP (planner.tp_splits)
        self.split_choices: dict = {}  # tp -> planner.tp_splits.SplitChoice
        p = ctx.profile
        self.layers = p.layers
        self.b = p.batch_size
        self.n = len(p.layers)
        self.comm = profile_comm(p)
        self.attention = np.array([l.kind in HEAD_SPLIT_TYPES for l in p.layers])
        self.input_bytes = np.array(ctx.input_bytes, dtype=float)
        self.cache: dict = {}
        self.total_flops = float(p.flops_fwd + p.flops_bwd)
        self.has_moe = any(l.is_moe for l in p.layers)

    def splits_for(self, tp: int) -> tuple[str, ...]:
        """Each layer's split at tensor-parallel degree ``tp`` ("" = replicated): the
        tensor-parallel ILP's (``planner.tp_splits``), priced with this Pricer's own
        replicated per-layer forward + backward times (``arrays(1, samples)``) and its
        own data-parallel gradient all-reduce (``dp_allreduce_s``, dp = devices / tp);
        cached per tp."""
        if tp == 1:
            return ("",) * self.n
        if tp not in self.split_choices:
            ctx = self.ctx

            def replicated_time_s(samples: int) -> np.ndarray:
                a = self.arrays(1, samples)
                return a["fwd"] + a["bwd"]

            samples = reference_samples(ctx.global_batch, ctx.cluster.num_devices, tp)
            data_parallel = Choice(max(1, ctx.cluster.num_devices // tp), tp, 1, samples, 1)
            self.split_choices[tp] = solve_splits(
                ctx.profile, ctx.cluster, tp, layer_time_s=replicated_time_s, samples=samples,
                time_limit_s=self.tp_time_limit_s,
                grad_allreduce_s=lambda nbytes: self.dp_allreduce_s(nbytes, data_parallel))
        return self.split_choices[tp].splits

    def arrays(self, tp: int, mbs: int, sp: bool = False, cp: int = 1) -> dict[str, np.ndarray]:
        """Per-layer numbers for one micro-batch of ``mbs`` samples at tensor-parallel
        degree ``tp`` (the layers ``splits_for(tp)`` splits divided by tp), with sequence
        parallelism ``sp`` (``planner.sequence``: per-token layers divided by tp too) and
        context-parallel degree ``cp`` (every layer on 1/cp of the sequence; attention
        gathering the other ranks' keys and values); cached."""
        key = (tp, mbs, sp, cp)
        if key in self.cache:
            return self.cache[key]
        ctx, b = self.ctx, self.b
        cluster = ctx.cluster
        device, precision = cluster.device, ctx.profile.precision
        f = mbs / b
        splits = self.splits_for(tp)
        seq_split = sequence_parallel_layers(ctx.profile, splits) if sp and tp > 1 \
            else (False,) * self.n
        cp_group = members_per_node(range(0, cp * tp, tp), cluster.devices_per_node)
        gathered = gathered_outputs(self.layers, splits)
        cols: dict[str, list[float]] = {name: [] for name in (
            "fwd", "bwd", "tpf", "tpb", "opt", "grad", "act", "inp", "layer_in",
            "param", "cw", "gather", "core_fwd", "core_act", "cpf", "cpb",
            "xparam", "xgrad", "xopt", "xcw", "a2a")}
        for i, l in enumerate(self.layers):
            split = splits[i]
            k = tp if split else 1
            work = k * (tp if seq_split[i] else 1) * cp  # devices sharing the layer's work
            t_fwd, t_bwd = cm.layer_fwd_bwd_time_s(l, mbs, b, device, precision, work,
                                                   ctx.profile.measured_batch_size)
            s = next((x for x in self.comm[i].tp_splits if x.split == split), None)
            tpf = coll.tensor_group_allreduce_time_s(s.fwd_allreduce_bytes * f / cp, tp, cluster) \
                if s and s.fwd_allreduce_bytes else 0.0
            tpb = coll.tensor_group_allreduce_time_s(s.bwd_allreduce_bytes * f / cp, tp, cluster) \
                if s and s.bwd_allreduce_bytes else 0.0
            if tp > 1 and i in gathered:
                # its ranks all-gather the output no row split reads cut (a model's last
                # projection; apply.spmd): half an all-reduce of it, forward only
                tpf += coll.tensor_group_allreduce_time_s(
                    l.activation_bytes * f / cp, tp, cluster) / 2
            act = cm.saved_activation_bytes(l) * f / work + self.input_bytes[i] * f / cp
            inp = (self.layers[i - 1].activation_bytes if i else
                   max(self.input_bytes[0], l.input_bytes)) * f / cp
            cpf = cpb = 0.0
            if cp > 1 and self.attention[i]:
                kv = kv_bytes(l) * f / k  # the whole sequence's keys and values, per head shard
                gather_s = coll.allgather_time_s(kv, cp_group, cluster.intra_node_link,
                                                 cluster.inter_node_link)
                cpf, cpb = max(0.0, gather_s - t_fwd), max(0.0, gather_s - t_bwd)
                act += kv * (cp - 1) / cp  # the other ranks' keys and values, kept
            if self.attention[i] and l.attention_core_flops_fwd and l.flops_fwd:
                core_fwd = t_fwd * min(1.0, l.attention_core_flops_fwd / l.flops_fwd)
                core_act = min(act, l.attention_core_saved_bytes * f / (k * cp))
            elif self.attention[i]:  # no core numbers: the whole layer (an overestimate)
                core_fwd, core_act = t_fwd + tpf, max(0.0, act - inp)
            else:
                core_fwd = core_act = 0.0
            gather = (l.compute_weight_bytes or l.param_bytes) / k
            share = experts.expert_share(l)
            for name, value in (
                    ("fwd", t_fwd), ("bwd", t_bwd), ("tpf", tpf), ("tpb", tpb),
                    ("opt", l.optimizer_bytes / k), ("grad", l.grad_bytes / k), ("act", act),
                    ("inp", inp),  # what a stage starting at layer i receives
                    ("layer_in", (l.input_bytes or (self.layers[i - 1].activation_bytes if i
                                                    else 0) or self.input_bytes[i]) * f / cp),
                    ("param", l.param_bytes / k), ("cw", l.compute_weight_bytes / k),
                    ("gather", gather), ("core_fwd", core_fwd), ("core_act", core_act),
                    ("cpf", cpf), ("cpb", cpb),
                    # the experts' share of the state (planner.experts), divided by ep later;
                    # one rank's dispatch bytes per all-to-all (its 1/cp of the tokens)
                    ("xparam", l.param_bytes / k * share), ("xgrad", l.grad_bytes / k * share),
                    ("xopt", l.optimizer_bytes / k * share),
                    ("xcw", l.compute_weight_bytes / k * share),
                    ("a2a", experts.dispatch_bytes(l, mbs, b) / cp)):
                cols[name].append(value)
        arr = {name: np.array(v, dtype=float) for name, v in cols.items()}
        for name in ("fwd", "bwd", "tpf", "tpb", "opt", "grad", "act", "param", "cw",
                     "core_fwd", "cpf", "cpb", "xparam", "xgrad", "xopt", "xcw"):
            arr["sum_" + name] = np.concatenate([[0.0], np.cumsum(arr[name])])
        self.cache[key] = arr
        return arr

    def recomputed_flops(self, recompute: str) -> float:
        """Forward FLOPs recomputed per profile batch (whole model): every layer's under
        "full"; under "selective" the attention cores' (a whole attention layer's where the
        profile has no core numbers)."""
        key = ("rcflops", recompute)
        if key not in self.cache:
            if recompute == "full":
                total = sum(l.flops_fwd for l in self.layers)
            elif recompute == "selective":
                total = sum((l.attention_core_flops_fwd or l.flops_fwd)
                            for l, a in zip(self.layers, self.attention) if a)
            else:
                total = 0
            self.cache[key] = float(total)
        return self.cache[key]

    def partition(self, tp: int, mbs: int, pp: int, recompute: str,
                  virtual_stages: int = 1, sp: bool = False, cp: int = 1
                  ) -> tuple[tuple[int, int], ...]:
        """pp x v contiguous runs of the layer order, run k on pipeline device k % pp,
        balancing the devices' work per micro-batch: the min-max split (exact for v = 1)
        or, for v > 1, the even split when its busiest device has less work.

        The balance is struck once per (tp, pp, recompute, v, sp, cp) on the layers' work
        at a reference micro-batch of PARTITION_MICROBATCH samples, not per micro-batch
        size: a layer's time is linear in the samples plus a small fixed overhead, so the
        split that balances one size balances the others (and the search's cost stays
        flat as micro-batch sizes are added)."""
        key = ("part", tp, pp, recompute, virtual_stages, sp, cp)
        if key not in self.cache:
            a = self.arrays(tp, PARTITION_MICROBATCH, sp, cp)
            w = a["fwd"] + a["bwd"] + a["tpf"] + a["tpb"] + a["cpf"] + a["cpb"] \
                + self._recompute_per_layer(a, recompute)
            parts = pp * virtual_stages
            # stages cut between units only (a block is placed whole: graph.pipeline_units)
            starts = [start for start, _ in self.ctx.pipeline_units]
            uw = tuple(np.add.reduceat(w, starts).tolist()) if len(starts) < len(w) \
                else tuple(w.tolist())
            options = [min_max_partition(uw, parts)]
            if virtual_stages > 1:
                options.append(even_partition(uw, parts))
            options = [self.ctx.unit_bounds(b) for b in options]
            self.cache[key] = min(options, key=lambda b: max(device_loads(w, b, pp)))
        return self.cache[key]

    @staticmethod
    def _recompute_per_layer(a: dict[str, np.ndarray], recompute: str) -> np.ndarray:
        """Each layer's recomputation time per micro-batch: its forward (with its tensor-
        parallel and key/value exchanges) under "full", its attention core under
        "selective"."""
        if recompute == "full":
            return a["fwd"] + a["tpf"] + a["cpf"]
        if recompute == "selective":
            return a["core_fwd"]
        return np.zeros_like(a["fwd"])

    def devices(self, tp: int, mbs: int, pp: int, recompute: str, v: int, dp: int,
                layout: str = DEFAULT_LAYOUT, sp: bool = False, cp: int = 1, ep: int = 1
                ) -> dict[str, np.ndarray]:
        """Per pipeline device, per micro-batch: the sums over its chunks of every
        per-layer number ``estimate`` needs (numpy, one entry per device), cached by
        everything they depend on; ``estimate`` then only applies the schedule, the
        micro-batch count, ZeRO and offloading. Only the boundary sends ("send") depend on
        dp (here dp x cp: the ranks between tp and pp) and the layout, and the expert
        numbers (``_experts``) on ep too: the rest is computed once per (tp, mbs, pp,
        recompute, v, sp, cp)."""
        key = ("dev", tp, mbs, pp, recompute, v, dp, layout, sp, cp, ep)
        if key in self.cache:
            return self.cache[key]
        base = self._chunk_sums(tp, mbs, pp, recompute, v, sp, cp)
        cluster = self.ctx.cluster
        send = np.zeros(pp * v)
        for k, nbytes in enumerate(base["boundary_bytes"]):
            if nbytes:
                s = k % pp
                link = stage_link(cluster, layout, dp, tp, pp, s, (s + 1) % pp)
                send[k] = 2 * coll.pipeline_send_time_s(nbytes, tp, link, cluster.intra_node_link)
        d = dict(base)
        d["send"] = send.reshape(v, pp).sum(axis=0)  # chunk k on device k % pp
        d["a2a"] = np.zeros(pp)
        if self.has_moe:
            self._experts(d, tp, mbs, pp, v, dp, layout, sp, cp, ep)
        self.cache[key] = d
        return d

    def _experts(self, d: dict, tp: int, mbs: int, pp: int, v: int, dp: int, layout: str,
                 sp: bool, cp: int, ep: int) -> None:
        """Fill ``d`` (one pipeline device per entry) with the expert-parallel numbers at
        degree ``ep`` (``planner.experts``): "a2a", the all-to-alls' seconds per micro-batch
        (ALL_TO_ALLS_PER_LAYER per MoE layer over the ep group of the device's stage, each
        layer priced on its own: ``collectives.all_to_all_time_s``); "dense_*" and
        "expert_*", the state split into the replicated part and the experts' part already
        divided by ep; the largest layer's gathered weights and gradient with the experts
        divided by ep; and each stage's ep and expert-data-parallel groups' members per
        node ("_ep_groups"). ``dp`` here is dp x cp (the replica group)."""
        a = self.arrays(tp, mbs, sp, cp)
        lo = np.array([b[0] for b in d["bounds"]])
        hi = np.array([b[1] for b in d["bounds"]])
        groups = self._ep_groups(dp, tp, pp, layout, cp, ep)
        a2a = np.zeros(pp * v)
        for s in range(pp):  # chunk k on device k % pp, in the ep group of that stage
            prefix = self._a2a_prefix(tp, mbs, sp, cp, groups[s][0])
            a2a[s::pp] = prefix[hi[s::pp]] - prefix[lo[s::pp]]
        d["a2a"] = a2a.reshape(v, pp).sum(axis=0)
        d["_ep_groups"] = groups  # (ep group, expert-data-parallel group) members per node
        for name in ("param", "grad", "opt", "cw"):
            d["expert_" + name] = d["x" + name] / ep
            d["dense_" + name] = d[name] - d["x" + name]
        if ep > 1:
            def largest(per_layer: np.ndarray) -> np.ndarray:
                return np.maximum.reduceat(per_layer, lo).reshape(v, pp).max(axis=0)

            xgather = np.where(a["cw"] > 0, a["xcw"], a["xparam"])
            d["largest_gather"] = largest(a["gather"] - xgather * (1 - 1 / ep))
            d["largest_grad"] = largest(a["grad"] - a["xgrad"] * (1 - 1 / ep))

    def _ep_groups(self, dp: int, tp: int, pp: int, layout: str, cp: int, ep: int
                   ) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        """Per pipeline stage, the members per node of its ep group and of its
        expert-data-parallel group (``experts.expert_group_devices`` of the stage's dp x cp
        group, ``topology.dp_group_devices``); cached."""
        key = ("ep groups", dp, tp, pp, layout, cp, ep)
        if key not in self.cache:
            per_node = self.ctx.cluster.devices_per_node
            out = []
            for s in range(pp):
                ep_group, edp_group = experts.expert_group_devices(
                    dp_group_devices(layout, dp, tp, pp, s), ep, cp)
                out.append((members_per_node(ep_group, per_node),
                            members_per_node(edp_group, per_node)))
            self.cache[key] = out
        return self.cache[key]

    def _a2a_prefix(self, tp: int, mbs: int, sp: bool, cp: int, ep_nodes: tuple[int, ...]
                    ) -> np.ndarray:
        """Prefix sums over the layer order of each layer's all-to-all seconds per
        micro-batch, ALL_TO_ALLS_PER_LAYER x ``collectives.all_to_all_time_s`` of its dispatch
        bytes over an ep group with ``ep_nodes`` members per node (0 for layers without
        experts); cached."""
        key = ("a2a", tp, mbs, sp, cp, ep_nodes)
        if key not in self.cache:
            cluster = self.ctx.cluster
            times = {}
            per_layer = [0.0] * self.n
            for i, nbytes in enumerate(self.arrays(tp, mbs, sp, cp)["a2a"]):
                if nbytes:
                    if nbytes not in times:
                        times[nbytes] = experts.ALL_TO_ALLS_PER_LAYER * coll.all_to_all_time_s(
                            nbytes, ep_nodes, cluster.intra_node_link, cluster.inter_node_link)
                    per_layer[i] = times[nbytes]
            self.cache[key] = np.concatenate([[0.0], np.cumsum(per_layer)])
        return self.cache[key]

    def _chunk_sums(self, tp: int, mbs: int, pp: int, recompute: str, v: int,
                    sp: bool = False, cp: int = 1) -> dict[str, np.ndarray]:
        """``devices`` without the sends, plus each chunk's boundary bytes per micro-batch
        (0 for the last chunk); cached."""
        key = ("sums", tp, mbs, pp, recompute, v, sp, cp)
        if key in self.cache:
            return self.cache[key]
        a = self.arrays(tp, mbs, sp, cp)
        bounds = self.partition(tp, mbs, pp, recompute, v, sp, cp)
        lo = np.array([b[0] for b in bounds])
        hi = np.array([b[1] for b in bounds])

        def per_device(chunk_values: np.ndarray, how=np.sum) -> np.ndarray:
            return how(np.asarray(chunk_values, dtype=float).reshape(v, pp), axis=0)

        def chunk_sums(name: str) -> np.ndarray:
            prefix = a["sum_" + name]
            return prefix[hi] - prefix[lo]

        sums = {name: chunk_sums(name) for name in (
            "fwd", "bwd", "tpf", "tpb", "opt", "grad", "act", "param", "cw",
            "core_fwd", "cpf", "cpb", "xparam", "xgrad", "xopt", "xcw")}
        d = {name: per_device(values) for name, values in sums.items()}
        if recompute == "full":
            d["recompute"] = d["fwd"] + d["tpf"] + d["cpf"]
        elif recompute == "selective":
            d["recompute"] = d["core_fwd"]
        else:
            d["recompute"] = np.zeros(pp)
        # activations held per micro-batch in flight, and the working set on top
        if recompute == "full":  # checkpoints every few layers (full_recompute_memory)
            kept, working = self._full_recompute(tp, pp, v, sp, cp)
            scale = mbs / PARTITION_MICROBATCH  # both are linear in the samples
            d["kept"] = per_device(kept * scale)
            d["working"] = per_device(working * scale, np.max)
        elif recompute == "selective":
            d["kept"] = d["act"] - per_device(np.add.reduceat(a["core_act"], lo))
            d["working"] = per_device(np.maximum.reduceat(a["core_act"], lo), np.max)
        else:
            d["kept"], d["working"] = d["act"], np.zeros(pp)
        # ZeRO-3 runs each layer holding weights under tf.recompute_grad (apply.spmd.zero3):
        # it keeps only its inputs, and its activations exist while its backward runs
        weighted = a["param"] > 0
        d["kept_layerwise"] = per_device(np.add.reduceat(np.where(weighted, a["inp"], a["act"]),
                                                         lo))
        d["working_layerwise"] = per_device(np.maximum.reduceat(
            np.where(weighted, a["act"], 0.0), lo), np.max)
        # layers holding weights: ZeRO-3 gathers (and reduce-scatters) each on its own
        d["weighted_layers"] = per_device(np.add.reduceat((a["param"] > 0).astype(float), lo))
        # ZeRO-3's gathered weights in flight and ZeRO-2/3's unsharded gradient bucket
        d["largest_gather"] = per_device(np.maximum.reduceat(a["gather"], lo), np.max)
        d["largest_grad"] = per_device(np.maximum.reduceat(a["grad"], lo), np.max)
        # boundary transfers (``devices``): each chunk's output forward, its gradient back
        d["boundary_bytes"] = tuple(float(self.layers[end - 1].activation_bytes) * mbs / self.b
                                    / cp if end < self.n else 0.0 for end in hi)
        # all but the first layer's backward hides the gradient all-reduce
        d["overlap"] = d["bwd"] - a["bwd"][lo[:pp]]
        d["bounds"] = bounds
        self.cache[key] = d
        return d

    def _full_recompute(self, tp: int, pp: int, v: int, sp: bool, cp: int
                        ) -> tuple[np.ndarray, np.ndarray]:
        """Per chunk, ``full_recompute_memory`` at PARTITION_MICROBATCH samples; cached. A
        layer's inputs and saved bytes both scale linearly with the samples, so the best
        checkpoint spacing is the same at every micro-batch size and the bytes scale."""
        key = ("full", tp, pp, v, sp, cp)
        if key not in self.cache:
            a = self.arrays(tp, PARTITION_MICROBATCH, sp, cp)
            bounds = self.partition(tp, PARTITION_MICROBATCH, pp, "full", v, sp, cp)
            pairs = [full_recompute_memory(a["inp"][lo:hi], a["act"][lo:hi], pp)
                     for lo, hi in bounds]
            self.cache[key] = (np.array([k for k, _ in pairs]), np.array([w for _, w in pairs]))
        return self.cache[key]

    def estimate(self, c: Choice) -> Estimate:
        ctx = self.ctx
        cluster = ctx.cluster
        v, pp, m = c.virtual_stages, c.pp, c.num_microbatches
        d = self.devices(c.tp, c.microbatch_size, pp, c.recompute, v, c.replicas, c.layout,
                         c.sequence_parallel, c.cp, c.ep)
        compute = d["fwd"] + d["bwd"]
        comm = d["tpf"] + d["tpb"] + d["cpf"] + d["cpb"] + d["send"] + d["a2a"]
        # full recomputation runs each MoE layer's forward again: its dispatch and combine
        recompute = d["recompute"] + d["a2a"] / 2 if c.recompute == "full" else d["recompute"]
        replicas, zero = c.replicas, c.zero_stage if c.replicas > 1 else 0
        rerun = zero == 3 and c.recompute != "full"
        if rerun:  # ZeRO-3 re-gathers and re-runs each layer's forward in its backward
            # (apply.spmd.zero3: TensorFlow's gradient ops would keep the gathered weights)
            recompute = recompute + d["fwd"] + d["tpf"] + d["cpf"] + d["a2a"] / 2
        stage_times = compute + comm + recompute
        k = self._in_flight(c.schedule, pp, m, v)
        held, (w, cw, g, o), shard = self._state(d, c, zero)
        kept, working = d["kept"], d["working"]
        if rerun:  # and keeps each re-run layer's inputs only
            kept = np.minimum(kept, d["kept_layerwise"])
            working = np.maximum(working, d["working_layerwise"])
        memories = np.ceil(cm.with_margin_bytes(held + k * kept + working))
        if c.offload == "none":
            opt_s = cm.optimizer_time_s(w / shard, g / shard, o / shard, cluster.device)
        else:
            opt_s = sharding.offload_time_s(
                c.offload, m, weights=w, compute_weights=cw, grads=g, optimizer=o, shard=shard,
                cluster=cluster, forward_s=d["fwd"], backward_s=d["bwd"])
        dp_s = 0.0
        if replicas > 1:
            allreduce, gather, updated, per_layer = self._dp_collectives(d, c)
            if zero < 3:
                per_layer = 0.0
            dp_s = float(np.max(sharding.zero_exposed_s(
                zero, m, allreduce_s=allreduce, reduce_scatter_s=allreduce / 2 + per_layer,
                gather_weights_s=gather + per_layer, gather_updated_s=updated,
                forward_s=d["fwd"], backward_overlap_s=d["overlap"])))
        slow = int(np.argmax(stage_times))
        t_stage = float(stage_times[slow])
        breakdown = Breakdown(compute_s=m * float(compute[slow]),
                              communication_s=m * float(comm[slow]) + dp_s,
                              bubble_s=cm.batch_barrier_bubble_s(pp, t_stage, m)
                              if ctx.batch_barrier and pp > 1 else
                              cm.pipeline_bubble_s(pp, t_stage, v),
                              recompute_s=m * float(recompute[slow]),
                              optimizer_s=float(np.max(opt_s)))
        if cluster.devices_per_compute_pool > 1:  # else with_shared_cores changes nothing
            busy = m * (compute + recompute) + opt_s  # per pipeline device
            # in device order: stage-major (tp-dp-pp) or replica-major (tp-pp-dp)
            ranks = replicas * c.tp
            in_order = np.repeat(busy, ranks) if c.layout != "tp-pp-dp" \
                else np.tile(np.repeat(busy, c.tp), replicas)
            breakdown = cm.with_shared_cores(breakdown, in_order.tolist(), cluster)
        breakdown = cm.with_step_overhead(breakdown, ctx.profile.measured_step_overhead_s)
        hw = (self.total_flops + self.recomputed_flops("full" if rerun else c.recompute)
              + (self.recomputed_flops(c.recompute) if rerun else 0.0)) / self.b \
            * ctx.global_batch
        bounds = d["bounds"]
        # memory per stage of the plan: each chunk reports its device's peak
        return Estimate(c, breakdown, bounds, tuple(int(memories[k % pp])
                                                    for k in range(len(bounds))), hw,
                        all_to_all_s=m * float(d["a2a"][slow]))

    def _state(self, d: dict, c: Choice, zero: int) -> tuple:
        """Per pipeline device: the bytes of weights, gradients and optimizer state it holds
        (``sharding.state_bytes``), the (weights, compute weights, gradients, optimizer
        state) its optimizer updates, before dividing by the returned shard count.

        With mixture-of-experts layers (``planner.experts``, module docstring's Memory):
        state(dense, d) + state(experts / ep, d / ep), d = dp x cp; the largest-layer terms
        (ZeRO-2/3's unsharded bucket and gathered weights) counted once, with the dense
        part. The optimizer's shard of the update is then (dense + experts) / d under ZeRO
        (dense / d + experts / ep / (d / ep)), so the device's bytes are returned already
        divided, with shard 1."""
        replicas = c.replicas
        if not self.has_moe:
            held = sharding.state_bytes(d["param"], d["cw"], d["grad"], d["opt"],
                                        replicas=replicas, zero_stage=zero, offload=c.offload,
                                        largest_gather=d["largest_gather"],
                                        largest_grad=d["largest_grad"])
            return held, (d["param"], d["cw"], d["grad"], d["opt"]), \
                replicas if zero >= 1 else 1
        dense = [d["dense_" + n] for n in ("param", "cw", "grad", "opt")]
        expert = [d["expert_" + n] for n in ("param", "cw", "grad", "opt")]
        expert_replicas = replicas // c.ep
        held = sharding.state_bytes(*dense, replicas=replicas, zero_stage=zero,
                                    offload=c.offload, largest_gather=d["largest_gather"],
                                    largest_grad=d["largest_grad"]) \
            + sharding.state_bytes(*expert, replicas=expert_replicas,
                                   zero_stage=zero if expert_replicas > 1 else 0,
                                   offload=c.offload, largest_gather=0.0, largest_grad=0.0)
        if zero >= 1:
            updated = [x / replicas + y / expert_replicas for x, y in zip(dense, expert)]
        else:
            updated = [x + y for x, y in zip(dense, expert)]
        updated[1] = dense[1] + expert[1]  # the compute weights offloading fetches: unsharded
        return held, tuple(updated), 1

    def _in_flight(self, schedule: str, pp: int, m: int, v: int) -> np.ndarray:
        """``cost_model.microbatches_in_flight`` of each pipeline device; cached."""
        key = ("flight", schedule, pp, m, v)
        if key not in self.cache:
            self.cache[key] = np.array([cm.microbatches_in_flight(schedule, pp - s, m, v)
                                        for s in range(pp)])
        return self.cache[key]

    def _dp_collectives(self, d: dict, c: Choice) -> tuple:
        """Per pipeline device, over its dp x cp group: the gradients' all-reduce, the
        all-gather of its compute weights (ZeRO-3: the compute copies, or the float32
        weights when the model computes in float32), the all-gather of its updated
        weights (ZeRO-2), and one collective's latency per weighted layer after the first
        (ZeRO-3 gathers and reduce-scatters layer by layer: its time at 0 bytes). Cached in
        ``d``, which is already specific to the group and layout (``devices``)."""
        if "_dp" not in d:
            if self.has_moe and c.ep > 1:  # the dense state over d, the experts' over d / ep
                gather_bytes = np.where(d["cw"] > 0, d["dense_cw"], d["dense_param"])
                expert_gather = np.where(d["cw"] > 0, d["expert_cw"], d["expert_param"])
                grad, param = d["dense_grad"], d["dense_param"]
                experts_s = [self._expert_allreduce_s(x, d) for x in (
                    d["expert_grad"], expert_gather, d["expert_param"])]
            else:
                gather_bytes = np.where(d["cw"] > 0, d["cw"], d["param"])
                grad, param = d["grad"], d["param"]
                experts_s = [0.0, 0.0, 0.0]
            d["_dp"] = (self.dp_allreduce_s(grad, c) + experts_s[0],
                        self.dp_allreduce_s(gather_bytes, c) / 2 + experts_s[1] / 2,
                        self.dp_allreduce_s(param, c) / 2 + experts_s[2] / 2,
                        self.dp_allreduce_s(0.0, c) / 2 * np.maximum(0.0,
                                                                     d["weighted_layers"] - 1))
        return d["_dp"]

    def _expert_allreduce_s(self, nbytes: np.ndarray, d: dict) -> np.ndarray:
        """All-reduce of the experts' ``nbytes[s]`` (already divided by ep) over each
        pipeline device's expert-data-parallel group, the d / ep ranks holding the same
        experts (``experts.expert_group_devices``; 0 when that is one rank)."""
        cluster = self.ctx.cluster
        return np.array([coll.allreduce_time_s(nbytes[s], edp, cluster.intra_node_link,
                                               cluster.inter_node_link)
                         for s, (_, edp) in enumerate(d["_ep_groups"])])

    def dp_allreduce_s(self, nbytes, c: Choice):
        """Gradient all-reduce of ``nbytes[s]`` over the data-parallel group of each
        pipeline device s of ``c`` -- its dp x cp ranks (``topology.dp_group_devices``
        under ``c.layout``) -- priced by ``collectives.allreduce_time_s`` from the group's
        members per node: one number per pipeline device, or stage 0's for a scalar
        ``nbytes``. ZeRO-1's reduce-scatter + all-gather moves the same bytes (SC'20
        Sec. 7); a reduce-scatter or all-gather alone is half (``collectives.allgather_time_s``)."""
        cluster = self.ctx.cluster
        groups = self._dp_groups(c.replicas, c.tp, c.pp, c.layout)
        intra, inter = cluster.intra_node_link, cluster.inter_node_link
        if np.ndim(nbytes) == 0:
            return coll.allreduce_time_s(nbytes, groups[0][0], intra, inter)
        out = np.empty(len(nbytes))
        for per_node, stages in groups:
            out[stages] = coll.allreduce_time_s(nbytes[stages], per_node, intra, inter)
        return out

    def _dp_groups(self, dp: int, tp: int, pp: int, layout: str
                   ) -> list[tuple[tuple[int, ...], np.ndarray]]:
        """The dp groups' members per node, each with the pipeline devices whose group
        has it (stage 0's first); cached."""
        key = ("dp groups", dp, tp, pp, layout)
        if key not in self.cache:
            per_node = self.ctx.cluster.devices_per_node
            stages: dict[tuple[int, ...], list[int]] = {}
            for s in range(pp):
                stages.setdefault(members_per_node(dp_group_devices(layout, dp, tp, pp, s),
                                                   per_node), []).append(s)
            self.cache[key] = [(k, np.array(v)) for k, v in stages.items()]
        return self.cache[key]

    def to_plan(self, e: Estimate) -> Plan:
        ctx, c = self.ctx, e.choice
        names = ctx.names
        devices = ctx.cluster.device_names()
        stages = tuple(Stage(layers=names[lo:hi],
                             devices=stage_devices(devices, c.layout, c.replicas, c.tp, c.pp,
                                                   k % c.pp))
                       for k, (lo, hi) in enumerate(e.stage_bounds))
        memory = tuple((d, e.stage_memory_bytes[s]) for s, st in enumerate(stages[:c.pp])
                       for d in st.devices)
        step = e.step_time_s
        p = ctx.profile
        n_dev = c.replicas * c.tp * c.pp
        return Plan(
            name=c.name, model_name=p.model_name, model_fingerprint=p.fingerprint,
            model_signature=p.signature(), model_output_shapes=p.output_shapes(),
            model_input_shapes=p.input_shapes,
            cluster=ctx.cluster, global_batch=ctx.global_batch,
            precision=p.precision, optimizer=p.optimizer,
            strategy=Strategy(dp=c.dp, tp=c.tp, pp=c.pp, microbatch_size=c.microbatch_size,
                              num_microbatches=c.num_microbatches, schedule=c.schedule,
                              recompute=c.recompute,
                              zero_stage=c.zero_stage, sequence_parallel=c.sequence_parallel,
                              cp=c.cp, offload=c.offload,
                              virtual_stages=c.virtual_stages, layout=c.layout, ep=c.ep),
            stages=stages,
            predicted=Prediction(
                step_time_s=step, breakdown=e.breakdown, peak_memory_bytes_per_device=memory,
                memory_capacity_bytes=ctx.cluster.device.memory_bytes,
                samples_per_s=ctx.global_batch / step,
                model_tflops_per_device=cm.model_tflops_per_device(
                    (p.flops_fwd + p.flops_bwd) / p.batch_size, ctx.global_batch, step, n_dev),
                hardware_tflops_per_device=cm.hardware_tflops_per_device(
                    e.hardware_flops, step, n_dev),
                all_to_all_s=e.all_to_all_s,
                sent_bytes_per_device=sent_bytes_per_device(
                    p, c, e.stage_bounds, self.splits_for(c.tp), [s.devices for s in stages])),
            solver=f"closed form ({self._split_solver(c.tp)}; stages by min-max bisection "
                   "over the topological order)",
            tp_splits=tuple((name, split) for name, split in zip(names, self.splits_for(c.tp))
                            if split and split != INSIDE))  # named by their attention block

    def _split_solver(self, tp: int) -> str:
        """How the splits at ``tp`` were chosen, for Plan.solver."""
        self.splits_for(tp)
        return self.split_choices[tp].solver if tp in self.split_choices \
            else "no tensor parallelism"


def full_recompute_memory(boundary_bytes: np.ndarray, saved_bytes: np.ndarray,
                          in_flight: int) -> tuple[float, float]:
    """Activation memory of one chunk under full recomputation, checkpointing every L
    layers: (kept per micro-batch in flight, working set) for the L that minimizes
    in_flight x kept + working (Chen et al., "Training deep nets with sublinear memory
    cost", 2016, Sec. 4: segments of about sqrt(n) layers; Megatron-LM checkpoints every
    transformer layer, about 7 of ours). kept = the inputs of the segments' first layers;
    working = the largest segment's saved activations, alive while it is recomputed.
    ``boundary_bytes[i]``/``saved_bytes[i]``: layer i's input and saved bytes."""
    n = len(saved_bytes)
    if n == 0:
        return 0.0, 0.0
    prefix = np.concatenate([[0.0], np.cumsum(saved_bytes)])
    best = None
    for every in range(1, n + 1):
        starts = np.arange(0, n, every)
        kept = float(boundary_bytes[starts].sum())
        working = float(np.max(prefix[np.minimum(starts + every, n)] - prefix[starts]))
        cost = in_flight * kept + working
        if best is None or cost < best[0]:
            best = (cost, kept, working)
    return best[1], best[2]


def best_per_shape(estimates: list[Estimate], capacity: int) -> list[Estimate]:
    """The KEEP_PER_SHAPE fastest that fit for each (dp, tp, pp, layout, ep), else its
    least-memory one (ep in the key: the plans without expert parallelism stay to compare
    with)."""
    groups: dict[tuple[int, int, int, str, int], list[Estimate]] = {}
    for e in estimates:
        groups.setdefault((e.choice.dp, e.choice.tp, e.choice.pp, e.choice.layout,
                           e.choice.ep), []).append(e)
    kept = []
    for key in sorted(groups):
        group = groups[key]
        fit = sorted((e for e in group if e.fits(capacity)),
                     key=lambda e: (e.step_time_s, e.choice.name))
        kept += fit[:KEEP_PER_SHAPE] or [min(group, key=lambda e: (max(e.stage_memory_bytes),
                                                                    e.choice.name))]
    return kept
