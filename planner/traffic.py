"""What each device sends per step, by kind: the bytes behind the priced communication.

Pipeline position: beside ``planner.pricing``, which prices the same transfers in seconds.
``sent_bytes_per_device`` is called once per plan the search returns (``planner.search``)
and its answer is ``Prediction.sent_bytes_per_device`` in plan.json, ``--json`` and
``plan report``; ``apply.audit`` measures the same quantities in a wrapped model's traced
step, so the two can be compared device by device.

Every figure is bytes one device puts on a link per training step (all micro-batches),
from the same per-layer payloads the pricing uses (``profiler.comm``, ``planner.sequence``,
``planner.experts``) and the per-member volumes of ``planner.collectives``
(``ring_allreduce_sent_bytes``: 2 (n-1)/n N; ``ring_half_sent_bytes``: (n-1)/n N). With
m micro-batches of f = mbs / b of the profile batch, a chunk of layers L on a device:

* ``tp``: m (1 + [full recomputation]) 2 (tp-1)/tp sum_L fwd_i f / cp
  + m 2 (tp-1)/tp sum_L bwd_i f / cp, the Megatron f/g all-reduces of each split layer
  (sequence parallelism's all-gather + reduce-scatter pairs move the same bytes), and
  m (1 + [full]) (tp-1)/tp out_i f / cp for a layer whose output, cut by a column
  split, its ranks all-gather (``gathered_outputs``, as ``apply.spmd.layout`` does: a
  model's last projection, whose whole output the loss reads); under sequence
  parallelism, one all-reduce per step of the gradients of the weights read on
  sequence pieces is not counted (norms' scales and biases: bytes of the hidden size);
* ``pp``: per chunk boundary and micro-batch, N = the boundary activation's bytes f / cp,
  both sides send N: the activation forward and its gradient back, each as tp slices of
  N / tp plus the receiving ranks' all-gather of the other (tp-1)/tp N (Narayanan et al.,
  SC'21, Sec. 4.1, as ``collectives.pipeline_send_time_s`` prices it); under sequence
  parallelism a boundary activation cut by sequence (``sequence_cut_outputs``) is sent
  as each rank's piece, N / tp;
* ``dp``: the gradient reduction over the R = dp x cp replicas of the device's weights
  (G: their gradient bytes, 1/tp of a split layer's): 2 (R-1)/R G per step without ZeRO;
  (R-1)/R G (a reduce-scatter) per step under ZeRO-1 and per micro-batch under ZeRO-2/3;
  An Embedding's gradient is sparse (``tf.IndexedSlices``: one row per looked-up token,
  as one device's Keras optimizer receives it): its replicas all-gather their rows and
  ids instead, (R-1) x their bytes per device (``sparse_grad_bytes``; what ``apply.spmd``
  and ``tf.distribute`` run, exact where a summed dense gradient would change Adam's
  second moment), under ZeRO too (``apply.spmd.zero``: each replica keeps the rows
  of its shard), the updated weight then all-gathered (kind ``zero``, (R-1)/R P; under
  ZeRO-3 the table is gathered once per micro-batch for the lookup instead, m (R-1)/R W:
  its backward reads no weights, so the recomputed forward's gather is never run);
* BatchNormalization statistics under ``global`` (``planner.batch_stats``): per layer and
  step, ``ALLREDUCES_PER_LAYER`` all-reduces of its C float32 values over the replicas
  (``channels``), kind ``dp``; under ``local``, one all-reduce of its 2 C moving-statistics
  values per step (their one update, the replicas' mean: ``apply.spmd.batch_norm``);
* ``zero``: what ZeRO adds, the all-gathers: of the updated weights after the step,
  (R-1)/R G under ZeRO-1 (priced at the gradients' size, as ``pricing`` does) and
  (R-1)/R P under ZeRO-2; of each layer's compute weights W before its forward and its
  backward under ZeRO-3, 2 m (R-1)/R W (Rajbhandari et al., SC'20, Sec. 5 and 7); an
  expert shard's over the R / ep replicas of its ep rank;
* ``cp``: per attention layer and micro-batch, the all-gather of the whole sequence's
  keys and values (kv f / k, k = tp for a head-split layer) in the forward and its
  reduce-scatter in the backward, 2 (cp-1)/cp each (and the forward again under full
  recomputation);
* ``ep``: per mixture-of-experts layer and micro-batch, ``experts.ALL_TO_ALLS_PER_LAYER``
  all-to-alls (2 more under full recomputation) of its dispatch payload D f c / cp, of
  which (ep-1)/ep leaves the device; experts' gradients reduce over R / ep copies
  (under ZeRO their shards are gathered there too, kind ``zero``).

Host transfers (offload) are not device-to-device sends and are not listed.
"""
from __future__ import annotations

