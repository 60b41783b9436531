"""An attention block split by heads on the SPMD engine: each tensor rank's copy of the block
keeps its own heads and runs the block's own ``call``.

Pipeline position: ``apply.spmd.copies`` calls ``split_block`` for a plan's
``(block, "heads")`` entry whose layer is an attention block that is not Keras'
MultiHeadAttention (``profiler.attention_blocks.attention_block``: keras_hub's
``LlamaAttention``, ``CachedGemmaAttention``, ``CachedMixtralAttention``, a user's), in the
rank's copy, once the copy is built. (``apply.sharded_attention_block`` is the older
engine's form: one view of the block per rank, the ranks' outputs summed on one device.)

Megatron-LM's attention split (Shoeybi et al. 2019, Sec. 3): rank t holds query heads
[t q/tp, (t+1) q/tp) and key/value heads [t kv/tp, (t+1) kv/tp) (tp divides kv; each
query group stays with its key/value head):

* the block's *input* projections (query, key, value: EinsumDense with a heads output axis)
  become ``RankHeadsProjection`` twins holding their kernel's (and bias's) slice along that
  axis; its *output* projection's twin holds the kernel's slice along its contracted heads
  axis, all-reduces its partial product over the tp group (Megatron's g) and adds the whole
  bias once after it;
* its head-count attributes (``AttentionBlock.heads_attributes``) hold q/tp and kv/tp, so
  the block's own reshapes and groupings see the rank's heads;
* its ``call`` gets Megatron's f on its input (identity forward, the gradient all-reduced
  over tp backward): one all-reduce for the three projections, as ``planner.traffic``
  prices self-attention.

The rotary embedding, softmax, dropout and norms inside act per head and are the copy's
own. A block whose ``call`` mixes heads or reads a head count other than its
``heads_attributes`` would train wrong, so before training ``check_split_blocks`` runs
replica 0's ranks of every split block, in one traced function (their all-reduces meet),
on a random input shaped as the block was built (with an all-ones attention mask where its
call takes one), and refuses the plan unless each rank's
output equals the user's block's (rtol 1e-5; 2e-2 at 16-bit compute).
"""
from __future__ import annotations

import functools
import inspect
from typing import Any

import numpy as np

from tfplan import compat
from tfplan.apply.layer_tree import scopes_of
from tfplan.core.errors import PlannerError
from tfplan.apply.spmd.megatron import copy_to_tp
from tfplan.apply.spmd.rank_layers import Rank, RankHeadsProjection
from tfplan.profiler.signature import layer_config


def split_block(block: Any, rank: Rank, device: str) -> None:
    """``block`` (a rank's copy, built) split by heads in place (module docstring)."""
    import tensorflow as tf

    from tfplan.apply.blocks import swap_in
    from tfplan.profiler.attention_blocks import attention_block

    info = attention_block(block)
    tp = rank.size
    for p in info.projections:
        twin = RankHeadsProjection(rank, p.role, p.heads_axis, **layer_config(p.layer))
        with tf.device(device), scopes_of(p.layer):
            twin.build(**compat.build_arguments(p.layer))
        swap_in(block, p.layer, twin)
    for name in info.heads_attributes:
        setattr(block, name, getattr(block, name) // tp)
    call = block.call
    first = next(iter(inspect.signature(call).parameters))  # the input (hidden states)

    @functools.wraps(call)
    def split_call(*args: Any, **kwargs: Any) -> Any:
        if args:
            args = (copy_to_tp(args[0], rank.group, rank.device), *args[1:])
        else:
            kwargs[first] = copy_to_tp(kwargs[first], rank.group, rank.device)
        return call(*args, **kwargs)

    block.call = split_call
    block.is_split_by_heads = True


RTOL = 1e-5
RTOL_16_BIT = 2e-2  # a float16/bfloat16 block: sums in another order (a head mixed: O(1))


def check_split_blocks(models: Any, template: Any, run: Any) -> None:
    """Refuse a plan whose attention block split by heads does not compute each head apart
    (module docstring): the ranks this process runs of its first replica (``models[q]``,
    every rank of replica 0 on one host) against ``template``'s block."""
    import tensorflow as tf

    from tfplan.apply.collective_ops import instance_scope
    from tfplan.profiler.signature import profiled_layer_paths

    names = [name for name, split in run.splits if split == "heads"]
    if not names:
        return
    user = dict(profiled_layer_paths(template))
    q = next(q for q, row in enumerate(models) if any(m is not None for m in row))
    ranks = [dict(profiled_layer_paths(copy)) for copy in models[q] if copy is not None]
    for name in names:
        blocks = [r.get(name) for r in ranks]
        if not all(getattr(b, "is_split_by_heads", False) for b in blocks):
            continue
        original = user[name]
        shape = next(iter(compat.build_arguments(original).values()))
        shape = [2 if d is None and i == 0 else 4 if d is None else int(d)
                 for i, d in enumerate(shape)]
        rng = np.random.default_rng(0)
        x = tf.constant(rng.normal(size=shape).astype(original.compute_dtype))
        kwargs: dict[str, Any] = {"training": False}
        if "attention_mask" in inspect.signature(original.call).parameters and len(shape) == 3:
            kwargs["attention_mask"] = tf.ones((shape[0], shape[1], shape[1]), tf.int32)
        where = (f"Plan {run.plan_name!r} splits attention block {name!r} "
                 f"({type(original).__name__}) by heads")
        devices = [_device_of_block(b) for b in blocks]

        @tf.function(autograph=False)
        def ranked() -> list[Any]:
            with instance_scope("check"):
                out = []
                for block, device in zip(blocks, devices):
                    with tf.device(device):
                        out.append(block(x, **kwargs))
                return out

        with tf.init_scope():
            want = np.asarray(original(x, **kwargs))
            got = [np.asarray(y) for y in ranked()]
        scale = float(np.max(np.abs(want))) if want.size else 0.0
        rtol = RTOL if original.compute_dtype == "float32" else RTOL_16_BIT
        if any(g.shape != want.shape or not np.allclose(g, want, rtol=rtol, atol=rtol * scale)
               for g in got):
            raise PlannerError(
                f"{where}, but the sum of its ranks' outputs differs from the unsplit "
                "block's on a random input: its call does not compute each head apart from "
                "the others (or it reads a head count other than its head-count "
                "attributes). Leave it whole: split its projections column/row, or remove "
                "it from tp_splits.")


def _device_of_block(block: Any) -> str:
    """The device a split block's rank runs on (its projections' rank's)."""
    for layer in block._flatten_layers(include_self=False):
        rank = getattr(layer, "tp_rank", None)
        if rank is not None:
            return rank.device
    raise PlannerError(f"Attention block {block.name!r} holds no rank projection.")
