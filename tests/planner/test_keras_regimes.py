"""The three memory regimes on real Keras models (examples/mlp.py and examples/cnn.py),
profiled symbolically with profiler.static.profile_source."""
from __future__ import annotations

import os

import pytest

from tfplan.core.errors import InfeasiblePlanError
from tfplan.planner.search import search
from tfplan.planner.validate import validate_plan
from tests.planner.test_search import make_cluster

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module", params=["mlp.py", "cnn.py"])
def profile(request):
    from tfplan.profiler.loader import load_model_source
    from tfplan.profiler.static import profile_source
    source = load_model_source(os.path.join(ROOT, "examples", request.param))
    return profile_source(source, batch_size=1)


def _single_device_bytes(profile, batch, dp=1):
    plan = search(profile, make_cluster(memory_bytes=10**12), batch, fix={"dp": dp}).chosen
    return plan.predicted.max_memory_bytes


def test_ample_memory_chooses_data_parallel(profile):
    result = search(profile, make_cluster(memory_bytes=10**12), 2**16)  # compute-bound batch
    s = result.chosen.strategy
    assert s.dp > 1 and s.tp == 1 and s.pp == 1
    for plan in result.candidates:
        validate_plan(plan, profile)


def test_tight_memory_chooses_a_split_or_a_saver(profile):
    # below what the widest data-parallel plan needs per device (dp=4: 8 samples each), so
    # plain data parallelism at any width does not fit
    need = _single_device_bytes(profile, 32, dp=4)
    result = search(profile, make_cluster(memory_bytes=int(0.6 * need)), 32)
    s = result.chosen.strategy
    assert (s.pp > 1 or s.tp > 1 or s.optimizer_sharding or s.recompute != "none"
            or s.num_microbatches > 1)  # a split or a saver (gradient accumulation too)
    assert result.chosen.predicted.fits
    assert not any(p.predicted.fits for p in result.candidates
                   if p.name == "single device" or p.name.startswith("data parallel"))


def test_impossible_memory_raises_with_the_limit(profile):
    with pytest.raises(InfeasiblePlanError, match="Memory binds"):
        search(profile, make_cluster(memory_bytes=1000), 32)
