"""The strategy search's inputs, checked once: ``SearchContext`` and ``search_context``.

Pipeline position: built by ``planner.search.search`` from a ``ModelProfile``, a
``ClusterSpec`` and the global batch, then handed to everything that prices a
candidate for it (``planner.search`` itself, ``planner.pricing``,
``planner.candidates``, ``planner.placement_search``); it sits below all of them.
Besides the inputs it holds the layer graph in index form (topological order, model
inputs charged to the first layer that reads them, tensors with their readers) and
turns a priced breakdown into a ``Plan`` (``SearchContext.plan``).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import PlannerError
from tfplan.planner import cost_model as cm
from tfplan.planner.graph import input_edges, layer_graph, pipeline_units, topological_layers
from tfplan.planner.plan import BATCH_NORM, Breakdown, Plan, Prediction, Stage, Strategy
from tfplan.planner.traffic import BATCH_NORM_TYPES, plan_sent_bytes
from tfplan.profiler.model_profile import ModelProfile



@dataclass(frozen=True)
class SearchContext:
    """The search's inputs, checked once, plus the layer graph in index form."""

    profile: ModelProfile
    cluster: ClusterSpec
    global_batch: int
    names: tuple[str, ...]  # topological layer order
    input_bytes: tuple[float, ...]  # per layer: model-input bytes charged to it (profile batch)
    tensors: tuple[tuple[int, tuple[int, ...], int], ...]  # (producer, readers, bytes)
    # Strategy.batch_norm of every candidate (planner.batch_stats); True below when
    # "global" statistics join a pipeline's micro-batches: GPipe order only
    batch_norm: str = "global"
    batch_barrier: bool = False
    # [start, stop) of each unit a stage boundary may not cut (a block, or one layer:
    # ``graph.pipeline_units``); () means one unit per layer
    units: tuple[tuple[int, int], ...] = ()

    @property
    def pipeline_units(self) -> tuple[tuple[int, int], ...]:
        return self.units or tuple((i, i + 1) for i in range(len(self.names)))

    def unit_bounds(self, bounds: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
        """Stage bounds over units turned into bounds over layers."""
        units = self.pipeline_units
        return tuple((units[a][0], units[b - 1][1]) for a, b in bounds)

    def layer_times_s(self, samples: float) -> tuple[float, ...]:
        p = self.profile
        return tuple(cm.layer_pass_time_s(l, samples, p.batch_size, self.cluster.device,
                                          p.precision, p.measured_batch_size)
                     for l in p.layers)

    def layer_memories_bytes(self, samples_in_flight: float) -> tuple[float, ...]:
        p = self.profile
        return tuple(cm.layer_memory_bytes(l, samples_in_flight, p.batch_size, self.input_bytes[i])
                     for i, l in enumerate(p.layers))

    def plan(self, name: str, strategy: Strategy, stages: tuple[Stage, ...],
             breakdown: Breakdown, memory: tuple[tuple[str, int], ...], solver: str,
             consecutive: bool = True) -> Plan:
        """A ``Plan`` of this model on this cluster from a priced breakdown (the
        framework's step overhead added) and each device's memory; hardware FLOP/s are
        the model's (no recomputation in the candidates built this way). ``consecutive``:
        each stage is a run of consecutive layers (its bytes sent per device are listed,
        ``planner.traffic``; a general placement's are not yet)."""
        p = self.profile
        breakdown = cm.with_step_overhead(breakdown, p.measured_step_overhead_s)
        step_s = breakdown.total_s
        flops_per_sample = (p.flops_fwd + p.flops_bwd) / p.batch_size
        plan = Plan(
            name=name, model_name=p.model_name, model_fingerprint=p.fingerprint,
            model_signature=p.signature(), model_output_shapes=p.output_shapes(),
            model_input_shapes=p.input_shapes,
            cluster=self.cluster, global_batch=self.global_batch,
            precision=p.precision, optimizer=p.optimizer, strategy=strategy, stages=stages,
            predicted=Prediction(
                step_time_s=step_s, breakdown=breakdown, peak_memory_bytes_per_device=memory,
                memory_capacity_bytes=self.cluster.device.memory_bytes,
                samples_per_s=self.global_batch / step_s,
                model_tflops_per_device=cm.model_tflops_per_device(
                    flops_per_sample, self.global_batch, step_s, strategy.num_devices),
                hardware_tflops_per_device=cm.model_tflops_per_device(  # no recomputation here
                    flops_per_sample, self.global_batch, step_s, strategy.num_devices)),
            solver=solver)
        if not consecutive:
            return plan
        return replace(plan, predicted=replace(
            plan.predicted, sent_bytes_per_device=plan_sent_bytes(p, plan)))


def search_context(profile: ModelProfile, cluster: ClusterSpec, global_batch: int,
                   batch_norm: str = "global") -> SearchContext:
    """The ``SearchContext`` of a search; PlannerError for a batch that is not a whole
    number >= 1 or a profile without layers."""
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise PlannerError(f"Global batch is {global_batch!r}; expected a whole number of "
                           "samples >= 1 (e.g. --global-batch 512).")
    if not profile.layers:
        raise PlannerError(f"Profile of {profile.model_name!r} has no layers; nothing to plan. "
                           "Check that the model has layers with work in them.")
    names = topological_layers(profile)
    index = {name: i for i, name in enumerate(names)}
    inputs = [0.0] * len(names)
    by_input: dict[str, list] = {}
    for e in input_edges(profile):
        by_input.setdefault(e.src, []).append(e)
    for edges in by_input.values():  # charged once, to the first layer that reads it
        inputs[min(index[e.dst] for e in edges)] += max(e.bytes for e in edges)
    graph = layer_graph(profile)
    units = pipeline_units(profile)
    unit_of = [k for k, (start, stop) in enumerate(units) for _ in range(start, stop)]
    tensors = []
    for u in names:  # tensors inside a block never cross a stage boundary: left out
        readers = sorted(index[v] for v in graph.successors(u)
                         if unit_of[index[v]] != unit_of[index[u]])
        if readers:
            nbytes = max(graph.edges[u, names[v]]["bytes"] for v in readers)
            tensors.append((index[u], tuple(readers), nbytes))
    if batch_norm not in BATCH_NORM:
        raise PlannerError(f"batch_norm is {batch_norm!r}; expected one of {BATCH_NORM}.")
    barrier = batch_norm == "global" and any(l.kind in BATCH_NORM_TYPES for l in profile.layers)
    return SearchContext(profile, cluster, global_batch, names, tuple(inputs), tuple(tensors),
                         batch_norm, barrier, units if len(units) < len(names) else ())
