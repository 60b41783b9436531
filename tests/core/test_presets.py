"""tfplan.core.presets: cpu:N, named GPU servers, NxPRESET and cluster files."""
from __future__ import annotations

import json
import os

import pytest

from tfplan.core.cluster import ClusterSpec
from tfplan.core.errors import ClusterSpecError, PlannerError
from tfplan.core.presets import known_presets, parse_cluster

GiB = 2**30


def test_cpu_n_describes_logical_devices_with_nominal_figures():
    c = parse_cluster("cpu:4")
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert (c.num_nodes, c.devices_per_node, c.num_devices) == (1, 4, 4)
    assert c.device_names() == tuple(f"/device:CPU:{i}" for i in range(4))
    assert c.device.device_type == "CPU"
    assert c.device.memory_bytes == host // 4
    assert c.device.peak_flops("float32") == 50e9 and c.device.matmul_efficiency == 1.0
    assert c.device.memory_bandwidth_bytes_per_s == 10e9
    assert "nominal" in c.device.source and "profile-hardware" in c.device.source
    assert "share" in c.device.source
    link = c.intra_node_link
    assert (link.bandwidth_bytes_per_s, link.latency_s) == (5e9, 20e-6)
    assert "nominal" in link.source


def test_cpu_n_prices_a_stage_transfer_as_a_same_host_copy():
    c = parse_cluster("cpu:4")
    p2p = c.intra_node_p2p_link
    # a copy reads and writes each byte: half the nominal 10 GB/s memory bandwidth
    assert p2p.bandwidth_bytes_per_s == c.device.memory_bandwidth_bytes_per_s / 2 == 5e9
    assert p2p.latency_s == 5e-6 and p2p.latency_s < c.intra_node_link.latency_s
    assert "memory copy" in p2p.source and "/ 2" in p2p.source
    assert c.p2p_link(True) is p2p and c.p2p_link(False) is p2p  # one node
    assert c.inter_node_p2p_link is None
    assert ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c


@pytest.mark.parametrize("name", known_presets())
def test_presets_price_transfers_on_their_collective_links(name):
    one, four = parse_cluster(name), parse_cluster(f"4x{name}")
    assert one.intra_node_p2p_link is None and one.inter_node_p2p_link is None
    assert one.p2p_link(True) == one.intra_node_link
    assert four.p2p_link(True) == four.intra_node_link
    assert four.p2p_link(False) == four.inter_node_link != four.intra_node_link


def test_a100_80gb_server_has_datasheet_numbers():
    c = parse_cluster("8xA100-80GB")
    d = c.device
    assert c.num_devices == 8 and c.name == "8xA100-80GB"
    assert d.memory_bytes == 80 * GiB
    assert d.peak_flops("mixed_float16") == 312e12 and d.peak_flops("mixed_bfloat16") == 312e12
    assert d.peak_flops("tf32") == 156e12 and dict(d.peak_flops_per_s)["float32"] == 19.5e12
    # TensorFlow runs float32 matmuls in TF32 on Ampere by default: priced at the TF32 peak.
    assert d.peak_flops("float32") == 156e12
    assert d.memory_bandwidth_bytes_per_s == 2039e9
    assert d.matmul_efficiency == 0.6  # calibrated on one Megatron row (presets.py)
    assert "A100" in d.source and "datasheet" in d.source and "Megatron" in d.source
    assert c.intra_node_link.bandwidth_bytes_per_s == 300e9  # 600 GB/s bidirectional
    assert c.intra_node_link.latency_s == 5e-6
    assert c.inter_node_link.bandwidth_bytes_per_s == 25e9  # 200 Gb/s HDR per GPU
    assert c.inter_node_link.latency_s == 10e-6


def test_other_presets():
    assert set(known_presets()) >= {"8xA100-80GB", "8xA100-40GB", "8xH100-80GB", "8xV100-32GB"}
    a40 = parse_cluster("8xA100-40GB").device
    assert a40.memory_bytes == 40 * GiB and a40.memory_bandwidth_bytes_per_s == 1555e9
    h = parse_cluster("8xH100-80GB")
    assert h.device.peak_flops("mixed_bfloat16") == pytest.approx(989.4e12)
    assert h.device.memory_bandwidth_bytes_per_s == 3.35e12
    assert h.intra_node_link.bandwidth_bytes_per_s == 450e9
    assert h.inter_node_link.bandwidth_bytes_per_s == 50e9  # 400 Gb/s NDR per GPU
    v = parse_cluster("8xV100-32GB").device
    assert v.peak_flops("mixed_float16") == 125e12 and v.peak_flops("float32") == 15.7e12
    with pytest.raises(ClusterSpecError, match="bfloat16"):
        v.peak_flops("mixed_bfloat16")  # V100 has no bfloat16


