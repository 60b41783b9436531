"""Loading model files and module:function specs, and every way that can fail."""
from __future__ import annotations

import os
import textwrap

import keras
import numpy as np
import pytest

from tfplan.core.errors import ModelLoadError
from tfplan.profiler.loader import build, load_model_source
from tfplan.profiler.static import profile_source

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LOADER_FRAME = os.path.join("profiler", "loader.py")


def write(tmp_path, name: str, body: str) -> str:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return str(path)


def assert_user_traceback(message: str, user_file: str, text: str) -> None:
    assert os.path.basename(user_file) in message
    assert text in message
    assert LOADER_FRAME not in message and "importlib" not in message
    first_frame = next(line for line in message.splitlines() if line.strip().startswith('File "'))
    assert user_file in first_frame  # the first frame shown is the user's own file


def test_example_file_loads_with_its_extras():
    source = load_model_source(os.path.join(ROOT, "examples", "mlp.py"))
    assert source.name == "mlp" and source.optimizer == "adam"
    assert isinstance(source.loss, keras.losses.SparseCategoricalCrossentropy)
    x, y = source.sample_batch(4)
    x2, y2 = source.sample_batch(4)
    assert x.shape == (4, 32) and y.shape == (4,) and np.array_equal(x, x2)
    assert np.array_equal(y, y2)


def test_missing_file(tmp_path):
    path = str(tmp_path / "nope.py")
    with pytest.raises(ModelLoadError) as err:
        load_model_source(path)
    assert path in str(err.value) and "build_model()" in str(err.value)
    assert "MODULE:FUNCTION" in str(err.value)


def test_file_raising_on_import_shows_the_users_traceback(tmp_path):
    path = write(tmp_path, "broken_model.py", """\
        import keras

        def helper():
            raise ValueError("kaboom from the model file")

        helper()
        """)
    with pytest.raises(ModelLoadError) as err:
        load_model_source(path)
    assert_user_traceback(str(err.value), path, "kaboom from the model file")
    assert "ValueError" in str(err.value)


def test_syntax_error_in_file(tmp_path):
    path = write(tmp_path, "typo_model.py", "def build_model(:\n    pass\n")
    with pytest.raises(ModelLoadError) as err:
        load_model_source(path)
    assert "SyntaxError" in str(err.value) and "typo_model.py" in str(err.value)
    assert LOADER_FRAME not in str(err.value)


def test_no_build_model_lists_what_the_file_defines(tmp_path):
    path = write(tmp_path, "other_model.py", """\
        import keras
        from keras.layers import Dense

        def make_model():
            pass

        class Tower:
            pass

        SIZE = 3
        """)
    with pytest.raises(ModelLoadError) as err:
        load_model_source(path)
    msg = str(err.value)
    assert "defines no function build_model()" in msg
    assert "make_model" in msg and "Tower" in msg
    assert "Dense" not in msg and "SIZE" not in msg  # imported / not callable
    named = load_model_source(path + ":make_model")  # FILE.py:FUNCTION picks another function
    assert named.name == "other_model:make_model"
    with pytest.raises(ModelLoadError, match="returned builtins.NoneType"):
        build(named)


def test_build_model_raising_shows_the_users_traceback(tmp_path):
    path = write(tmp_path, "raising_model.py", """\
        def build_model():
            return 1 / 0
        """)
    source = load_model_source(path)
    with pytest.raises(ModelLoadError) as err:
        build(source)
    assert_user_traceback(str(err.value), path, "division by zero")


def test_build_model_returning_a_non_model(tmp_path):
    path = write(tmp_path, "layers_model.py", """\
        import keras

        def build_model():
            return [keras.layers.Dense(3)]
        """)
    with pytest.raises(ModelLoadError) as err:
        build(load_model_source(path))
    assert "returned builtins.list" in str(err.value) and "keras.Model" in str(err.value)


