"""The `plan` command end to end: real subprocesses, real models, real files."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
EXAMPLES = os.path.join(ROOT, "examples")


def run_plan(*args: str, cwd: str = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, "-m", "tfplan.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def run_train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="2", PYTHONPATH=ROOT)
    return subprocess.run([sys.executable, os.path.join(EXAMPLES, "train.py"), *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout)


def test_help_is_fast_and_imports_no_tensorflow():
    code = ("import sys, time; t = time.perf_counter(); import tfplan.cli as c; "
            "c.build_parser().format_help(); "
            "print(time.perf_counter() - t, 'tensorflow' in sys.modules, 'scipy' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[1] == "False" and out[2] == "False"
    assert float(out[0]) < 1.0
    started = time.perf_counter()
    r = run_plan("--help")
    assert r.returncode == 0 and "analyze" in r.stdout and "profile" in r.stdout
    assert time.perf_counter() - started < 5.0  # includes interpreter start on a busy machine


def test_profile_json_totals_match_the_example(tmp_path):
    r = run_plan("profile", "examples/mlp.py", "--batch-size", "4", "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["batch_size"] == 4
    assert doc["totals"]["params"] == sum(l["params"] for l in doc["layers"])
    for key in ("params", "trainable_params", "param_bytes", "flops_fwd", "flops_bwd",
                "activation_bytes"):
        assert key in doc["totals"]
    for layer in doc["layers"]:
        assert {"name", "type", "params", "param_bytes", "activation_bytes", "flops_fwd",
                "flops_bwd", "comm"} <= set(layer)
        assert layer["comm"]["dp_allreduce_bytes"] == layer["grad_bytes"]
        assert layer["comm"]["pp_send_bytes"] == layer["activation_bytes"]


def test_profile_table_prints(tmp_path):
    r = run_plan("profile", "examples/cnn.py")
    assert r.returncode == 0, r.stderr
    assert "TOTAL" in r.stdout and "fwd FLOPs" in r.stdout


def test_clusters_lists_presets():
    r = run_plan("clusters", "--json")
    assert r.returncode == 0, r.stderr
    names = [c["name"] for c in json.loads(r.stdout)["presets"]]
    assert "8xA100-80GB" in names and "8xH100-80GB" in names


# --- bad input: a clear message, a non-zero exit, never our traceback -------------------

def _assert_clean_error(r: subprocess.CompletedProcess, *needles: str, code: int = 2) -> None:
    assert r.returncode == code, (r.returncode, r.stdout, r.stderr)
    assert "error" in r.stderr
    for needle in needles:
        assert needle in r.stderr, r.stderr
    assert "planner/cli.py" not in r.stderr  # our own frames are not shown


def test_missing_model_file(tmp_path):
    r = run_plan("profile", str(tmp_path / "nope.py"))
    _assert_clean_error(r, "nope.py")


def test_model_file_that_fails_to_import_shows_its_own_traceback(tmp_path):
    bad = tmp_path / "broken_model.py"
    bad.write_text(textwrap.dedent("""\
        import keras

        def helper():
            raise RuntimeError("boom from the user's file")

        helper()
        """))
    r = run_plan("profile", str(bad))
    _assert_clean_error(r, "broken_model.py", "boom from the user's file", "helper()")


def test_model_file_without_build_model(tmp_path):
    f = tmp_path / "no_builder.py"
    f.write_text("def make():\n    return None\n")
    r = run_plan("profile", str(f))
    _assert_clean_error(r, "build_model")


def test_unknown_cluster_preset_lists_known_ones():
    r = run_plan("analyze", "examples/mlp.py", "--cluster", "9xTPU-v9", "--global-batch", "8")
    _assert_clean_error(r, "9xTPU-v9", "8xA100-80GB")


def test_malformed_cluster_file_names_the_problem(tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_text("name: mine\nnum_nodes: 1\ndevices_per_node: four\n")
    r = run_plan("analyze", "examples/mlp.py", "--cluster", str(f), "--global-batch", "8")
    _assert_clean_error(r, "devices_per_node")


def test_bad_fix_argument():
    r = run_plan("analyze", "examples/mlp.py", "--cluster", "cpu:4", "--global-batch", "8",
                 "--fix", "dp=two")
    _assert_clean_error(r, "--fix")


# --- the end-to-end path: analyze, then train with the plan -------------------------

@pytest.fixture(scope="module")
def reference_losses():
    r = run_train("--model", "examples/mlp.py", "--steps", "5", "--global-batch", "32", "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)["losses"]


@pytest.mark.parametrize("fix,expect", [
    (None, None),
    # --fix is honoured by analyze in the what-if and batch-statistics tests below, and
    # train.py trains dp plans in tests/apply/test_train_script.py: -m slow
    pytest.param("dp=4", (4, 1), marks=pytest.mark.slow),
    ("pp=2", (1, 2))])
def test_analyze_then_train_matches_single_device(tmp_path, reference_losses, fix, expect):
    out = tmp_path / "out"
    args = ["analyze", "examples/mlp.py", "--cluster", "cpu:4", "--global-batch", "32",
            "--out", str(out), "--json"]
    if fix:
        args += ["--fix", fix]
    r = run_plan(*args)
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    plan = doc["plan"]
    assert {"dp", "tp", "pp"} <= set(plan["strategy"])
    assert plan["predicted"]["step_time_s"] > 0
    assert len(plan["predicted"]["peak_memory_bytes_per_device"]) >= 1
    ranked = [c["predicted"]["step_time_s"] for c in doc["candidates"] if c["predicted"]["fits"]]
    assert ranked == sorted(ranked)
    if fix is None:
        names = " ".join(c["name"] for c in doc["candidates"])
        assert "single device" in names and "data parallel" in names and "pipeline" in names
    else:
        assert (plan["strategy"]["dp"], plan["strategy"]["pp"]) == expect
    assert (out / "plan.json").is_file()
    events = [f for _, _, fs in os.walk(out / "tensorboard") for f in fs if "tfevents" in f]
    assert events, "no TensorBoard event file written"

    t = run_train("--plan", str(out / "plan.json"), "--steps", "5", "--json")
    assert t.returncode == 0, t.stderr
    trained = json.loads(t.stdout)
    assert len(trained["losses"]) == 5
    for got, want in zip(trained["losses"], reference_losses):
        assert abs(got - want) <= 1e-4 * abs(want), (trained["losses"], reference_losses)
    # Every variable sits on a device the plan names, each layer on its stage's device.
    stage_of = {layer: stage["devices"] for stage in plan["stages"] for layer in stage["layers"]}
    for var_path, devices in trained["devices"].items():
        layer = var_path.split("/")[0]
        if layer in stage_of:
            planned = {d.split("device:")[-1] for d in stage_of[layer]}
            placed = {d.split("device:")[-1] for d in devices}
            assert placed == planned, (var_path, devices, stage_of[layer])


def test_train_with_a_plan_for_another_model_fails_clearly(tmp_path):
    out = tmp_path / "out"
    r = run_plan("analyze", "examples/cnn.py", "--cluster", "cpu:2", "--global-batch", "8",
                 "--out", str(out), "--json")
    assert r.returncode == 0, r.stderr
    t = run_train("--plan", str(out / "plan.json"), "--model", "examples/mlp.py", "--steps", "1")
    assert t.returncode != 0
    assert "plan" in t.stderr.lower() and "layer" in t.stderr
    assert "Traceback" not in t.stderr


def test_profile_measure_writes_a_capture_and_times_every_layer(tmp_path):
    logdir = tmp_path / "capture"
    r = run_plan("profile", "examples/mlp.py", "--batch-size", "512", "--measure", "--steps",
                 "2", "--logdir", str(logdir), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    measured = doc["measured"]
    assert [l["name"] for l in measured["layers"]] == [l["name"] for l in doc["layers"]]
    assert measured["step_time_s"] > 0 and measured["peak_memory_source"]
    assert all(l["time_fwd_s"] + l["time_bwd_s"] > 0 for l in measured["layers"])
    assert list(logdir.glob("plugins/profile/*/*.xplane.pb")), "no XProf capture written"


FUSING_MODEL = """
import keras
import numpy as np

