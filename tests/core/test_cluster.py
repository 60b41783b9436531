"""tfplan.core.cluster: ClusterSpec's point-to-point links and DeviceSpec's layer overhead --
the JSON round trip, cluster files written before either existed, and the fallback of
``p2p_link`` to the collective links."""
from __future__ import annotations

import json

import pytest

from tfplan.core.cluster import ClusterSpec, DeviceSpec, LinkSpec
from tfplan.core.errors import ClusterSpecError, SchemaError
from tfplan.core.presets import load_cluster_file

DEVICE = DeviceSpec(kind="T", device_type="GPU", memory_bytes=2**34,
                    peak_flops_per_s=(("float32", 1e13),),
                    memory_bandwidth_bytes_per_s=1e12, matmul_efficiency=0.5)
NVLINK = LinkSpec(300e9, 5e-6, "collective, intra")
IB = LinkSpec(25e9, 10e-6, "collective, inter")
COPY = LinkSpec(400e9, 2e-6, "p2p, intra")
RDMA = LinkSpec(40e9, 3e-6, "p2p, inter")


def cluster(nodes: int = 2, **links) -> ClusterSpec:
    return ClusterSpec(name="t", num_nodes=nodes, devices_per_node=4, device=DEVICE,
                       intra_node_link=NVLINK, inter_node_link=IB if nodes > 1 else None,
                       **links)


def round_trip(c: ClusterSpec) -> ClusterSpec:
    return ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict())))


# --- p2p_link ----------------------------------------------------------------------------
def test_p2p_link_takes_the_p2p_links_where_given():
    c = cluster(intra_node_p2p_link=COPY, inter_node_p2p_link=RDMA)
    assert c.p2p_link(same_node=True) == COPY
    assert c.p2p_link(same_node=False) == RDMA
    # collectives keep their own links
    assert c.link_between(4) == NVLINK and c.link_between(8) == IB


def test_p2p_link_falls_back_to_the_collective_link_of_the_same_level():
    c = cluster()
    assert c.p2p_link(True) == NVLINK and c.p2p_link(False) == IB
    only_intra = cluster(intra_node_p2p_link=COPY)
    assert only_intra.p2p_link(True) == COPY and only_intra.p2p_link(False) == IB
    only_inter = cluster(inter_node_p2p_link=RDMA)
    assert only_inter.p2p_link(True) == NVLINK and only_inter.p2p_link(False) == RDMA


def test_one_node_has_no_inter_node_level():
    c = cluster(nodes=1, intra_node_p2p_link=COPY)
    assert c.p2p_link(False) == COPY  # nothing crosses nodes: the intra-node choice
    assert cluster(nodes=1).p2p_link(False) == NVLINK


# --- JSON ----------------------------------------------------------------------------------
def test_round_trip_keeps_p2p_links_and_layer_overhead():
    dev = DeviceSpec(**{**DEVICE.__dict__, "layer_overhead_s": 17e-6})
    c = ClusterSpec(name="t", num_nodes=2, devices_per_node=4, device=dev,
                    intra_node_link=NVLINK, inter_node_link=IB,
                    intra_node_p2p_link=COPY, inter_node_p2p_link=RDMA)
    doc = c.to_dict()
    assert doc["intra_node_p2p_link"] == {"bandwidth_bytes_per_s": 400e9, "latency_s": 2e-6,
                                          "source": "p2p, intra"}
    assert doc["inter_node_p2p_link"]["bandwidth_bytes_per_s"] == 40e9
    assert doc["device"]["layer_overhead_s"] == 17e-6
    back = round_trip(c)
    assert back == c and back.device.layer_overhead_s == 17e-6
    assert back.p2p_link(True) == COPY


def test_unset_fields_are_written_as_null_and_read_back_as_none():
    c = cluster()
    doc = c.to_dict()
    assert doc["intra_node_p2p_link"] is None and doc["inter_node_p2p_link"] is None
    assert doc["device"]["layer_overhead_s"] is None
    back = round_trip(c)
    assert back == c and back.intra_node_p2p_link is None
    assert back.device.layer_overhead_s is None


def test_a_cluster_file_from_before_p2p_links_still_loads(tmp_path):
    doc = cluster().to_dict()
    for key in ("intra_node_p2p_link", "inter_node_p2p_link"):
        del doc[key]
    del doc["device"]["layer_overhead_s"]
    path = tmp_path / "old.json"
    path.write_text(json.dumps(doc))
    c = load_cluster_file(str(path))
    assert c == cluster()
    assert c.p2p_link(True) == NVLINK and c.p2p_link(False) == IB
    assert c.device.layer_overhead_s is None


def test_bad_p2p_link_and_layer_overhead_name_the_field():
    doc = cluster().to_dict()
    doc["intra_node_p2p_link"] = {"bandwidth_bytes_per_s": 0, "latency_s": 1e-6}
    with pytest.raises(SchemaError, match=r"intra_node_p2p_link.bandwidth_bytes_per_s is 0"):
        ClusterSpec.from_dict(doc)
    doc = cluster().to_dict()
    doc["inter_node_p2p_link"] = "fast"
    with pytest.raises(SchemaError, match="inter_node_p2p_link: expected an object"):
        ClusterSpec.from_dict(doc)
    doc = cluster().to_dict()
    doc["device"]["layer_overhead_s"] = -1e-6
    with pytest.raises(SchemaError, match=r"device.layer_overhead_s is -1e-06"):
        ClusterSpec.from_dict(doc)


def test_file_errors_stay_cluster_spec_errors(tmp_path):
    doc = cluster().to_dict()
    doc["device"]["layer_overhead_s"] = "10us"
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ClusterSpecError, match="bad.json.*layer_overhead_s"):
        load_cluster_file(str(path))


# --- devices_per_compute_pool --------------------------------------------------------------
def test_compute_pool_defaults_to_one_round_trips_and_is_checked():
    assert cluster().devices_per_compute_pool == 1
    doc = cluster().to_dict()
    assert doc["devices_per_compute_pool"] == 1
    del doc["devices_per_compute_pool"]  # files from before it load as separate devices
    assert ClusterSpec.from_dict(doc) == cluster()
    shared = cluster(devices_per_compute_pool=4)
    assert round_trip(shared).devices_per_compute_pool == 4
    for bad in (0, 3, 8, True):  # must divide devices_per_node = 4
        with pytest.raises(ClusterSpecError, match="devices_per_compute_pool"):
            cluster(devices_per_compute_pool=bad)