def test_sibling_imports_and_unique_module_names(tmp_path):
    write(tmp_path, "blocks.py", """\
        import keras

        def tower(x):
            return keras.layers.Dense(4, name="tower")(x)
        """)
    path = write(tmp_path, "model.py", """\
        import keras
        import blocks

        loss = []  # a fresh object per load: each load is its own module

        def build_model():
            inp = keras.Input((3,))
            return keras.Model(inp, blocks.tower(inp))
        """)
    first, second = load_model_source(path), load_model_source(path)
    model = build(first)
    assert [l.name for l in model.layers][-1] == "tower"
    assert first.loss == [] and first.loss is not second.loss
    assert profile_source(second).params == 16
    assert str(tmp_path) not in __import__("sys").path  # removed again after loading


def test_unbuilt_model_needs_input_or_sample_batch(tmp_path):
    body = textwrap.dedent("""\
        import keras
        import numpy as np

        class Net(keras.Model):
            def __init__(self):
                super().__init__()
                self.dense = keras.layers.Dense(3)

            def call(self, x):
                return self.dense(x)

        def build_model():
            return Net()
        """)
    path = write(tmp_path, "sub_model.py", body)
    with pytest.raises(ModelLoadError) as err:
        build(load_model_source(path))
    assert "keras.Input" in str(err.value) and "sample_batch" in str(err.value)
    path = write(tmp_path, "sub_model_with_batch.py", body + textwrap.dedent("""\

        def sample_batch(batch_size):
            return np.zeros((batch_size, 5), np.float32), np.zeros((batch_size,), np.int32)
        """))

    profile = profile_source(load_model_source(path), 2)  # built in graph mode via sample_batch
    assert profile.params == 5 * 3 + 3
    # traced through sample_batch's shapes: the sub-layer's ops are counted, with a warning
    (dense,) = profile.layers
    assert dense.flops_fwd == 2 * 2 * 5 * 3 + 2 * 3  # MatMul + BiasAdd
    assert profile.not_counted == () and any("subclassed" in w for w in profile.warnings)


def test_module_function_errors():
    with pytest.raises(ModelLoadError, match="Could not import module 'no_such_module_xyz'"):
        load_model_source("no_such_module_xyz:build")
    with pytest.raises(ModelLoadError) as err:
        load_model_source("keras.applications:MobileNetV9")
    assert "has no attribute 'MobileNetV9'" in str(err.value) and "MobileNetV2" in str(err.value)
    with pytest.raises(ModelLoadError, match="needs arguments"):
        load_model_source("keras.layers:Dense")
    with pytest.raises(ModelLoadError, match="does not exist"):
        load_model_source("not_a_spec")


def test_module_function_gets_weights_none(tmp_path, monkeypatch):
    write(tmp_path, "fake_zoo.py", """\
        import keras

        def Net(input_shape=(4,), weights="imagenet"):
            if weights is not None:
                raise RuntimeError("would download " + weights)
            inp = keras.Input(input_shape)
            return keras.Model(inp, keras.layers.Dense(2)(inp))
        """)
    monkeypatch.syspath_prepend(str(tmp_path))
    source = load_model_source("fake_zoo:Net")
    assert (source.name, source.origin) == ("Net", "fake_zoo:Net")
    assert source.loss is None and source.optimizer is None and source.sample_batch is None
    assert build(source).count_params() == 4 * 2 + 2


@pytest.mark.parametrize("line, expected", [
    ("import apply", "from tfplan import apply"),
    ("from planner.presets import parse_cluster", "'tfplan.core.presets'"),
    ("from profiler.static import profile_model", "'tfplan.profiler.static'"),
])
def test_model_file_with_the_old_package_names_is_told_the_new_ones(tmp_path, line, expected):
    path = write(tmp_path, "old_names_model.py", f"""\
        {line}

        def build_model():
            raise AssertionError("not reached")
        """)
    with pytest.raises(ModelLoadError) as err:
        load_model_source(path)
    message = str(err.value)
    assert "ModuleNotFoundError" in message and "since version 0.2" in message
    assert expected in message
    assert_user_traceback(message, path, line)
