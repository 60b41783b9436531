"""Which of a plan's strategy dimensions ``apply`` runs, and the error for the others.

Pipeline position: ``apply.wrap`` calls ``check_applicable(plan, mode)`` right after the
mode is decided (``apply.mode``), before any model is built, so a plan with a dimension
no engine here runs is refused with what to change, never trained as something else
(a ZeRO-3 plan silently trained as ZeRO-1, say). ``apply.auto`` plans only what passes.

One rule per dimension, each naming the modes that run it; a dimension gains modes here
when an engine for it lands. The SPMD engine (``apply.spmd``) runs every dimension on
one host and, one program per worker, across workers.
"""
from __future__ import annotations

from typing import Any

from tfplan.apply.mode import Mode
from tfplan.core.errors import PlanMismatchError
from tfplan.planner.plan import Plan
from tfplan.profiler import comm
from tfplan.profiler.comm import COLUMN_ROW_TYPES, HEAD_SPLIT_TYPES, VOCAB_SPLIT_TYPES


def unapplied(plan: Plan, mode: Any = None) -> list[str]:
    """Each dimension of ``plan.strategy`` that ``apply`` cannot run (in ``mode``, an
    ``apply.mode.ExecutionMode``, where that matters), with why, as sentences."""
    s = plan.strategy
    out = unapplied_dimensions(s)
    if s.cp > 1 and mode is not None and not out:
        out += _context_mode_rule(s, mode)
    return out


def older_expert_clashes(s: Any) -> list[str]:
    """What the older expert-parallel engine (``apply.expert_parallel``: where the SPMD
    engine refuses a model) does not run with ep > 1: tp, ZeRO-3,
    offload ("tp=2", ...; empty when it runs ``s``)."""
    return [what for what, on in ((f"tp={s.tp}", s.tp > 1),
                                  (f"zero_stage={s.zero_stage}", s.zero_stage > 2),
                                  (f"offload={s.offload!r}", s.offload != "none")) if on]


def unapplied_dimensions(s: Any) -> list[str]:
    """``unapplied`` for a strategy alone (a ``planner.plan.Strategy`` or a
    ``planner.candidates.Choice``: anything with ``zero_stage``, ``sequence_parallel``,
    ``cp`` and ``offload``); ``apply.auto`` hands ``not unapplied_dimensions(s)`` to the
    search as its ``admissible`` filter."""
    out = []
    # sequence parallelism runs inside the tensor-parallel engine (apply.sequence_parallel),
    # which every plan with tp > 1 uses (one host, or each worker's part)
    if s.sequence_parallel and s.tp == 1:
        out.append("sequence_parallel=True with tp=1 (it cuts the sequence over a "
                   "tensor-parallel group; there is none) runs only with tp > 1")
    if s.offload != "none":
        out += _offload_rule(s)
    return out


def _offload_rule(s: Any) -> list[str]:
    """Offload (``apply.offload``): the optimizer state (and with ``"optimizer+weights"``
    the weights, only without tensor parallelism) on each device's host; not where worker 0
    drives every worker's devices (``_offload_mode_rule``)."""
    if s.offload not in ("optimizer", "optimizer+weights"):
        return [f"offload={s.offload!r} is not a known offload; expected 'none', "
                "'optimizer' or 'optimizer+weights'"]
    if s.offload == "optimizer+weights" and s.tp > 1:
        return [f"offload='optimizer+weights' with tp={s.tp}: apply builds each tensor "
                "shard on its rank, not on the host; offload='optimizer' runs with tp"]
    return []


def check_applicable(plan: Plan, mode: Any = None) -> None:
    """PlanMismatchError naming every dimension of ``plan`` that ``apply`` cannot run."""
    problems = unapplied(plan, mode)
    if problems:
        raise PlanMismatchError(
            f"Plan {plan.name!r} cannot be applied: " + "; ".join(problems) + ". Re-plan "
            "without it (plan analyze --fix with the dimension off, e.g. --zero-stage 1, "
            "no --sequence-parallel, cp=1, --offload none), or price it only.")



