"""The per-layer table as a plan runs it: each layer's time and memory on one device of
its pipeline stage, and per stage the rows that add up to the plan's predicted peak.

Pipeline position: read by ``reports.tensorboard.plugin_analysis`` (the dashboard's
``analysis.json``, key ``layer_tables``) for the chosen plan and a compared one. Numbers
come from ``planner.pricing.Pricer.arrays`` -- the per-layer, per-device arrays the
search priced the plan with (split layers divided by tp, sequence and context
parallelism applied) -- at the plan's own tp splits (``Plan.tp_splits``; an entry inside
an attention block split by heads counts as split, ``tp_splits.INSIDE``), never
re-derived. Per layer, on one device of its stage:

- state: ``sharding.state_bytes`` of the layer's weights, compute copies, gradients and
  optimizer state under the plan's ZeRO stage over its dp x cp replicas and offloading,
  without the per-device buffers (ZeRO-2/3's unsharded gradient bucket, ZeRO-3's gathered
  weights), which are a stage row;
- activations: its saved bytes per micro-batch x the micro-batches the stage holds in
  flight (``cost_model.microbatches_in_flight``); under "selective" recomputation less
  the attention core's saved bytes; under "full" none (the checkpoints and the working
  set are a stage row: ``pricing.full_recompute_memory`` sets them per chunk, not per
  layer);
- time: forward + backward per micro-batch with its tensor- and context-parallel
  exchanges and its recomputation.

Per stage the rows beyond the layers (ZeRO buffers, recomputation working set or
checkpoints, the memory margin ``cost_model.with_margin_bytes``) make the total equal the
plan's predicted peak for that stage (``Estimate.stage_memory_bytes``); where a plan's
prediction was made another way and differs, a last "difference to the plan's
prediction" row says by how much. Per stage, never per device: the size grows with the
layers, not the cluster.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from tfplan.planner import cost_model as cm
from tfplan.planner import sharding
from tfplan.planner.context import search_context
from tfplan.planner.plan import Plan
from tfplan.planner.pricing import PARTITION_MICROBATCH, Pricer, full_recompute_memory
from tfplan.planner.tp_splits import INSIDE, SplitChoice, attention_units
from tfplan.profiler.model_profile import ModelProfile

# one row of a layer table in analysis.json (rows, not objects: thousands of layers)
FIELDS = ("name", "type", "stage", "split", "params", "flops", "time_s", "state_bytes",
          "activation_bytes", "memory_bytes")


def plan_splits(profile: ModelProfile, plan: Plan) -> tuple[str, ...]:
    """Each profile layer's split in ``plan`` ("" = replicated): ``Plan.tp_splits``, and
    ``INSIDE`` for the entries of an attention block the plan splits by heads."""
    named = dict(plan.tp_splits)
    out = [named.get(l.name, "") for l in profile.layers]
    tp = plan.strategy.tp
    for start, stop in (attention_units(profile, tp) if tp > 1 else {}).items():
        if out[start]:
            out[start + 1:stop] = [INSIDE] * (stop - start - 1)
    return tuple(out)


def _pricer(profile: ModelProfile, plan: Plan) -> Pricer:
    """A Pricer of ``plan``'s model, cluster and batch that splits as the plan does (no
    tensor-parallel ILP is run)."""
    s = plan.strategy
    pricer = Pricer(search_context(profile, plan.cluster, plan.global_batch, s.batch_norm))
    if s.tp > 1:
        pricer.split_choices[s.tp] = SplitChoice(plan_splits(profile, plan), "the plan's",
                                                 0.0, 0.0, s.microbatch_size, None)
    return pricer


def _state(a: dict, sel: np.ndarray, s: Any, replicas: int, zero: int, *, per_layer: bool
           ) -> Any:
    """Weights, gradients and optimizer state of layers ``sel`` as the pricing holds them
    (``Pricer``): per layer (no ZeRO buffers) or summed over them with the largest layer's
    gathered weights and gradient bucket. Mixture-of-experts layers' expert share is
    divided by ep and sharded over the dp / ep ranks that hold the same experts
    (``planner.experts``); the rest over the data-parallel group."""
    ep = max(1, getattr(s, "ep", 1))
    names = ("param", "cw", "grad", "opt")

    def pick(x: np.ndarray) -> Any:
        return x[sel] if per_layer else float(np.sum(x[sel]))

    def largest(x: np.ndarray) -> float:
        return 0.0 if per_layer or not len(sel) else float(np.max(x[sel]))

    if not any(np.any(a["x" + n]) for n in names):  # no experts: one state
        return sharding.state_bytes(*(pick(a[n]) for n in names), replicas=replicas,
                                    zero_stage=zero, offload=s.offload,
                                    largest_gather=largest(a["gather"]),
                                    largest_grad=largest(a["grad"]))
    xgather = np.where(a["cw"] > 0, a["xcw"], a["xparam"])
    expert_replicas = replicas // ep
    return sharding.state_bytes(
        *(pick(a[n] - a["x" + n]) for n in names), replicas=replicas, zero_stage=zero,
        offload=s.offload, largest_gather=largest(a["gather"] - xgather * (1 - 1 / ep)),
        largest_grad=largest(a["grad"] - a["xgrad"] * (1 - 1 / ep))) \
        + sharding.state_bytes(*(pick(a["x" + n] / ep) for n in names),
                               replicas=expert_replicas,
                               zero_stage=zero if expert_replicas > 1 else 0,
                               offload=s.offload, largest_gather=0.0, largest_grad=0.0)


def _r(x: float) -> float:
    return float(f"{x:.4g}")


def layer_table(profile: ModelProfile, plan: Plan) -> dict:
    """``plan``'s layer table (module docstring): {"plan", "fields", "rows" (one per
    layer, FIELDS, stage order), "stages": [{"stage", "layers_bytes", "rows": [{"label",
    "bytes"}], "total_bytes", "peak_memory_bytes"}]}."""
    s = plan.strategy
    pp, v, tp, mbs = s.pp, max(1, s.virtual_stages), s.tp, s.microbatch_size
    pricer = _pricer(profile, plan)
    a = pricer.arrays(tp, mbs, s.sequence_parallel, s.cp)
    splits = pricer.splits_for(tp)
    index = {l.name: i for i, l in enumerate(profile.layers)}
    replicas = s.replicas
    zero = s.zero_stage if replicas > 1 else 0
    state = _state(a, np.arange(len(profile.layers)), s, replicas, zero, per_layer=True)
    if s.recompute == "full":
        kept = np.zeros(len(profile.layers))
        time = a["fwd"] + a["bwd"] + a["tpf"] + a["tpb"] + a["cpf"] + a["cpb"] \
            + a["fwd"] + a["tpf"] + a["cpf"]
    elif s.recompute == "selective":
        kept = a["act"] - a["core_act"]
        time = a["fwd"] + a["bwd"] + a["tpf"] + a["tpb"] + a["cpf"] + a["cpb"] + a["core_fwd"]
    else:
        kept = a["act"]
        time = a["fwd"] + a["bwd"] + a["tpf"] + a["tpb"] + a["cpf"] + a["cpb"]
    in_flight = [cm.microbatches_in_flight(s.schedule, pp - d, s.num_microbatches, v)
                 for d in range(pp)]
    f = mbs / profile.batch_size
    chunks: list[list[int]] = [[] for _ in range(pp)]  # chunk indices per pipeline device
    layers_of: list[list[int]] = [[] for _ in range(pp)]
    for k, st in enumerate(plan.stages):
        chunks[k % pp].append(k)
        layers_of[k % pp] += [index[n] for n in st.layers if n in index]
    if s.recompute == "full":  # as Pricer._full_recompute: per chunk at a reference size
        ref = pricer.arrays(tp, PARTITION_MICROBATCH, s.sequence_parallel, s.cp)
        full = []
        for st in plan.stages:
            ids = np.array([index[n] for n in st.layers if n in index], dtype=int)
            full.append(full_recompute_memory(ref["inp"][ids], ref["act"][ids], pp)
                        if len(ids) else (0.0, 0.0))
        scale = mbs / PARTITION_MICROBATCH
    predicted = dict(plan.predicted.peak_memory_bytes_per_device)
    rows, stages = [], []
    for d in range(pp):
        ids = layers_of[d]
        for i in ids:
            l = profile.layers[i]
            work = (tp if splits[i] else 1) * s.cp
            act = float(kept[i]) * in_flight[d]
            rows.append([l.name, l.type, d, bool(splits[i]),
                         round(l.params / (tp if splits[i] else 1)),
                         _r((l.flops_fwd + l.flops_bwd) * f / work), _r(time[i]),
                         round(state[i]), round(act), round(state[i] + act)])
        sel = np.array(ids, dtype=int)
        layer_sum = float(np.sum(state[sel]) + np.sum(kept[sel]) * in_flight[d])
        held = float(_state(a, sel, s, replicas, zero, per_layer=False))
        extra = []
        buffers = held - float(np.sum(state[sel]))
        if abs(buffers) >= 1:
            extra.append(("ZeRO/offload buffers (largest layer's gathered weights and "
                          "gradient bucket)", buffers))
        if s.recompute == "full":
            kept_b = sum(full[k][0] for k in chunks[d]) * scale
            working = max((full[k][1] for k in chunks[d]), default=0.0) * scale
            extra.append(("activations: full recomputation's checkpoints in flight and "
                          "working set", kept_b * in_flight[d] + working))
        elif s.recompute == "selective":
            working = 0.0
            for k in chunks[d]:
                ids_k = [index[n] for n in plan.stages[k].layers if n in index]
                working = max(working, max((float(a["core_act"][i]) for i in ids_k),
                                           default=0.0))
            if working:
                extra.append(("activations: attention core being recomputed (working set)",
                              working))
        raw = layer_sum + sum(b for _, b in extra)
        margin = float(np.ceil(cm.with_margin_bytes(raw))) - raw
        extra.append(("memory margin (cost_model.with_margin_bytes)", margin))
        total = raw + margin
        peak = max((predicted.get(dev, 0) for dev in plan.stages[d].devices), default=0) \
            if d < len(plan.stages) else 0
        if peak and abs(peak - total) >= 1:
            extra.append(("difference to the plan's prediction", peak - total))
            total = float(peak)
        stages.append({"stage": d, "layers_bytes": round(layer_sum),
                       "rows": [{"label": lab, "bytes": round(b)} for lab, b in extra],
                       "total_bytes": round(total), "peak_memory_bytes": int(peak)})
    return {"plan": plan.name, "fields": list(FIELDS), "rows": rows, "stages": stages}
