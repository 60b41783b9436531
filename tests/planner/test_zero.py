"""planner.zero: ZeRO-1 owners, largest first onto the least-loaded replica."""
from __future__ import annotations

import itertools
import random

import numpy as np
import pytest

from tfplan.core.errors import PlannerError
from tfplan.planner.zero import optimizer_owners, owners_by_device_group, replica_loads_bytes


def test_hand_computed_assignment():
    # sorted: 100 (i=1), 60 (i=0), 50 (i=3), 40 (i=2), 10 (i=4)
    # 100 -> r0 [100, 0]; 60 -> r1 [100, 60]; 50 -> r1 [100, 110]; 40 -> r0 [140, 110];
    # 10 -> r1 [140, 120]
    assert optimizer_owners([60, 100, 40, 50, 10], 2) == [1, 0, 0, 1, 1]
    assert replica_loads_bytes([60, 100, 40, 50, 10], [1, 0, 0, 1, 1], 2) == [140, 120]


def test_ties_go_to_the_lower_index():
    # equal sizes: earlier variables first, each onto the lowest empty replica
    assert optimizer_owners([8, 8, 8, 8, 8], 4) == [0, 1, 2, 3, 0]
    # empty variables change no load: they all go to replica 0
    assert optimizer_owners([0, 0, 0], 2) == [0, 0, 0]


def test_dp_1_owns_everything_and_empty_is_empty():
    assert optimizer_owners([3, 1, 4, 1, 5], 1) == [0] * 5
    assert optimizer_owners([], 4) == []


@pytest.mark.parametrize("dp", [2, 3, 4, 8])
def test_balance_bound_is_the_largest_variable(dp):
    rng = random.Random(dp)
    for _ in range(200):
        sizes = [rng.choice([4, 64, 4096, 65536]) * rng.randint(1, 40)
                 for _ in range(rng.randint(0, 30))]
        owners = optimizer_owners(sizes, dp)
        assert all(0 <= o < dp for o in owners)
        loads = replica_loads_bytes(sizes, owners, dp)
        assert sum(loads) == sum(sizes)
        assert max(loads) - min(loads) <= max(sizes, default=0)


def test_deterministic_and_order_only():
    sizes = [12, 7, 7, 30, 1, 12, 5]
    first = optimizer_owners(sizes, 3)
    assert all(optimizer_owners(list(sizes), 3) == first for _ in range(5))
    # numpy sizes give the same answer as Python ints
    assert optimizer_owners(np.array(sizes, dtype=np.int64), 3) == first


def test_within_grahams_lpt_bound_of_the_best_partition():
    # LPT is not always optimal: [9, 7, 6, 5, 4] on 2 replicas gives 17 where 16 is best
    sizes = [9, 7, 6, 5, 4]
    assert max(replica_loads_bytes(sizes, optimizer_owners(sizes, 2), 2)) == 17
    assert _best_max_load(sizes, 2) == 16
    # ... but its largest load is at most (4/3 - 1/(3 dp)) x the best (Graham, 1969)
    rng = random.Random(0)
    for dp in (2, 3):
        for _ in range(50):
            sizes = [rng.randint(1, 50) for _ in range(rng.randint(1, 8))]
            lpt = max(replica_loads_bytes(sizes, optimizer_owners(sizes, dp), dp))
            assert lpt <= (4 / 3 - 1 / (3 * dp)) * _best_max_load(sizes, dp) + 1e-9


def _best_max_load(sizes, dp):
    return min(max(replica_loads_bytes(sizes, list(owners), dp))
               for owners in itertools.product(range(dp), repeat=len(sizes)))


def test_groups_balance_per_device_tuple():
    stage0 = ("/device:CPU:0", "/device:CPU:1")
    stage1 = ("/device:CPU:2", "/device:CPU:3")
    groups = [(stage0, 100), (stage1, 100), (stage0, 100), (stage1, 50), (stage1, 50)]
    owners = owners_by_device_group(groups)
    # each stage on its own: stage0's two weights on both replicas; stage1's 100 on
    # replica 0, its two 50s on replica 1
    assert owners == [0, 0, 1, 1, 1]
    assert [devices[o] for (devices, _), o in zip(groups, owners)] == [
        "/device:CPU:0", "/device:CPU:2", "/device:CPU:1", "/device:CPU:3", "/device:CPU:3"]


def test_bad_input_is_a_planner_error():
    with pytest.raises(PlannerError, match="dp >= 1"):
        optimizer_owners([1, 2], 0)
    with pytest.raises(PlannerError, match="size -1"):
        optimizer_owners([1, -1], 2)
    with pytest.raises(PlannerError, match="size 1.5"):
        optimizer_owners([1.5], 2)
    with pytest.raises(PlannerError, match="one copy per data-parallel replica"):
        owners_by_device_group([(("a", "b"), 1), (("c",), 1)])
