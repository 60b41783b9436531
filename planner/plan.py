"""The planner's output value: ``Plan`` (strategy, placement, prediction) and plan.json.

Pipeline position: made by ``planner.search`` from a ModelProfile and a
ClusterSpec, checked by ``planner.validate``, written as plan.json, read back by
``load_plan`` in a training script and handed to ``apply.wrap``.

Placement: ``stages[s].devices[r]`` is the device that holds stage ``s`` of
data-parallel replica ``r``. A data-parallel plan has one stage on ``dp``
devices; a pipeline plan has ``pp`` stages of one device each. With tensor
parallelism a stage lists ``dp * tp`` devices, replica-major: ``devices[r * tp + t]``
is tensor rank t of replica r; ``tp_splits`` says how each split layer is cut
(``apply.tensor_parallel``).

Layout (``Strategy.layout``): which global devices (``ClusterSpec.device_names``,
node-major) a hybrid's stage s, replica r, tensor rank t sits on:

- ``"tp-dp-pp"`` (default; Megatron-LM's order, tp innermost, pp outermost):
  device ``s * dp * tp + r * tp + t`` -- a stage's replicas side by side, so the
  pipeline crosses nodes and the data-parallel all-reduce stays inside one when it can;
- ``"tp-pp-dp"`` (dp outermost, "dp-outer"): device ``r * tp * pp + s * tp + t`` --
  replica r's whole pipeline on devices [r tp pp, (r + 1) tp pp), inside one node when
  tp * pp divides devices_per_node, so only the data-parallel all-reduce crosses nodes
  (what a multi-worker hybrid in ``apply`` needs: every replica inside one worker).

Either way ``stages[s].devices`` keeps the order above (replica-major, tensor rank
innermost); only which devices they are differs. ``stage_devices`` computes them.

Context parallelism (``Strategy.cp`` > 1) splits every sample's sequence over cp ranks
that hold the same weights; they sit between tp and dp (Megatron-LM's tp-cp-dp-pp order):
everything above reads with ``dp * cp`` for dp, rank c of replica r being "replica"
``r * cp + c`` (``Strategy.replicas``), so ``devices[(r * cp + c) * tp + t]``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field as dc_field, replace
from typing import Any, Mapping

from tfplan.core.atomic import write_json
from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import PlanMismatchError, SchemaError
from tfplan.core.fileset import read_bytes
from tfplan.core.schema import SCHEMA_VERSION, check_version, decode, field
from tfplan.profiler.model_profile import input_shapes_from

SCHEDULES = ("none", "gpipe", "1f1b", "interleaved")
# Strategy.recompute: "selective" is Megatron-LM's selective recomputation of the attention
# core (softmax, its dropout and the two batched matmuls; Korthikanti et al., 2022, Sec. 5),
# "full" recomputes every layer's forward from the stage's inputs
RECOMPUTE = ("none", "selective", "full")
# Strategy.zero_stage (Rajbhandari et al., SC'20, Sec. 5): 0 plain data parallel; 1 optimizer
# state sharded over the data-parallel ranks (P_os); 2 gradients too (P_os+g); 3 weights too
# (P_os+g+p, PyTorch's FSDP), gathered layer by layer for the forward and the backward
ZERO_STAGES = (0, 1, 2, 3)
# Strategy.offload (ZeRO-Offload, Ren et al., USENIX ATC'21): optimizer state (and its
# update) in host memory, optionally the weights too (ZeRO-Infinity, Rajbhandari et al., SC'21)
OFFLOAD = ("none", "optimizer", "optimizer+weights")
# Strategy.batch_norm: BatchNormalization statistics over the whole step ("global", equal
# to one device) or per replica and micro-batch ("local", GPipe's rule): apply.batch_stats
BATCH_NORM = ("global", "local")
LAYOUTS = ("tp-dp-pp", "tp-pp-dp")  # Strategy.layout: innermost to outermost
DEFAULT_LAYOUT = "tp-dp-pp"
Shape = tuple  # a layer's output shape per sample: ints, None for a dynamic dimension
Signature = tuple  # ((layer name, layer type, params), ...) in the profile's order


def stage_devices(devices: tuple[str, ...], layout: str, dp: int, tp: int, pp: int,
                  stage: int) -> tuple[str, ...]:
    """The ``dp * tp`` devices of pipeline stage ``stage`` (< pp) out of ``devices``
    (node-major), replica-major with tensor rank innermost, under ``layout``
    (module docstring: tp-dp-pp puts them at s dp tp + r tp + t, tp-pp-dp at
    r tp pp + s tp + t)."""
    if layout == "tp-dp-pp":
        return tuple(devices[stage * dp * tp:(stage + 1) * dp * tp])
    if layout == "tp-pp-dp":
        return tuple(devices[r * tp * pp + stage * tp + t] for r in range(dp) for t in range(tp))
    raise ValueError(f"layout {layout!r}; expected one of {LAYOUTS}")


@dataclass(frozen=True)
class Strategy:
    dp: int
    tp: int
    pp: int
    microbatch_size: int
    num_microbatches: int
    schedule: str = "none"  # "none" when pp == 1
    recompute: str = "none"
    # ZERO_STAGES: what the data-parallel ranks (dp x cp) shard; 1 is the optimizer sharding
    # plan files before stages 2-3 wrote as "optimizer_sharding": true
    zero_stage: int = 0
    # sequence parallelism (Korthikanti et al., 2022, Sec. 4.2.2): the layers a tensor-parallel
    # group replicates (norms, dropout, residual adds) run on 1/tp of the sequence each; the
    # f/g all-reduces become all-gather + reduce-scatter pairs. Needs tp > 1.
    sequence_parallel: bool = False
    # context-parallel degree: every sample's sequence split over cp ranks, attention
    # exchanging keys and values (module docstring for the device order)
    cp: int = 1
    offload: str = "none"  # OFFLOAD
    # model chunks per pipeline device under the "interleaved" schedule (1 otherwise):
    # the plan then has pp * virtual_stages stages, stage k on the devices of stage k % pp
    virtual_stages: int = 1
    # device order of the dp x tp x pp grid, innermost first (LAYOUTS, module docstring)
    layout: str = DEFAULT_LAYOUT
    # how BatchNormalization statistics are computed (BATCH_NORM; apply.batch_stats):
    # "global" over the whole step's batch, as one device; "local" per replica and
    # micro-batch (GPipe). Plan files without it are "global".
    batch_norm: str = "global"
    # expert-parallel degree (Lepikhin et al., 2020, GShard; Rajbhandari et al., 2022,
    # DeepSpeed-MoE): each mixture-of-experts layer's experts split over ep ranks of the
    # data-parallel group (ep divides dp), tokens sent to their experts' rank and back
    # (all-to-all); replicas r and r' hold the same experts when r % ep == r' % ep (expert
    # data parallelism: dp / ep copies of each expert). 1: every replica holds every expert
    ep: int = 1

    @property
    def expert_replicas(self) -> int:
        """Copies of each expert: dp / ep (the group an expert's gradient is all-reduced in)."""
        return self.dp // self.ep

    @property
    def num_devices(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def replicas(self) -> int:
        """Ranks that hold the same weights of a stage's tensor rank: dp x cp (module
        docstring); the data-parallel group that all-reduces (or ZeRO-shards) them."""
        return self.dp * self.cp

    @property
    def optimizer_sharding(self) -> bool:
        """ZeRO stage 1 or above: the optimizer state is sharded (``planner.zero``)."""
        return self.zero_stage >= 1

    def describe(self) -> str:
        """The strategy in one line: degrees, micro-batches, schedule and every saver on."""
        parts = [f"dp={self.dp}, tp={self.tp}, pp={self.pp}"
                 + (f", cp={self.cp}" if self.cp > 1 else "")
                 + (f", ep={self.ep}" if self.ep > 1 else ""),
                 f"{self.num_microbatches} micro-batch(es) of {self.microbatch_size}",
                 f"schedule {self.schedule}"
                 + (f" ({self.virtual_stages} chunks per device)" if self.virtual_stages > 1
                    else ""),
                 f"recompute {self.recompute}"
                 + (" (attention core)" if self.recompute == "selective" else "")]
        if self.zero_stage:
            parts.append(f"ZeRO-{self.zero_stage}")
        if self.sequence_parallel:
            parts.append("sequence parallel")
        if self.offload != "none":
            parts.append(f"offload {self.offload} to host memory")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {"dp": self.dp, "tp": self.tp, "pp": self.pp, "cp": self.cp,
                "microbatch_size": self.microbatch_size,
                "num_microbatches": self.num_microbatches, "schedule": self.schedule,
                "recompute": self.recompute, "zero_stage": self.zero_stage,
                "optimizer_sharding": self.optimizer_sharding,
                "sequence_parallel": self.sequence_parallel, "offload": self.offload,
                "virtual_stages": self.virtual_stages, "layout": self.layout,
                "batch_norm": self.batch_norm,
                **({"ep": self.ep} if self.ep > 1 else {})}  # plans without experts unchanged

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Strategy":
        k, w = "Plan", "strategy"
        sharded = field(d, "optimizer_sharding", k, bool, where=w, optional=True, default=None)
        zero = field(d, "zero_stage", k, int, where=w, optional=True,
                     default=1 if sharded else 0, minimum=0)
        if zero not in ZERO_STAGES:
            raise SchemaError(f"Plan.strategy.zero_stage is {zero}; expected one of "
                              f"{ZERO_STAGES}.")
        if sharded is not None and sharded != (zero >= 1):
            raise SchemaError(f"Plan.strategy says zero_stage={zero} but optimizer_sharding="
                              f"{str(sharded).lower()}; stage 1 and above shard the optimizer "
                              "state. Remove optimizer_sharding or make it agree.")
        s = cls(**{n: field(d, n, k, int, where=w, minimum=1) for n in (
            "dp", "tp", "pp", "microbatch_size", "num_microbatches")},
            schedule=field(d, "schedule", k, str, where=w, optional=True, default="none"),
            recompute=field(d, "recompute", k, str, where=w, optional=True, default="none"),
            zero_stage=zero,
            sequence_parallel=field(d, "sequence_parallel", k, bool, where=w, optional=True,
                                    default=False),
            cp=field(d, "cp", k, int, where=w, optional=True, default=1, minimum=1),
            offload=field(d, "offload", k, str, where=w, optional=True, default="none"),
            virtual_stages=field(d, "virtual_stages", k, int, where=w, optional=True, default=1,
                                 minimum=1),
            layout=field(d, "layout", k, str, where=w, optional=True, default=DEFAULT_LAYOUT),
            batch_norm=field(d, "batch_norm", k, str, where=w, optional=True, default="global"),
            ep=field(d, "ep", k, int, where=w, optional=True, default=1, minimum=1))
        if s.dp % s.ep:
            raise SchemaError(f"Plan.strategy.ep is {s.ep} with dp={s.dp}; expert parallelism "
                              "splits the experts over ranks of the data-parallel group, so ep "
                              "must divide dp.")
        if s.offload not in OFFLOAD:
            raise SchemaError(f"Plan.strategy.offload is {s.offload!r}; expected one of "
                              f"{OFFLOAD}.")
        if s.sequence_parallel and s.tp == 1:
            raise SchemaError("Plan.strategy.sequence_parallel is true with tp=1; sequence "
                              "parallelism splits what a tensor-parallel group replicates, so "
                              "it needs tp > 1.")
        if s.batch_norm not in BATCH_NORM:
            raise SchemaError(f"Plan.strategy.batch_norm is {s.batch_norm!r}; expected one of "
                              f"{BATCH_NORM} (plan files without it are 'global').")
        if s.layout not in LAYOUTS:
            raise SchemaError(f"Plan.strategy.layout is {s.layout!r}; expected one of {LAYOUTS} "
                              f"(plan files without it are {DEFAULT_LAYOUT!r}).")
        if s.schedule not in SCHEDULES:
            raise SchemaError(f"Plan.strategy.schedule is {s.schedule!r}; expected one of "
                              f"{SCHEDULES}.")
        if s.recompute not in RECOMPUTE:
            raise SchemaError(f"Plan.strategy.recompute is {s.recompute!r}; expected one of "
                              f"{RECOMPUTE}.")
        return s


@dataclass(frozen=True)
class Stage:
    layers: tuple[str, ...]
    devices: tuple[str, ...]  # one per data-parallel replica

    def to_dict(self) -> dict[str, Any]:
        return {"layers": list(self.layers), "devices": list(self.devices)}


@dataclass(frozen=True)
class Breakdown:
    """Where the predicted step time goes (seconds; they sum to step_time_s)."""

    compute_s: float
    communication_s: float  # exposed (not overlapped) communication
    bubble_s: float
    recompute_s: float
    optimizer_s: float
    # the framework's fixed cost per step outside the devices' kernels (host dispatch,
    # feeding the batch): measured when the profile is calibrated, else 0
    overhead_s: float = 0.0

    @property
    def total_s(self) -> float:
        return self.compute_s + self.communication_s + self.bubble_s + self.recompute_s \
            + self.optimizer_s + self.overhead_s

    def to_dict(self) -> dict[str, float]:
        return {"compute_s": self.compute_s, "communication_s": self.communication_s,
                "bubble_s": self.bubble_s, "recompute_s": self.recompute_s,
                "optimizer_s": self.optimizer_s, "overhead_s": self.overhead_s}


@dataclass(frozen=True)
class Prediction:
    step_time_s: float
    breakdown: Breakdown
    peak_memory_bytes_per_device: tuple[tuple[str, int], ...]  # (device, bytes), plan order
    memory_capacity_bytes: int
    samples_per_s: float
    model_tflops_per_device: float
    hardware_tflops_per_device: float = 0.0  # recomputation FLOPs included
    # expert parallelism's token all-to-alls per step (dispatch and combine, forward and
    # backward: ``planner.experts``), part of breakdown.communication_s; 0 without them.
    # Written only when > 0; plan files without it read 0
    all_to_all_s: float = 0.0
    # bytes each device sends per step, by kind (planner.traffic.KINDS: tp, pp, dp, zero,
    # cp, ep): (device, ((kind, bytes), ...)) in plan order; () in plans written before the
    # field existed, and for general placements (their transfers are not listed yet)
    sent_bytes_per_device: tuple[tuple[str, tuple[tuple[str, int], ...]], ...] = ()

    @property
    def headroom_bytes(self) -> int:
        """Capacity minus the largest per-device peak (negative: does not fit)."""
        return self.memory_capacity_bytes - self.max_memory_bytes

    @property
    def max_memory_bytes(self) -> int:
        return max(b for _, b in self.peak_memory_bytes_per_device)

    @property
    def fits(self) -> bool:
        return self.max_memory_bytes <= self.memory_capacity_bytes

    def to_dict(self) -> dict[str, Any]:
        return {"step_time_s": self.step_time_s, "breakdown": self.breakdown.to_dict(),
                "peak_memory_bytes_per_device": dict(self.peak_memory_bytes_per_device),
                "memory_capacity_bytes": self.memory_capacity_bytes, "fits": self.fits,
                "samples_per_s": self.samples_per_s,
                "model_tflops_per_device": self.model_tflops_per_device,
                "hardware_tflops_per_device": self.hardware_tflops_per_device,
                **({"all_to_all_s": self.all_to_all_s} if self.all_to_all_s else {}),
                **({"sent_bytes_per_device": {d: dict(kinds) for d, kinds in
                                              self.sent_bytes_per_device}}
                   if self.sent_bytes_per_device else {}),
                "headroom_bytes": self.headroom_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Prediction":
        k, w = "Plan", "predicted"
        b = field(d, "breakdown", k, dict, where=w)
        mem = field(d, "peak_memory_bytes_per_device", k, dict, where=w)
        return cls(
            step_time_s=field(d, "step_time_s", k, float, where=w, minimum=0),
            breakdown=Breakdown(
                **{n: field(b, n, k, float, where=w + ".breakdown", minimum=0)
                   for n in ("compute_s", "communication_s", "bubble_s", "recompute_s",
                             "optimizer_s")},
                overhead_s=field(b, "overhead_s", k, float, where=w + ".breakdown", minimum=0,
                                 optional=True, default=0.0)),
            peak_memory_bytes_per_device=tuple((str(dev), int(v)) for dev, v in mem.items()),
            memory_capacity_bytes=field(d, "memory_capacity_bytes", k, int, where=w),
            samples_per_s=field(d, "samples_per_s", k, float, where=w, minimum=0),
            model_tflops_per_device=field(d, "model_tflops_per_device", k, float, where=w,
                                          minimum=0),
            hardware_tflops_per_device=field(d, "hardware_tflops_per_device", k, float, where=w,
                                             minimum=0, optional=True, default=0.0),
            all_to_all_s=field(d, "all_to_all_s", k, float, where=w, minimum=0, optional=True,
                               default=0.0),
            sent_bytes_per_device=_sent_from(field(d, "sent_bytes_per_device", k, dict,
                                                   where=w, optional=True, default={})),
        )


def _sent_from(raw: Mapping[str, Any]) -> tuple[tuple[str, tuple[tuple[str, int], ...]], ...]:
    """``Prediction.sent_bytes_per_device`` from plan.json's ``{device: {kind: bytes}}``."""
    out = []
    for device, kinds in raw.items():
        if not isinstance(kinds, dict) or not all(
                isinstance(v, int) and not isinstance(v, bool) and v >= 0
                for v in kinds.values()):
            raise SchemaError(f"Plan.predicted.sent_bytes_per_device[{device!r}] is {kinds!r}; "
                              "expected {kind: bytes} with whole, non-negative bytes.")
        out.append((str(device), tuple((str(kind), int(v)) for kind, v in kinds.items())))
    return tuple(out)


PLACEMENTS = ("stages", "general")  # Plan.placement


@dataclass(frozen=True)
class Plan:
    """How to train one model on one cluster, and what that is predicted to cost.

    ``placement == "general"``: each stage is one device's layers (in topological
    order, not necessarily consecutive), dp = tp = 1, pp = devices used, one
    micro-batch; ``device_of_layer`` reads the same either way.
    """

    name: str  # "single device", "data parallel dp=4", "pipeline pp=2 m=4", ...
    model_name: str
    model_fingerprint: str
    model_signature: tuple[tuple[str, str, int], ...]  # (layer, type, params)
    cluster: ClusterSpec
    global_batch: int
    precision: str
    optimizer: str
    strategy: Strategy
    stages: tuple[Stage, ...]
    predicted: Prediction
    reason: str = ""
    solver: str = ""  # how the placement was found ("ILP (HiGHS) ...", "enumeration")
    # "stages": stages are runs of consecutive layers (data parallel, pipelines, hybrids);
    # "general": a device per layer, any layers on any device, independent branches run at
    # the same time, one batch (planner.placement_search); stage s holds device s's layers.
    placement: str = "stages"
    # tensor-parallel split of each split layer ("column", "row", "heads", "vocab"), in
    # model order; a layer not named is replicated on its stage's tp devices. Empty when
    # tp == 1, and in plan files written before the field existed.
    tp_splits: tuple[tuple[str, str], ...] = ()
    # output shape per sample of each layer of model_signature (None: unknown), as the
    # profile recorded it; () in plans made from profiles without shapes. Part of the
    # structure a model must match (``for_model``).
    model_output_shapes: tuple[Shape | None, ...] = ()
    # (input name, per-sample dims) the plan was made for (``ModelProfile.input_shapes``:
    # the model's inputs, dynamic dimensions filled by --input-shape or sample_batch);
    # ``apply`` refuses training batches that differ where the model leaves a dimension
    # dynamic. () in plans made from profiles without them: nothing is checked.
    model_input_shapes: tuple[tuple[str, tuple[int, ...]], ...] = ()
    schema_version: int = dc_field(default=SCHEMA_VERSION)

    @property
    def devices(self) -> tuple[str, ...]:
        """Every device the plan uses, once, in stage order (an interleaved pipeline's
        stages reuse their devices)."""
        return tuple(dict.fromkeys(d for s in self.stages for d in s.devices))

    def device_of_layer(self, replica: int = 0) -> dict[str, str]:
        return {layer: s.devices[replica] for s in self.stages for layer in s.layers}

    def replica_devices(self, replica: int) -> tuple[str, ...]:
        """Every device of data-parallel replica ``replica``: its tensor ranks of every
        stage (``stages[s].devices[replica * tp:(replica + 1) * tp]``), in stage order,
        once each."""
        tp = max(1, self.strategy.tp)
        return tuple(dict.fromkeys(d for s in self.stages
                                   for d in s.devices[replica * tp:(replica + 1) * tp]))

    def replicas_inside_nodes(self) -> bool:
        """Whether every data-parallel replica's devices lie inside one node of the plan's
        cluster (a worker process of a ``Wxcpu:N`` cluster): what a hybrid across workers
        needs, data parallel between them and the rest inside each (layout tp-pp-dp with
        tp * pp dividing devices_per_node, or a single-node plan)."""
        per_node = self.cluster.devices_per_node
        node = {d: i // per_node for i, d in enumerate(self.cluster.device_names())}
        return all(len({node.get(d, -1) for d in self.replica_devices(r)}) == 1
                   for r in range(self.strategy.dp))

    def with_reason(self, reason: str) -> "Plan":
        return replace(self, reason=reason)

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": self.schema_version, "name": self.name,
            "model": {"name": self.model_name, "fingerprint": self.model_fingerprint,
                      "layers": [list(x) for x in self.model_signature],
                      **({"output_shapes": [None if sh is None else list(sh)
                                            for sh in self.model_output_shapes]}
                         if self.model_output_shapes else {}),
                      **({"input_shapes": {n: list(dims) for n, dims in self.model_input_shapes}}
                         if self.model_input_shapes else {})},
            "cluster": self.cluster.to_dict(), "global_batch": self.global_batch,
            "precision": self.precision, "optimizer": self.optimizer,
            "strategy": self.strategy.to_dict(),
            "stages": [s.to_dict() for s in self.stages],
            "predicted": self.predicted.to_dict(), "reason": self.reason,
            "solver": self.solver, "placement": self.placement,
            **({"tp_splits": dict(self.tp_splits)} if self.tp_splits else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        k = "Plan"
        check_version(d, k)
        model = field(d, "model", k, dict)
        sig = []
        for i, row in enumerate(field(model, "layers", k, list, where="model")):
            if not (isinstance(row, list) and len(row) == 3 and isinstance(row[2], int)):
                raise SchemaError(f"Plan.model.layers[{i}] is {row!r}; expected "
                                  "[name, type, params].")
            sig.append((str(row[0]), str(row[1]), int(row[2])))
        stages = []
        for i, s in enumerate(field(d, "stages", k, list)):
            stages.append(Stage(
                layers=tuple(field(s, "layers", k, list, where=f"stages[{i}]")),
                devices=tuple(field(s, "devices", k, list, where=f"stages[{i}]"))))
        placement = field(d, "placement", k, str, optional=True, default="stages")
        if placement not in PLACEMENTS:
            raise SchemaError(f"Plan.placement is {placement!r}; expected one of {PLACEMENTS} "
                              "(plan files without it are 'stages').")
        return cls(
            name=field(d, "name", k, str),
            model_name=field(model, "name", k, str, where="model"),
            model_fingerprint=field(model, "fingerprint", k, str, where="model"),
            model_signature=tuple(sig),
            cluster=ClusterSpec.from_dict(field(d, "cluster", k, dict)),
            global_batch=field(d, "global_batch", k, int, minimum=1),
            precision=field(d, "precision", k, str),
            optimizer=field(d, "optimizer", k, str),
            strategy=Strategy.from_dict(field(d, "strategy", k, dict)),
            stages=tuple(stages),
            predicted=Prediction.from_dict(field(d, "predicted", k, dict)),
            reason=field(d, "reason", k, str, optional=True, default=""),
            solver=field(d, "solver", k, str, optional=True, default=""),
            placement=placement,
            tp_splits=_tp_splits_from(d),
            model_output_shapes=_shapes_from(model, len(sig)),
            model_input_shapes=input_shapes_from(
                field(model, "input_shapes", k, dict, where="model", optional=True,
                      default={}), "Plan.model.input_shapes"),
        )

    def check_model(self, signature: Signature,
                    output_shapes: tuple[Shape | None, ...] = ()) -> None:
        """Raise PlanMismatchError naming the first structural difference from the
        model's ``signature`` (and ``output_shapes``): see ``layer_names_for``."""
        self.layer_names_for(signature, output_shapes)

    def layer_names_for(self, signature: Signature,
                        output_shapes: tuple[Shape | None, ...] = ()) -> dict[str, str]:
        """{plan's layer name: the model's}, position by position, when the model has the
        plan's structure: as many layers, each of the same type, parameter count and
        (where both are known) output shape per sample, in the profile's topological
        order. Names may differ: Keras generates them per process (``dense_1`` once
        another model was built first). PlanMismatchError names the first layer that
        differs otherwise."""
        mine, theirs = self.model_signature, tuple(signature)
        for i, (a, b) in enumerate(zip(mine, theirs)):
            shape_a = _at(self.model_output_shapes, i)
            shape_b = _at(output_shapes, i)
            same_shape = shape_a is None or shape_b is None or tuple(shape_a) == tuple(shape_b)
            if a[1:] != b[1:] or not same_shape:
                raise PlanMismatchError(
                    f"This plan was made for model {self.model_name!r}, and layer {i} (in "
                    f"the profile's topological order) differs: the plan has {a[0]!r} "
                    f"({a[1]}, output {_show(shape_a)}, {a[2]} params), the model has "
                    f"{b[0]!r} ({b[1]}, output {_show(shape_b)}, {b[2]} params). Plans match "
                    "models by structure (layer types, output shapes, parameter counts in "
                    "order), not by layer names, so this is another model. Re-run `plan "
                    "analyze` for this model (or load the plan made for it).")
        if len(mine) != len(theirs):
            extra = (f"the model's first extra layer is {theirs[len(mine)][0]!r} "
                     f"({theirs[len(mine)][1]})" if len(theirs) > len(mine) else
                     f"the plan's layer {len(theirs)}, {mine[len(theirs)][0]!r} "
                     f"({mine[len(theirs)][1]}), has no counterpart")
            raise PlanMismatchError(
                f"This plan was made for model {self.model_name!r} with {len(mine)} layers; the "
                f"model has {len(theirs)} ({extra}). Re-run `plan analyze` for this model.")
        return {a[0]: b[0] for a, b in zip(mine, theirs)}

    def for_model(self, signature: Signature,
                  output_shapes: tuple[Shape | None, ...] = ()) -> "Plan":
        """This plan with its layers named as the model names them (``layer_names_for``):
        stages, ``tp_splits`` and the signature, so that everything that looks a layer up
        by the plan's names finds the model's. The plan itself when the names agree."""
        names = self.layer_names_for(signature, output_shapes)
        if all(k == v for k, v in names.items()):
            return self
        return replace(
            self,
            model_signature=tuple((names[n], t, p) for n, t, p in self.model_signature),
            stages=tuple(Stage(layers=tuple(names.get(n, n) for n in st.layers),
                               devices=st.devices) for st in self.stages),
            tp_splits=tuple((names.get(n, n), split) for n, split in self.tp_splits))


def _at(shapes: tuple[Shape | None, ...], i: int) -> Shape | None:
    return shapes[i] if i < len(shapes) else None


def _show(shape: Shape | None) -> str:
    if shape is None:
        return "shape unknown"
    return "(" + ", ".join(["batch", *("?" if d is None else str(d) for d in shape)]) + ")"


def _shapes_from(model: Mapping[str, Any], n_layers: int) -> tuple[Shape | None, ...]:
    """``Plan.model_output_shapes`` from plan.json's ``model.output_shapes`` (absent in
    older files: ())."""
    raw = field(model, "output_shapes", "Plan", list, where="model", optional=True,
                default=[])
    if raw and len(raw) != n_layers:
        raise SchemaError(f"Plan.model.output_shapes has {len(raw)} entries; expected one per "
                          f"layer of model.layers ({n_layers}).")
    out: list[Shape | None] = []
    for i, sh in enumerate(raw):
        if sh is not None and not (isinstance(sh, list) and all(
                d is None or (isinstance(d, int) and not isinstance(d, bool)) for d in sh)):
            raise SchemaError(f"Plan.model.output_shapes[{i}] is {sh!r}; expected a list of "
                              "dimensions (ints, null for a dynamic one) or null.")
        out.append(None if sh is None else tuple(sh))
    return tuple(out)


def _tp_splits_from(d: Mapping[str, Any]) -> tuple[tuple[str, str], ...]:
    """``Plan.tp_splits`` from plan.json's ``{"layer": "split"}`` (absent in older files)."""
    raw = field(d, "tp_splits", "Plan", dict, optional=True, default={})
    out = []
    for layer, split in raw.items():
        if not isinstance(split, str):
            raise SchemaError(f"Plan.tp_splits[{layer!r}] is {split!r}; expected a split name "
                              "(column, row, heads, vocab).")
        out.append((str(layer), split))
    return tuple(out)


def save_plan(plan: Plan, path: str | os.PathLike, run_id: str | None = None) -> None:
    """Write ``plan`` as plan.json, atomically (``core.atomic``: the file holds the old plan or
    the new one, never a truncated mix). ``run_id``: the ``plan analyze`` run it belongs to
    (``reports.analysis_dir`` checks it against the directory's manifest)."""
    doc = plan.to_dict()
    if run_id is not None:
        doc["run_id"] = run_id
    write_json(path, doc)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read a plan.json written by ``plan analyze`` (validated; SchemaError naming the file if
    it is truncated or malformed). A plan.json in an analysis directory is read as that
    directory's current set has it (``core.fileset``: through an interrupted commit)."""
    path = os.fspath(path)
    remake = ("Re-run `plan analyze MODEL --cluster C --global-batch B --out DIR` to write "
              "it again.")
    try:
        raw = read_bytes(os.path.dirname(path) or ".", os.path.basename(path))
    except FileNotFoundError:
        raise PlanMismatchError(f"Plan file {path!r} does not exist. Create one with "
                                "`plan analyze MODEL --cluster C --global-batch B --out DIR`.")
    except OSError as e:
        raise SchemaError(f"Plan file {path!r} cannot be read ({e.strerror or e}).") from None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise SchemaError(f"Plan file {path!r} is truncated or not valid JSON ({e}). "
                          + remake) from None
    try:
        return decode(Plan.from_dict, doc, "the plan")
    except SchemaError as e:
        raise SchemaError(f"Plan file {path!r}: {e}") from None