loss = "mse"


def build_model():
    inputs = keras.Input((256,))
    x = keras.layers.Dense(512, name="fc")(inputs)
    x = keras.layers.Activation("relu", name="act")(x)
    return keras.Model(inputs, keras.layers.Dense(8, name="head")(x), name="fusing")


def sample_batch(batch_size):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((batch_size, 256), dtype=np.float32),
            rng.standard_normal((batch_size, 8), dtype=np.float32))
"""


def test_profile_measure_says_which_layers_share_a_fused_kernel(tmp_path):
    """Dense (no activation) then Activation('relu'): one MatMul+BiasAdd+Relu kernel on x86."""
    model = tmp_path / "fusing.py"
    model.write_text(FUSING_MODEL)
    args = ("profile", str(model), "--batch-size", "256", "--measure", "--steps", "2")
    r = run_plan(*args, "--logdir", str(tmp_path / "a"), "--json")
    assert r.returncode == 0, r.stderr
    measured = json.loads(r.stdout)["measured"]
    fused = {l["name"]: l["fused_with"] for l in measured["layers"]}
    assert fused == {"fc": ["act"], "act": ["fc"], "head": []}
    assert any(w.startswith("fused kernel") and "layers fc, act" in w
               for w in measured["warnings"]), measured["warnings"]
    t = run_plan(*args, "--logdir", str(tmp_path / "b"))
    assert t.returncode == 0, t.stderr
    assert "fc (kernel shared with act)" in t.stdout and "act (kernel shared with fc)" in t.stdout
    assert "warning: fused kernel" in t.stdout and "FLOPs" in t.stdout


def test_profile_hardware_writes_a_cluster_that_analyze_uses(tmp_path):
    cluster_file = tmp_path / "cluster.json"
    r = run_plan("profile-hardware", "--devices", "cpu:2", "--quick", "--json", "--out",
                 str(cluster_file))
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    assert doc["cluster"]["devices_per_node"] == 2
    assert all(v > 0 for v in doc["cluster"]["device"]["peak_flops_per_s"].values())
    assert json.loads(cluster_file.read_text()) == doc["cluster"]
    a = run_plan("analyze", "examples/mlp.py", "--cluster", str(cluster_file), "--global-batch",
                 "16", "--out", str(tmp_path / "out"), "--json")
    assert a.returncode == 0, a.stderr
    assert json.loads(a.stdout)["plan"]["cluster"]["name"] == doc["cluster"]["name"]


def test_what_if_hybrid_that_does_not_fit_is_reported(tmp_path):
    r = run_plan("analyze", "examples/mlp.py", "--cluster", "8xA100-80GB", "--global-batch",
                 "64", "--fix", "dp=2,tp=2,pp=2", "--microbatch-size", "4", "--recompute",
                 "full", "--schedule", "1f1b", "--optimizer-sharding", "--json",
                 "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    plan = json.loads(r.stdout)["plan"]
    assert plan["strategy"] == {"dp": 2, "tp": 2, "pp": 2, "microbatch_size": 4,
                                "num_microbatches": 8, "schedule": "1f1b",
                                "recompute": "full", "optimizer_sharding": True,
                                "zero_stage": 1, "cp": 1, "sequence_parallel": False,
                                "offload": "none", "virtual_stages": 1, "layout": "tp-dp-pp",
                                "batch_norm": "global"}
    predicted = plan["predicted"]
    assert predicted["fits"] is True
    assert predicted["hardware_tflops_per_device"] > predicted["model_tflops_per_device"] > 0
    b = predicted["breakdown"]
    assert sum(b.values()) == pytest.approx(predicted["step_time_s"])
    from tfplan.core.presets import parse_cluster
    cluster = parse_cluster("8xA100-80GB").to_dict()
    cluster["device"]["memory_bytes"] = 1000  # the same plan on 1 kB devices: fits false
    small = tmp_path / "small.json"
    small.write_text(json.dumps(cluster))
    r = run_plan("analyze", "examples/mlp.py", "--cluster", str(small), "--global-batch", "64",
                 "--fix", "dp=2,tp=2,pp=2", "--json", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["plan"]["predicted"]["fits"] is False


def test_measured_file_that_holds_no_measurement_is_refused(tmp_path):
    f = tmp_path / "measured.json"
    f.write_text('{"layers": []}')
    r = run_plan("analyze", "examples/mlp.py", "--cluster", "cpu:4", "--global-batch", "8",
                 "--measured", str(f), "--out", str(tmp_path / "o"))
    assert r.returncode == 2
    assert "holds no measurement" in r.stderr and "--measure --json" in r.stderr
    assert "Traceback" not in r.stderr


def test_report_on_a_directory_without_an_analysis_says_how_to_make_one(tmp_path):
    r = run_plan("report", str(tmp_path))
    assert r.returncode == 2
    assert "plan analyze MODEL" in r.stderr and "Traceback" not in r.stderr


def test_analyze_says_how_batch_statistics_are_computed(tmp_path):
    """A model with BatchNormalization: plan.json records the rule, --json and the text
    say what it costs and whether it equals one device (planner.batch_stats)."""
    model = os.path.join(ROOT, "tests", "apply", "tiny_resnet_bn.py")
    r = run_plan("analyze", model, "--cluster", "cpu:4", "--global-batch", "32", "--fix",
                 "dp=4", "--out", str(tmp_path / "g"), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    said = doc["batch_statistics"]
    assert (said["mode"], said["layers"], said["parts"]) == ("global", 4, 4)
    assert said["equal_to_one_device"] and said["sync_s"] > 0
    assert doc["plan"]["strategy"]["batch_norm"] == "global"
    with open(tmp_path / "g" / "plan.json", encoding="utf-8") as f:
        assert json.load(f)["strategy"]["batch_norm"] == "global"
    r = run_plan("analyze", model, "--cluster", "cpu:4", "--global-batch", "32", "--fix",
                 "dp=4", "--batch-norm", "local", "--out", str(tmp_path / "l"))
    assert r.returncode == 0, r.stderr
    assert "Batch statistics: local" in r.stdout and "differ from one device" in r.stdout


def test_issue_14_dimensions_round_trip_through_analyze(tmp_path):
    """--zero-stage, --sequence-parallel, --offload and cp in --fix land in plan.json's
    strategy and the text; tp spanning nodes is priced, not refused."""
    r = run_plan("analyze", "examples/llama.py", "--cluster", "2x8xA100-80GB",
                 "--global-batch", "16", "--fix", "dp=1,tp=16,cp=1", "--zero-stage", "0",
                 "--sequence-parallel", "--offload", "optimizer", "--recompute", "selective",
                 "--json", "--out", str(tmp_path / "a"))
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)["plan"]["strategy"]
    assert (s["tp"], s["zero_stage"], s["sequence_parallel"], s["offload"], s["cp"],
            s["recompute"]) == (16, 0, True, "optimizer", 1, "selective")
    saved = json.loads((tmp_path / "a" / "plan.json").read_text())["strategy"]
    assert saved["sequence_parallel"] and saved["offload"] == "optimizer"
    cp = run_plan("analyze", "examples/llama.py", "--cluster", "8xA100-80GB",
                  "--global-batch", "16", "--fix", "dp=4,cp=2", "--zero-stage", "3",
                  "--out", str(tmp_path / "b"))
    assert cp.returncode == 0, cp.stderr
    assert "cp=2" in cp.stdout and "zero3" in cp.stdout
    both = run_plan("analyze", "examples/mlp.py", "--cluster", "cpu:4", "--global-batch", "16",
                    "--zero-stage", "0", "--optimizer-sharding", "--out", str(tmp_path / "c"))
    assert both.returncode == 2 and "give one of them" in both.stderr