from typing import Any, Sequence

from tfplan.planner import experts
from tfplan.planner.collectives import ring_allreduce_sent_bytes, ring_half_sent_bytes
from tfplan.planner.sequence import has_sequence, kv_bytes, sequence_parallel_layers
from tfplan.profiler.comm import HEAD_SPLIT_TYPES, profile_comm
from tfplan.profiler.model_profile import ModelProfile

KINDS = ("tp", "pp", "dp", "zero", "cp", "ep")  # Prediction.sent_bytes_per_device's keys
BATCH_NORM_TYPES = ("BatchNormalization",)  # layers whose statistics batch_norm governs
ALLREDUCES_PER_LAYER = 5  # forward: count, sum, squared deviations; backward: two sums
STAT_BYTES = 4  # float32: Keras computes BatchNormalization's statistics in float32

DeviceBytes = tuple[tuple[str, tuple[tuple[str, int], ...]], ...]  # (device, ((kind, bytes)))


def sent_bytes_per_device(profile: ModelProfile, strategy: Any, bounds: Sequence[tuple[int, int]],
                          splits: Sequence[str], chunk_devices: Sequence[Sequence[str]]
                          ) -> DeviceBytes:
    """Bytes each device sends per step, by kind (``KINDS``; module docstring).

    ``strategy``: a ``Strategy`` or ``Choice`` (dp, tp, pp, cp, ep, micro-batches,
    recompute, zero_stage); ``bounds[k]``: chunk k's [start, stop) in ``profile.layers``'
    order, on pipeline device k % pp; ``splits[i]``: layer i's tensor-parallel split ("" when
    replicated; any other value divides its state by tp); ``chunk_devices[k]``: the devices
    that run chunk k (a plan's ``stages[k].devices``)."""
    layers = profile.layers
    b = profile.batch_size
    tp, cp, ep = strategy.tp, strategy.cp, max(1, strategy.ep)
    m, mbs = strategy.num_microbatches, strategy.microbatch_size
    replicas = strategy.dp * cp
    zero = strategy.zero_stage if replicas > 1 else 0
    # ZeRO-3 recomputes each layer's forward in its backward (``apply.spmd.zero3``): its
    # forward collectives run twice, as under full recomputation
    full = strategy.recompute == "full" or zero == 3
    f = mbs / b
    per_device: dict[str, dict[str, float]] = {}
    comms = profile_comm(profile)
    all_gathered = gathered_outputs(layers, splits)  # cut outputs the tp ranks gather
    sequence_cut = sequence_cut_outputs(profile, splits) \
        if getattr(strategy, "sequence_parallel", False) and tp > 1 else frozenset()
    for k, (lo, hi) in enumerate(bounds):
        sent = dict.fromkeys(KINDS, 0.0)
        grads = dense_grads = expert_grads = weights = gathered = sparse = 0.0
        expert_weights = expert_gathered = 0.0
        sparse_weights = sparse_tables = 0.0
        for i in range(lo, hi):
            layer = layers[i]
            split = splits[i] if i < len(splits) else ""
            share = tp if split else 1
            comm = comms[i]
            s = next((x for x in comm.tp_splits if x.split == split), None)
            if s is not None and tp > 1:
                fwd = s.fwd_allreduce_bytes * f / cp
                sent["tp"] += m * (2 if full else 1) * ring_allreduce_sent_bytes(fwd, tp)
                sent["tp"] += m * ring_allreduce_sent_bytes(s.bwd_allreduce_bytes * f / cp, tp)
            if i in all_gathered and tp > 1:
                sent["tp"] += m * (2 if full else 1) * ring_half_sent_bytes(
                    layer.activation_bytes * f / cp, tp)
            if cp > 1 and layer.kind in HEAD_SPLIT_TYPES:
                kv = kv_bytes(layer) * f / share
                sent["cp"] += m * (3 if full else 2) * ring_half_sent_bytes(kv, cp)
            if ep > 1 and layer.is_moe:
                calls = experts.ALL_TO_ALLS_PER_LAYER + (2 if full else 0)
                sent["ep"] += m * calls * ring_half_sent_bytes(
                    experts.dispatch_bytes(layer, mbs, b) / cp, ep)
            if replicas > 1 and layer.kind in BATCH_NORM_TYPES:
                if getattr(strategy, "batch_norm", "global") == "global":
                    sent["dp"] += ALLREDUCES_PER_LAYER * ring_allreduce_sent_bytes(
                        channels(layer) * STAT_BYTES, replicas)
                else:  # local: the moving mean and variance averaged once per step
                    sent["dp"] += ring_allreduce_sent_bytes(
                        2 * channels(layer) * STAT_BYTES, replicas)
            rows = sparse_grad_bytes(layer, profile.precision) * f * m / cp
            if rows and replicas > 1:
                sparse += rows
                if zero == 3:  # its table gathered for each micro-batch's lookup only
                    sparse_tables += (layer.compute_weight_bytes or layer.param_bytes) / share
                else:
                    sparse_weights += layer.param_bytes / share  # ZeRO-1/2: gathered after
                continue  # no dense gradient to reduce
            g = layer.grad_bytes / share
            x = experts.expert_share(layer) if ep > 1 else 0.0
            grads += g
            dense_grads += g * (1 - x)
            expert_grads += g * x / ep
            weights += layer.param_bytes / share * (1 - x)
            expert_weights += layer.param_bytes / share * x / ep
            w = (layer.compute_weight_bytes or layer.param_bytes) / share
            gathered += w * (1 - x)
            expert_gathered += w * x / ep
        if hi < len(layers):  # the boundary: activation forward, its gradient back
            nbytes = layers[hi - 1].activation_bytes * f / cp
            if hi - 1 in sequence_cut:  # each rank sends its piece of the sequence
                nbytes /= tp
            sent["pp"] += m * nbytes
            if k + 1 < len(bounds):
                _add(per_device, chunk_devices[k + 1], {"pp": m * nbytes})
        if replicas > 1:
            groups = ((dense_grads, replicas), (expert_grads, replicas // ep)) if ep > 1 \
                else ((grads, replicas),)
            for g, n in groups:
                if zero == 0:
                    sent["dp"] += ring_allreduce_sent_bytes(g, n)
                elif zero == 1:
                    sent["dp"] += ring_half_sent_bytes(g, n)
                    sent["zero"] += ring_half_sent_bytes(g, n)
                else:
                    sent["dp"] += m * ring_half_sent_bytes(g, n)
            sent["dp"] += (replicas - 1) * sparse
            if zero in (1, 2):  # the updated shards of sparse-gradient weights, gathered
                sent["zero"] += ring_half_sent_bytes(sparse_weights, replicas)
            if zero == 2:  # an expert shard's over the replicas of its ep rank
                sent["zero"] += ring_half_sent_bytes(weights, replicas)
                if ep > 1:
                    sent["zero"] += ring_half_sent_bytes(expert_weights, replicas // ep)
            elif zero == 3:  # an expert shard's over the replicas of its ep rank
                sent["zero"] += 2 * m * ring_half_sent_bytes(gathered, replicas)
                if ep > 1:
                    sent["zero"] += 2 * m * ring_half_sent_bytes(expert_gathered,
                                                                 replicas // ep)
                sent["zero"] += m * ring_half_sent_bytes(sparse_tables, replicas)
        _add(per_device, chunk_devices[k], sent)
    return tuple((d, tuple((kind, int(round(v.get(kind, 0.0)))) for kind in KINDS))
                 for d, v in per_device.items())


def placement_sent_bytes(profile: ModelProfile, plan: Any) -> DeviceBytes:
    """``plan_sent_bytes`` of a general placement (one micro-batch, dp = tp = 1): a layer's
    output goes once to each other device that runs a layer reading it, and that device
    sends its gradient back (``apply.spmd.pipeline``: one copy per receiving device), both
    kind ``pp``, N = the tensor's bytes for the global batch (the profile's edges)."""
    device_of = plan.device_of_layer()
    scale = plan.global_batch / profile.batch_size
    tensor: dict[tuple[str, str], float] = {}  # (producer, receiving device) -> bytes
    for edge in profile.edges:
        src, dst = device_of.get(edge.src), device_of.get(edge.dst)
        if src is None or dst is None or src == dst:
            continue
        key = (edge.src, dst)
        tensor[key] = max(tensor.get(key, 0.0), edge.bytes * scale)
    per_device: dict[str, dict[str, float]] = {}
    _add(per_device, [d for stage in plan.stages for d in stage.devices], {})
    for (producer, dst), nbytes in tensor.items():
        _add(per_device, [device_of[producer], dst], {"pp": nbytes})
    return tuple((d, tuple((kind, int(round(v.get(kind, 0.0)))) for kind in KINDS))
                 for d, v in per_device.items())


def channels(layer: Any) -> int:
    """C: the values of one statistic of a BatchNormalization layer (the output's last
    axis, Keras' default ``axis=-1``; the parameters / 4 when the shape is unknown)."""
    shape = layer.output_shape
    if shape and shape[-1]:
        return int(shape[-1])
    return max(1, layer.params // 4)


SPARSE_GRAD_TYPES = ("Embedding",)
INDEX_BYTES = 4  # an id (int32, as Keras' Embedding casts its inputs)


def sparse_grad_bytes(layer: Any, precision: str) -> float:
    """Bytes of the sparse gradient of ``layer`` for the profile batch (0: a dense one): an
    Embedding's rows, one per looked-up token (its output's elements at the gradient's
    itemsize, the variable's float32) plus each row's id."""
    if layer.kind not in SPARSE_GRAD_TYPES or not layer.trainable_params:
        return 0.0
    act_itemsize = 2 if precision.startswith("mixed_") else 4
    elements = layer.activation_bytes / act_itemsize
    width = (layer.output_shape or (None,))[-1]
    tokens = elements / width if width else 0.0
    return elements * (layer.grad_bytes / layer.trainable_params) + tokens * INDEX_BYTES


# layers that act on each element alone and pass a column split's cut output through
# (SwiGLU's gate * up): they run on the cut pieces (``apply.spmd.sequence``)
PASS_THROUGH_TYPES = ("Add", "Subtract", "Multiply", "Average", "Maximum", "Minimum",
                      "Dropout")


def gathered_outputs(layers: Sequence[Any], splits: Sequence[str]) -> frozenset[int]:
    """Indices of the layers whose output, cut along its last axis by a column split, the
    tensor-parallel ranks all-gather (``apply.spmd``'s layout does the same on the graph).

    A top-level column split's output is cut; so is that of a pass-through layer
    (``PASS_THROUGH_TYPES``) all of whose inputs are cut. A cut output is gathered where a
    layer other than a row split or such a pass-through reads it, and where it is a
    model output (nothing reads it). Inside blocks, whose graph the profile does not
    hold, a column split is gathered unless the next split layer is a row split
    (``row_follows``) or a run of column splits of the same block that a row split of
    that block ends (``block_columns_end_in_row``: parallel projections, SwiGLU's gate and
    up, as ``apply.spmd.run.row_fed_columns`` keeps them cut); so is every column where the
    profile has no layer inputs."""
    has_graph = any(l.inputs for l in layers)
    cut: set[str] = set()
    gathered: set[int] = set()
    readers: dict[str, list[int]] = {}
    for j, l in enumerate(layers):
        for name in l.inputs:
            readers.setdefault(name, []).append(j)
    for i, l in enumerate(layers):
        split = splits[i] if i < len(splits) else ""
        if split == "column" and (l.block or not has_graph):
            if not (row_follows(splits, i) or l.block and block_columns_end_in_row(
                    [(layers[j].block, splits[j]) for j in range(i, len(splits)) if splits[j]])):
                gathered.add(i)
        elif split == "column" or (not split and l.type in PASS_THROUGH_TYPES and l.inputs
                                   and all(x in cut for x in l.inputs)):
            cut.add(l.name)
    for i, l in enumerate(layers):
        if l.name not in cut:
            continue
        reads = readers.get(l.name, [])
        if not reads or any(not ((splits[j] if j < len(splits) else "") == "row"
                                 or layers[j].name in cut) for j in reads):
            gathered.add(i)
    return frozenset(gathered)


def sequence_cut_outputs(profile: ModelProfile, splits: Sequence[str]) -> frozenset[int]:
    """Under sequence parallelism, the layers whose output each tensor rank holds a 1/tp
    piece of the sequence of (``apply.spmd.layout``): the per-token layers it splits
    (``planner.sequence.sequence_parallel_layers``) and the row, heads and vocabulary
    splits on a sequence (their reduce-scatter)."""
    splits = tuple(splits) + ("",) * (len(profile.layers) - len(splits))
    local = sequence_parallel_layers(profile, splits)
    return frozenset(i for i, l in enumerate(profile.layers)
                     if local[i] or (splits[i] in ("row", "heads", "vocab") and has_sequence(l)))


def block_columns_end_in_row(splits: Sequence[tuple[str, str]]) -> bool:
    """Whether the first of ``splits`` ((block, kind) of each split layer in order, a
    column split inside a block first) is followed by column splits of its block up to a
    row split of its block: parallel projections that meet before the row split (the
    planner's pricing and ``apply.spmd.run.row_fed_columns`` share this rule)."""
    block = splits[0][0]
    for other, kind in splits[1:]:
        if other != block:
            return False
        if kind == "row":
            return True
        if kind != "column":
            return False
    return False


def row_follows(splits: Sequence[str], i: int) -> bool:
    """Whether the next split layer after layer i is a row split (a column split's output
    then stays cut: Megatron's pair; otherwise its ranks all-gather it)."""
    after = next((x for x in splits[i + 1:] if x), "")
    return after == "row"


def _add(per_device: dict[str, dict[str, float]], devices: Sequence[str],
         sent: dict[str, float]) -> None:
    for d in devices:
        row = per_device.setdefault(d, dict.fromkeys(KINDS, 0.0))
        for kind, v in sent.items():
            row[kind] += v


def total_by_kind(sent: DeviceBytes) -> dict[str, int]:
    """Each kind's bytes summed over the devices."""
    out = dict.fromkeys(KINDS, 0)
    for _, kinds in sent:
        for kind, v in kinds:
            out[kind] += v
    return out


def plan_sent_bytes(profile: ModelProfile, plan: Any) -> DeviceBytes:
    """``sent_bytes_per_device`` of a stage plan (``planner.plan.Plan``) for ``profile``: its
    stages' layers as chunks (each a run of consecutive layers of the profile) and its
    ``tp_splits`` (a general placement: ``placement_sent_bytes``). A layer the profile does not name is
    skipped. Layers inside an attention block split whole are counted unsplit (the search
    divides their state by tp; the plan file does not name them)."""
    if plan.placement != "stages":
        return placement_sent_bytes(profile, plan)
    index = {layer.name: i for i, layer in enumerate(profile.layers)}
    bounds = []
    for stage in plan.stages:
        found = [index[n] for n in stage.layers if n in index]
        bounds.append((min(found), max(found) + 1) if found else (0, 0))
    split_of = dict(plan.tp_splits)
    splits = tuple(split_of.get(layer.name, "") for layer in profile.layers)
    return sent_bytes_per_device(profile, plan.strategy, bounds, splits,
                                 [stage.devices for stage in plan.stages])
