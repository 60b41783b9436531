"""The run description: what the SPMD engine derives from a plan, once, as data.

Pipeline position: the first step of ``apply.spmd`` (after ``apply.wrap`` has matched the
plan to the model): ``describe(plan)`` gives one immutable ``RunDescription`` that every
later step reads (building the copies, the train step, weight files), as Keras 3's
``Distribution`` decides layouts once and keeps them as data.

The mesh: replica q (data-parallel rank) holds ``replicas[q]``, its tensor ranks in
order (the plan's stage devices, tensor rank innermost: ``planner.plan``). Its groups
come from ``apply.groups.groups_of`` (one table, keys from the devices). Under pipeline
parallelism ``stages[k]`` is that grid for model chunk k (``replicas`` is chunk 0's):
column (q, t), replica q's tensor rank t of every chunk, holds one copy of the model,
each layer's variables on the device of its chunk (``stage_of_entry``), and chunk k runs
on pipeline device k % pp (``virtual_stages`` chunks each under "interleaved").
"""
from __future__ import annotations

from dataclasses import dataclass

from tfplan.apply.groups import Group, Groups, group_key, groups_of
from tfplan.planner.plan import Plan
from tfplan.planner.traffic import block_columns_end_in_row


@dataclass(frozen=True)
class RunDescription:
    """How a plan runs on its devices (module docstring).

    ``splits``: (layer path, split) of every tensor-parallel split, in the plan's order;
    ``row_fed``: the column splits whose output a row split reads sliced (Megatron's pair:
    no gather between them); ``num_microbatches``: each replica's micro-batches per step,
    their gradients accumulated on the replica's devices before one reduction (ZeRO-2: each
    micro-batch's reduced at once, ``apply.spmd.zero``)."""

    plan_name: str
    replicas: tuple[tuple[str, ...], ...]
    groups: Groups
    splits: tuple[tuple[str, str], ...]
    row_fed: frozenset[str]
    num_microbatches: int
    global_batch: int
    zero_stage: int = 0  # 1, 2: apply.spmd.zero; 3: apply.spmd.zero3 (0 where dp = 1)
    recompute: str = "none"  # "full": whole layers; "selective": their attention cores
    recomputed: tuple[str, ...] = ()  # the top-level layers (apply.recompute)
    batch_norm: str = "global"  # statistics over the dp group (apply.spmd.batch_norm)
    # "optimizer": the optimizer state and update on the host; "optimizer+weights": the
    # copies' weights there too, read by each layer's ops on its device
    offload: str = "none"
    # pipelines (apply.spmd.pipeline): each model chunk's replicas (chunk 0's: replicas),
    # the chunk of each of the plan's layers (template paths), the schedule
    stages: tuple[tuple[tuple[str, ...], ...], ...] = ()
    stage_of_entry: tuple[tuple[str, int], ...] = ()
    schedule: str = "none"  # "gpipe", "1f1b", "interleaved" where there are chunks
    virtual_stages: int = 1
    sequence_parallel: bool = False  # apply.spmd.layout (tp > 1)
    # context parallelism (apply.spmd.context): replica q = r cp + c runs chunk c of data-
    # parallel rank r's sequences (``replicas`` lists every dp x cp replica, so their
    # gradients meet in the dp groups)
    cp: int = 1
    # expert parallelism (apply.spmd.experts): replica q holds ep rank ep_rank(q)'s experts
    ep: int = 1
    # the plan's micro-batches per replica run as one (num_microbatches is then 1): global
    # batch statistics join them at every BatchNormalization layer (apply.spmd.batch_norm)
    joined_microbatches: int = 1
    # one program per worker (the one-program-per-worker issue): the devices this process
    # drives (its worker's; empty: every device, one host), and each worker's host CPU
    # (``workers``: the group that sums the metrics, gathers outputs and syncs files)
    local: frozenset[str] = frozenset()
    workers: Group | None = None

    def drives(self, q: int, t: int) -> bool:
        """Whether this process runs (some chunks of) column (q, t): one of its devices is
        this process's (a column whose pipeline chunks lie on several workers runs on each
        of them, its activations crossing between them: ``apply.spmd.pipeline``)."""
        return not self.local or any(d in self.local for d in self.column(q, t))

    def is_local(self, device: str) -> bool:
        """Whether ``device`` is this process's (every device on one host)."""
        return not self.local or device in self.local

    @property
    def fixed_batch(self) -> bool:
        """Whether a batch smaller than the plan's is padded to it (its padding rows weigh
        0): where collectives move activations, whose shapes an instance key fixes (tensor
        and expert parallelism, pipeline hops between workers)."""
        return self.tp > 1 or self.ep > 1 or any(
            self.spans_workers(q, t) for q in range(self.dp) for t in range(self.tp))

    def spans_workers(self, q: int, t: int) -> bool:
        """Whether column (q, t)'s chunks lie on several workers."""
        return bool(self.local) and not all(d in self.local for d in self.column(q, t))

    @property
    def local_columns(self) -> tuple[tuple[int, int], ...]:
        """The columns (q, t) this process runs, replica by replica."""
        return tuple((q, t) for q in range(self.dp) for t in range(self.tp) if self.drives(q, t))

    @property
    def every_column_here(self) -> bool:
        """One process runs every column (one host)."""
        return not self.local

    def ep_rank(self, q: int) -> int:
        """Replica q's expert-parallel rank (its share of every MoE layer's experts): its
        data-parallel rank's (q = r cp + c) modulo ep."""
        return (q // self.cp) % self.ep

    @property
    def ep_replicas(self) -> tuple[int, ...]:
        """The replica holding each ep rank's experts in the first ep group (dp ranks
        0..ep-1, context rank 0): where the whole layer's experts are read."""
        return tuple(e * self.cp for e in range(self.ep))

    @property
    def chunks(self) -> int:
        """The model chunks (pipeline stages, x virtual stages under "interleaved")."""
        return max(1, len(self.stages))

    @property
    def pp(self) -> int:
        return self.chunks // self.virtual_stages

    def column(self, q: int, t: int) -> tuple[str, ...]:
        """Column (q, t)'s device of each chunk (one device where there is one chunk)."""
        return tuple(grid[q][t] for grid in self.stages) or (self.replicas[q][t],)

    @property
    def loss_replicas(self) -> tuple[tuple[str, ...], ...]:
        """Where each replica's outputs and loss are: the last chunk's grid."""
        return self.stages[-1] if self.stages else self.replicas

    def loss_dp_group(self, t: int) -> Group:
        """Tensor rank t of every replica on the last chunk (their loss counts are summed)."""
        return self._group("dp", tuple(replica[t] for replica in self.loss_replicas))

    @property
    def all_devices(self) -> tuple[str, ...]:
        """Every device of the run, once (chunk by chunk)."""
        grids = self.stages or (self.replicas,)
        return tuple(dict.fromkeys(d for grid in grids for replica in grid for d in replica))

    def chunk_group(self, kind: str, device: str) -> Group:
        """``device``'s group of ``kind`` ("dp", "tp") on its chunk (one device: itself)."""
        return self.groups.containing(device, kind) or Group(kind, (device,), 0)

    @property
    def dp(self) -> int:
        return len(self.replicas)

    @property
    def tp(self) -> int:
        return len(self.replicas[0])

    @property
    def parts(self) -> int:
        """P: the parts a batch is cut into, dp x micro-batches (x cp chunks: ``dp``
        counts every dp x cp replica)."""
        return self.dp * self.num_microbatches

    @property
    def devices(self) -> tuple[str, ...]:
        return tuple(d for replica in self.replicas for d in replica)

    def tp_group(self, q: int) -> Group:
        """Replica q's tensor ranks (a group of one device when tp = 1)."""
        return self._group("tp", self.replicas[q])

    def dp_group(self, t: int) -> Group:
        """Tensor rank t of every replica (their gradients are summed)."""
        return self._group("dp", tuple(replica[t] for replica in self.replicas))

    def _group(self, kind: str, devices: tuple[str, ...]) -> Group:
        found = next((g for g in self.groups.of_kind(kind) if g.devices == devices), None)
        return found or Group(kind, devices, 0)  # one device: no collective is launched

    def to_dict(self) -> dict:
        return {"plan": self.plan_name, "replicas": [list(r) for r in self.replicas],
                "groups": self.groups.to_dict(), "splits": [list(s) for s in self.splits],
                "row_fed": sorted(self.row_fed), "num_microbatches": self.num_microbatches,
                "global_batch": self.global_batch, "zero_stage": self.zero_stage,
                "recompute": self.recompute, "recomputed": list(self.recomputed),
                "batch_norm": self.batch_norm, "offload": self.offload,
                "stages": [[list(r) for r in grid] for grid in self.stages],
                "stage_of_entry": [list(e) for e in self.stage_of_entry],
                "schedule": self.schedule, "virtual_stages": self.virtual_stages,
                "sequence_parallel": self.sequence_parallel, "cp": self.cp, "ep": self.ep,
                "joined_microbatches": self.joined_microbatches,
                "local": sorted(self.local),
                "workers": None if self.workers is None else list(self.workers.devices)}


def row_fed_columns(splits: tuple[tuple[str, str], ...]) -> frozenset[str]:
    """The column splits a row split reads sliced: a column directly before a row; inside a
    block, every column of a run of them in the block that a row split of the same block
    ends (``planner.traffic.block_columns_end_in_row``: parallel projections that meet in
    an elementwise product before the row, as SwiGLU's gate and up; Megatron keeps both
    sliced). Chained columns inside a block are not row-fed this way and fail to build
    rather than train wrong (the second one's kernel reads the whole width)."""
    blocks = [(name.rpartition("/")[0], split) for name, split in splits]
    return frozenset(
        name for i, (name, split) in enumerate(splits) if split == "column" and (
            splits[i + 1:i + 2] and splits[i + 1][1] == "row"
            or blocks[i][0] and block_columns_end_in_row(blocks[i:])))


def task_of(device: str) -> int | None:
    """The worker task a plan's device name says (``/job:worker/task:w/...``; None on one
    host)."""
    for part in device.split("/"):
        if part.startswith("task:"):
            return int(part[5:])
    return None


def workers_group(plan: Plan) -> Group | None:
    """Each worker's host CPU, in task order (None on one host): ``RunDescription.workers``."""
    tasks = sorted({t for stage in plan.stages for d in stage.devices
                    if (t := task_of(d)) is not None})
    if len(tasks) <= 1:
        return None
    devices = tuple(f"/job:worker/task:{t}/device:CPU:0" for t in tasks)
    return Group("workers", devices, group_key(devices))


def describe(plan: Plan, recomputed: tuple[str, ...] = (), batch_norm: bool = False,
             segments: tuple[tuple[tuple[str, int], ...], tuple[str, ...]] = ((), ()),
             task: int | None = None) -> RunDescription:
    """The run description of a plan; ``recomputed``: the
    top-level layers it recomputes (``apply.recompute.recomputed_layers``); ``batch_norm``:
    the model has BatchNormalization layers (under the plan's ``global`` rule its
    micro-batches then run as one: ``joined_microbatches``); ``segments``: for a general
    placement, (layer path, chunk) of its layers and each chunk's device
    (``apply.spmd.stages.placement_segments``: it runs as a pipeline of those chunks, one
    micro-batch, in GPipe's order); ``task``: this process's worker (TF_CONFIG's index) for
    a plan across workers, whose program runs that worker's devices only."""
    s = plan.strategy
    m = s.num_microbatches
    joined = m if batch_norm and s.batch_norm == "global" and m > 1 else 1
    tp = max(1, s.tp)
    entries, chunk_devices = segments
    if plan.placement == "general" and len(chunk_devices) > 1:
        grids = tuple(((device,),) for device in chunk_devices)
    else:
        grids = tuple(tuple(tuple(stage.devices[q * tp:(q + 1) * tp])
                            for q in range(len(stage.devices) // tp)) for stage in plan.stages)
        entries = tuple((name, k) for k, stage in enumerate(plan.stages) for name in stage.layers)
    replicas = grids[0]
    pipeline = len(grids) > 1
    splits = tuple(plan.tp_splits) if tp > 1 else ()
    row_fed = row_fed_columns(splits)
    return RunDescription(plan_name=plan.name, replicas=replicas, groups=groups_of(plan),
                          splits=splits, row_fed=row_fed,
                          num_microbatches=m // joined, global_batch=plan.global_batch,
                          zero_stage=s.zero_stage if len(replicas) > 1 else 0,
                          recompute=s.recompute if recomputed else "none",
                          recomputed=tuple(recomputed), batch_norm=s.batch_norm,
                          offload=s.offload, stages=grids if pipeline else (),
                          stage_of_entry=entries if pipeline else (),
                          schedule=(s.schedule if s.schedule != "none" else "gpipe")
                          if pipeline else "none",
                          virtual_stages=max(1, s.virtual_stages) if pipeline else 1,
                          sequence_parallel=bool(s.sequence_parallel) and tp > 1,
                          cp=max(1, s.cp), ep=max(1, s.ep), joined_microbatches=joined,
                          local=frozenset(d for d in plan.devices if task is not None
                                          and task_of(d) == task),
                          workers=workers_group(plan))