def _context_mode_rule(s: Any, mode: Any) -> list[str]:
    """Mode ``context_parallel`` (``apply.spmd.context``) runs cp with dp, tp (sequence
    parallelism too), pp and ZeRO, on one host or one program per worker."""
    if mode.mode is Mode.CONTEXT_PARALLEL:
        return []
    return [f"cp={s.cp} (context parallelism) runs on the SPMD engine (apply.spmd.context); "
            f"this plan runs as {mode.mode.value}"]


# --- tensor-parallel splits: which entries of a profile a plan may split ---------------------

SPLIT_TYPES = {"column": COLUMN_ROW_TYPES, "row": COLUMN_ROW_TYPES,
               "heads": HEAD_SPLIT_TYPES, "vocab": VOCAB_SPLIT_TYPES}
"""The Keras classes (``type(layer).__name__``; ``keras.layers.GroupQueryAttention``'s
class is ``GroupedQueryAttention``) each split runs on (``apply.sharded_layers``): the
classes the planner offers them to (``profiler.comm``), one table for both."""

SPLIT_SUBCLASSES = {split: tuple((sub, base) for sub, base in comm.SPLIT_SUBCLASSES.items()
                                 if base in SPLIT_TYPES[split])
                    for split in SPLIT_TYPES}
"""(class, the Keras class it derives from) of the subclasses a split runs on too:
keras_hub's CachedMultiHeadAttention, whose training call is MultiHeadAttention's on the
block's mask (``apply.sharded_attention.ShardedCachedMultiHeadAttention``). Any other
subclass may compute something else in its ``call`` and is refused."""


def split_refusal(name: str, type_name: str, base_type: str, block: str,
                  split: str, attention_heads: int = 0) -> str | None:
    """Why ``apply`` cannot split profile entry ``name`` by ``split``, or None when it can
    (as far as the entry's place and class tell; the layer's configuration is checked when
    the twin is built: ``apply.sharded_layers``). Pure: the arguments are a
    ``profiler.model_profile.LayerProfile``'s ``name``, ``type``, ``base_type`` and
    ``block`` (and ``attention_heads``), so a search can filter on the same rule.

    * Place: a top-level layer (no ``/`` in its name) or a sub-layer of a block at any
      depth (``block`` set, ``name`` not the block's own entry). A nested model's own
      layers (``/`` in the name, no block) are refused: the nested model's graph holds
      them.
    * Class: ``SPLIT_TYPES[split]`` exactly (``base_type`` empty or the class itself), or
      a pair of ``SPLIT_SUBCLASSES[split]``.
    * A custom attention block (``attention_heads`` > 0: ``profiler.attention_blocks``)
      inside another block: ``heads`` only, the block whole
      (``apply.sharded_attention_block``, swapped in place in its parent); apply also needs
      tp dividing its key/value heads (``apply.blocks.resolve_splits``). One that is an
      outermost block itself (top level, or directly in a nested model) is a block's own
      entry: refused.
    """
    if split not in SPLIT_TYPES:
        return (f"{split!r} is not a split apply runs (column, row, heads, vocab)")
    if attention_heads and block and name != block:
        if split == "heads":
            return None
        return (f"it is an attention block (a {type_name} with sub-layers); apply splits "
                "it by 'heads' whole, or its projections column/row")
    if name == block:
        return (f"it is a block (a {type_name} with sub-layers, run by its own code); "
                "split its sub-layers instead")
    if "/" in name and not block:
        return ("it is a layer of a nested model (the nested model's graph holds it); apply "
                "splits top-level layers and the sub-layers of blocks")
    own = base_type in ("", type_name)
    if own and type_name in SPLIT_TYPES[split]:
        return None
    if (type_name, base_type) in SPLIT_SUBCLASSES.get(split, ()):
        return None
    kinds = ", ".join(SPLIT_TYPES[split] + tuple(c for c, _ in SPLIT_SUBCLASSES.get(split, ())))
    what = type_name if own else f"{type_name}, a subclass of {base_type}"
    return (f"it is a {what}; apply splits {split!r} for {kinds} only (Keras' own classes: "
            "a subclass's call may compute something else)")
