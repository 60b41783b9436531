"""ZeRO-1 ownership: which data-parallel replica holds each weight's optimizer state.

Pipeline position: the rule behind ``Strategy.optimizer_sharding``. The cost model
(``planner.pricing``) divides optimizer state by ``dp``; ``apply.zero`` places it
by this module's answer: only the owner's copy of a weight gets optimizer slots, the
owner alone sums the replicas' gradients for it and updates it, and the other
replicas receive the new value.

How it works. ZeRO stage 1, P_os (Rajbhandari et al., "ZeRO: Memory Optimizations
Toward Training Trillion Parameter Models", SC'20, Sec. 5.1), splits the optimizer
state of the data-parallel group into ``N_d`` equal partitions, replica ``i``
updating partition ``i``; ZeRO cuts one flat buffer, so its parts differ by at most
one element. Here a weight (a Keras variable) is never cut: whole variables are
assigned, as PyTorch's ``ZeroRedundancyOptimizer._partition_parameters`` does
(torch.distributed.optim, ``parameters_as_bucket_view=False``): variables sorted by
size, largest first (ties: lower index first), each one going to the replica with
the fewest bytes so far (ties: lower replica index), i.e. Graham's LPT rule
("Bounds on multiprocessing timing anomalies", SIAM J. Appl. Math., 1969).

Bound: the most and the least loaded replicas differ by at most the largest
variable's bytes (each variable goes to a least-loaded replica, so after placing a
variable of ``b`` bytes no replica exceeds the least loaded by more than
``max(b, previous difference)``). With optimizers whose state is a fixed number of
slots shaped like each variable (Adam: 2, SGD with momentum: 1), balancing the
variables' bytes balances the slots' bytes with the same bound, scaled.

Per stage and per tensor rank: the dp copies of a weight live on the dp devices of
its pipeline stage and tensor rank (``planner.plan``: ``stages[s].devices[r * tp +
t]``), and its owner must be one of them. ``owners_by_device_group`` therefore
balances each distinct tuple of copy devices on its own.

Expert parallelism (``Strategy.ep``): an expert shard is held by the dp/ep replicas with
the same ep rank, and its owner must be one of them; ``apply.zero`` passes each such
part (its copy devices, the shard's bytes) to ``owners_by_device_group`` together with
the other expert shards' parts and apart from the dense weights, which are balanced over
all dp copies as above (``planner.experts`` prices the same split of the state).
"""
from __future__ import annotations

import operator
from collections import defaultdict
from typing import Sequence

from tfplan.core.errors import PlannerError


def optimizer_owners(variable_sizes: Sequence[int], dp: int) -> list[int]:
    """Owner replica (0..dp-1) of each variable, balancing bytes (module docstring).

    ``variable_sizes``: bytes of each variable (any unit proportional to its
    optimizer state). Deterministic: it depends on the sizes and their order only.
    """
    if isinstance(dp, bool) or not isinstance(dp, int) or dp < 1:
        raise PlannerError(f"optimizer_owners needs dp >= 1 data-parallel replicas; received "
                           f"dp={dp!r}.")
    sizes = [_size(s, i) for i, s in enumerate(variable_sizes)]
    owners = [0] * len(sizes)
    loads = [0] * dp
    for i in sorted(range(len(sizes)), key=lambda k: (-sizes[k], k)):
        owner = min(range(dp), key=lambda r: (loads[r], r))
        owners[i] = owner
        loads[owner] += sizes[i]
    return owners


def replica_loads_bytes(variable_sizes: Sequence[int], owners: Sequence[int],
                        dp: int) -> list[int]:
    """Bytes each of the dp replicas owns under ``owners``."""
    loads = [0] * dp
    for size, owner in zip(variable_sizes, owners, strict=True):
        loads[owner] += size
    return loads


def owners_by_device_group(groups: Sequence[tuple[Sequence[str], int]]) -> list[int]:
    """Owner replica of each weight group, balanced among groups on the same devices.

    ``groups[i] = (devices, size_bytes)``: ``devices[r]`` holds replica r's copy of
    weight i (one pipeline stage's tensor rank, across the dp replicas). Groups whose
    copies sit on the same devices are balanced together with ``optimizer_owners``;
    the owner's device is ``devices[owner]``.
    """
    dps = {len(devices) for devices, _ in groups}
    if len(dps) > 1 or 0 in dps:
        raise PlannerError(f"Every weight group needs one copy per data-parallel replica; "
                           f"received groups with {sorted(dps)} copies. Pass the dp copies "
                           "of each weight, in replica order.")
    members: dict[tuple[str, ...], list[int]] = defaultdict(list)
    for i, (devices, _) in enumerate(groups):
        members[tuple(devices)].append(i)
    owners = [0] * len(groups)
    for devices, indices in members.items():
        local = optimizer_owners([groups[i][1] for i in indices], len(devices))
        for i, owner in zip(indices, local):
            owners[i] = owner
    return owners


def _size(size: int, index: int) -> int:
    try:
        value = operator.index(size)  # int or numpy integer, not float or bool
    except TypeError:
        value = -1
    if isinstance(size, bool) or value < 0:
        raise PlannerError(f"Variable {index} has size {size!r}; expected a whole number of "
                           "bytes >= 0.")
    return value