@pytest.mark.parametrize("name", known_presets())
def test_every_preset_round_trips_through_json(name):
    c = parse_cluster(name)
    assert ClusterSpec.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_multi_node_form():
    c = parse_cluster("4x8xH100-80GB")
    assert (c.num_nodes, c.devices_per_node, c.num_devices) == (4, 8, 32)
    assert c.name == "4x8xH100-80GB"
    assert c.device_names()[-1] == "/job:worker/task:3/device:GPU:7"
    assert c.link_between(16) == c.inter_node_link
    assert parse_cluster("64x8xA100-80GB").num_devices == 512
    assert parse_cluster("8xa100-80gb").name == "8xA100-80GB"  # case does not matter


def test_yaml_file_without_schema_version(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text(
        "name: two-box\nnum_nodes: 2\ndevices_per_node: 2\n"
        "device:\n  kind: T4\n  memory_bytes: 16000000000\n"
        "  peak_flops_per_s: {float32: 8.1e12, float16: 65e12}\n"
        "  memory_bandwidth_bytes_per_s: 320e9\n  matmul_efficiency: 0.4\n"
        "intra_node_link: {bandwidth_bytes_per_s: 16e9, latency_s: 1e-5}\n"
        "inter_node_link: {bandwidth_bytes_per_s: 12.5e9, latency_s: 2e-5}\n")
    c = parse_cluster(str(f))
    assert c.name == "two-box" and c.num_devices == 4
    assert c.device.peak_flops("mixed_float16") == 65e12
    assert c.inter_node_link.latency_s == 2e-5


def test_json_file_and_preset_reference_file(tmp_path):
    a100 = parse_cluster("8xA100-80GB")
    f = tmp_path / "c.json"
    f.write_text(json.dumps(a100.to_dict()))
    assert parse_cluster(str(f)) == a100
    ref = tmp_path / "ref.yml"
    ref.write_text("preset: 8xA100-80GB\nnodes: 4\n")
    c = parse_cluster(str(ref))
    assert c == parse_cluster("4x8xA100-80GB") and c.num_devices == 32


def test_unknown_preset_lists_known_ones_and_forms():
    with pytest.raises(ClusterSpecError) as e:
        parse_cluster("9xTPU-v9")
    msg = str(e.value)
    assert "9xTPU-v9" in msg
    for name in known_presets():
        assert name in msg
    assert "cpu:N" in msg and ".yaml" in msg


@pytest.mark.parametrize("spec", ["cpu:0", "cpu:four", "0x8xA100-80GB", ""])
def test_bad_counts(spec):
    with pytest.raises(ClusterSpecError):
        parse_cluster(spec)


def test_malformed_files_name_the_file_and_the_field(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("name: mine\nnum_nodes: 1\ndevices_per_node: four\n")
    with pytest.raises(PlannerError) as e:
        parse_cluster(str(f))
    assert "devices_per_node" in str(e.value) and "cluster.yaml" in str(e.value)

    f.write_text("name: mine\nnum_nodes: 1\ndevices_per_node: 4\n")
    with pytest.raises(PlannerError, match="device is missing"):
        parse_cluster(str(f))

    f.write_text("name: [unclosed\n")
    with pytest.raises(ClusterSpecError, match="not valid YAML"):
        parse_cluster(str(f))

    j = tmp_path / "cluster.json"
    j.write_text("{not json")
    with pytest.raises(ClusterSpecError, match="cluster.json.*not valid JSON"):
        parse_cluster(str(j))

    f.write_text("- just\n- a list\n")
    with pytest.raises(ClusterSpecError, match="expected a mapping"):
        parse_cluster(str(f))

    f.write_text("preset: 8xA100-80GB\nnodes: 2\nname: extra\n")
    with pytest.raises(ClusterSpecError, match="only `preset` and `nodes`"):
        parse_cluster(str(f))

    f.write_text("preset: 8xTPU\n")
    with pytest.raises(ClusterSpecError, match="8xA100-80GB"):
        parse_cluster(str(f))


def test_missing_file(tmp_path):
    with pytest.raises(ClusterSpecError, match="does not exist"):
        parse_cluster(str(tmp_path / "nope.yaml"))


def test_cpu_n_devices_share_one_compute_pool_and_gpus_do_not():
    assert parse_cluster("cpu:4").devices_per_compute_pool == 4
    assert parse_cluster("cpu:1").devices_per_compute_pool == 1
    for name in known_presets():
        assert parse_cluster(name).devices_per_compute_pool == 1


def test_cpu_workers_name_one_cpu_per_worker_process():
    c = parse_cluster("2xcpu:1")
    assert (c.name, c.num_nodes, c.devices_per_node) == ("2xcpu:1", 2, 1)
    assert c.device_names() == ("/job:worker/task:0/device:CPU:0",
                                "/job:worker/task:1/device:CPU:0")
    assert c.inter_node_link is not None and c.link_between(2) is c.inter_node_link
    assert parse_cluster("1xcpu:2").device_names() == parse_cluster("cpu:2").device_names()
    for bad in ("0xcpu:1", "2xcpu:0", "twoxcpu:1"):
        with pytest.raises(ClusterSpecError):
            parse_cluster(bad)
