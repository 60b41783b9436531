"""Issue 5's acceptance matrix: every model x every parallel mode trains like one device,
with every variable and every optimizer slot on the device the plan names.

Models (tests/apply): the MLP (tiny_mlp.py), the residual CNN (tiny_cnn.py: Conv2D
and Add, no BatchNorm) and the small transformer (tiny_transformer.py). Modes, on the
8 logical CPU devices of tests/conftest.py, with hand-made plans:

* data parallel, dp = 4;
* pipeline, pp = 2 with 2 micro-batches;
* tensor parallel, tp = 2 (Megatron splits of ``SPLITS``);
* hybrids dp = 2 x pp = 2 (2 micro-batches) and dp = 2 x tp = 2.

All run on the SPMD engine (apply.spmd: one copy of the model per device column, each
layer's variables on its stage's device; the CNN's convolutions split by filters and
input channels, the stem's 3 input channels cut 2/1).

Each case wraps the user's (untrained, seed 0) model with ``apply.wrap(model, plan)``,
compiles it and runs ``STEPS`` ``train_on_batch`` steps on the same global batches as
the single-device reference; the per-step losses must agree within 1e-4 relative.
Placement is checked against the plan, not against where things happen to be: a split
layer's shard t on its stage's tp rank t (a row split's bias, added after the sum, on
rank 0), every other layer of replica r on its stage's device r x tp (SPMD: every
variable of copy (r, t) on its layer's stage's device r x tp + t); under
MirroredStrategy each variable is a MirroredVariable with one component per plan
device. Each optimizer slot is mapped to its variable through the optimizer's own index
(``_get_variable_index``, the one its ``update_step`` uses) and must sit where that
variable's plan device is; every optimizer variable other than its step counter and
learning rate must be such a slot.
"""
from __future__ import annotations

import dataclasses
import re
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from tfplan import apply
from tfplan.apply.placement import tf_variable
from tfplan.apply.sharded_layers import _Sharded
from tfplan.apply.spmd import SpmdModel
from tfplan.apply.spmd.rank_layers import is_twin
from tests.apply import helpers  # noqa: E402
from tests.apply.helpers import (GLOBAL_BATCH, assert_losses_match, base_model, batches_of,
                                 cpus, fresh_optimizer, make_plan, slots_by_variable,
                                 step_losses)

STEPS = 10  # the matrix trains 10 steps (helpers.STEPS is 5)
MODELS = ("tiny_mlp", "tiny_cnn", "tiny_transformer")
SPLITS = {
    "tiny_mlp": (("dense_in", "column"), ("hidden", "row"), ("narrow", "column"),
                 ("head", "row")),
    # the stem reads the 3-channel image by rows (shards of 2 and 1 channels), the
    # residual branch is a column -> row conv pair; the softmax head is a column split
    "tiny_cnn": (("stem", "row"), ("res_a", "column"), ("res_b", "row"),
                 ("classifier", "column")),
    "tiny_transformer": (("embed", "vocab"), ("attention", "heads"), ("mlp_up", "column"),
                         ("mlp_down", "row"), ("logits", "column")),
}
# mode: (devices of each stage, dp x tp per stage, tensor rank innermost; dp; micro-batches)
MODES = {
    "dp4": ([cpus(0, 1, 2, 3)], 4, 1),
    "pp2-m2": ([cpus(4), cpus(5)], 1, 2),
    "tp2": ([cpus(6, 7)], 1, 1),
    "dp2xpp2-m2": ([cpus(0, 1), cpus(2, 3)], 2, 2),
    "dp2xtp2": ([cpus(4, 5, 6, 7)], 2, 1),
}
# the models' optimizers: SGD with momentum (the CNN) keeps one slot, Adam two
SLOTS_PER_VARIABLE = {"SGD": 1, "Adam": 2}


def reference_losses(name: str) -> list[float]:
    """Single-device losses of STEPS steps from the same weights and batches."""
    return helpers.reference_losses(name, STEPS)


def plan_for(model: Any, name: str, mode: str):
    """The hand-made plan of ``mode`` (tp = devices per stage / dp) for ``model``."""
    stage_devices, dp, m = MODES[mode]
    plan = make_plan(model, stage_devices, num_microbatches=m, global_batch=GLOBAL_BATCH)
    tp = len(stage_devices[0]) // dp
    if tp == 1 and dp == plan.strategy.dp:
        return plan
    strategy = dataclasses.replace(plan.strategy, dp=dp, tp=tp,
                                   microbatch_size=GLOBAL_BATCH // (dp * m))
    return dataclasses.replace(plan, strategy=strategy,
                               tp_splits=SPLITS[name] if tp > 1 else (),
                               name=f"acceptance {name} {mode}")


# --- where things are ------------------------------------------------------------------------
def _short(device: str) -> str:
    spec = tf.DeviceSpec.from_string(device)
    return f"/device:{spec.device_type}:{spec.device_index}"


def components(variable: Any) -> list[str]:
    """The devices holding ``variable``: one per component of a distributed variable."""
    value = tf_variable(variable)
    if isinstance(value, tf.distribute.DistributedValues):
        return [_short(v.device) for v in value.values]
    return [_short(value.device)]


def planned_devices(model: Any, plan) -> dict[int, list[str]]:
    """``{id(variable): devices the plan names for it}`` for every variable of every
    replica of ``model`` (see the module docstring)."""
    s = plan.strategy
    stage_of = {layer: stage for stage in plan.stages for layer in stage.layers}
    out: dict[int, list[str]] = {}
    if type(model).__name__ == "DataParallelModel":  # MirroredStrategy: one per replica
        for layer in model.layers:
            for v in layer.weights:
                out[id(v)] = list(stage_of[layer.name].devices)
        return out
    if isinstance(model, SpmdModel):  # copy (q, t): tensor rank t of replica q, each
        for i, copy in enumerate(model.device_models):  # layer on its stage's device
            q, t = divmod(i, s.tp)
            for layer in copy.layers:
                if layer.weights:
                    assert is_twin(layer) == (layer.name in dict(plan.tp_splits)), layer.name
                    for v in layer.weights:
                        out[id(v)] = [stage_of[layer.name].devices[q * s.tp + t]]
        return out
    replicas = (model, *getattr(getattr(model, "_others", None), "models", ()))
    assert len(replicas) == s.dp, "expected one model per data-parallel replica"
    for r, replica in enumerate(replicas):
        for layer in replica.layers:
            if not layer.weights:
                continue
            devices = stage_of[layer.name].devices[r * s.tp:(r + 1) * s.tp]
            split = isinstance(layer, _Sharded)
            assert split == (layer.name in dict(plan.tp_splits)), layer.name
            for v in layer.weights:
                rank = re.search(r"_(\d+)$", v.name) if split else None
                out[id(v)] = [devices[int(rank.group(1)) if rank else 0]]
    return out


def assert_placement(model: Any, plan) -> None:
    planned = planned_devices(model, plan)
    if type(model).__name__ == "DataParallelModel":  # variables and slots are mirrored
        for v in (*model.weights, *model.optimizer.variables):
            assert isinstance(tf_variable(v), tf.distribute.DistributedValues) and \
                type(tf_variable(v)).__name__ == "MirroredVariable", (v.path, type(v.value))
    for v in model.weights:
        assert components(v) == planned[id(v)], (v.path, components(v), planned[id(v)])
    for replica in getattr(getattr(model, "_others", None), "models", ()):
        for v in replica.weights:
            assert components(v) == planned[id(v)], (v.path, components(v), planned[id(v)])
    trainable = model.trainable_variables
    assert {id(v) for v in trainable} <= set(planned)
    slots = slots_by_variable(model.optimizer)
    assert set(slots) == {id(v) for v in trainable}  # the optimizer trains every copy
    kind = type(model.optimizer).__name__
    assert {len(found) for found in slots.values()} == {SLOTS_PER_VARIABLE[kind]}
    for v in trainable:
        assert slots[id(v)], f"no optimizer slot for {v.path}"
        for slot in slots[id(v)]:
            assert tuple(slot.shape) == tuple(v.shape), (slot.path, v.path)
            assert components(slot) == planned[id(v)], (slot.path, components(slot),
                                                        planned[id(v)])
    used = {d for devices in planned.values() for d in devices}
    assert used == set(plan.devices)  # every device of the plan holds state


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("name", MODELS)
def test_trains_like_one_device_with_state_where_the_plan_says(name, mode):
    module, model = base_model(name)
    plan = plan_for(model, name, mode)
    stage_devices, dp, m = MODES[mode]
    assert (plan.strategy.dp, plan.strategy.tp, plan.strategy.pp,
            plan.strategy.num_microbatches) == (dp, len(stage_devices[0]) // dp,
                                                len(stage_devices), m)
    wrapped = apply.wrap(model, plan)
    wrapped.compile(optimizer=fresh_optimizer(module), loss=module.loss)
    losses = step_losses(wrapped, batches_of(module, STEPS, GLOBAL_BATCH))
    assert_losses_match(losses, reference_losses(name), rtol=1e-4)
    assert np.all(np.isfinite(losses))
    # it trained: the user's model is untouched, the wrapped one moved away from it
    assert not np.array_equal(wrapped.get_weights()[0], model.get_weights()[0])
    assert_placement(wrapped, plan)
