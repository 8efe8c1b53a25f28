"""Every preset of every config file builds, is locked, and has the sections train.py reads."""

import glob
import importlib.util
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG_FILES = sorted(
    p
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if os.path.basename(p) not in ("__init__.py", "common.py")
)
SECTIONS = ("model", "mesh", "sampler", "rl", "optim", "sft", "env", "ckpt", "log")


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cases():
    for path in CONFIG_FILES:
        for preset in _load(path).PRESETS:
            yield pytest.param(path, preset, id=f"{os.path.basename(path)}:{preset}")


def test_there_are_config_files():
    names = {os.path.basename(p) for p in CONFIG_FILES}
    assert {"qwen3vl_grpo.py", "qwen25vl_grpo.py"} <= names


@pytest.mark.parametrize("path,preset", list(_cases()))
def test_every_preset_builds(path, preset):
    c = _load(path).get_config(preset)
    for s in SECTIONS:
        assert s in c, s
    assert c.preset == preset
    assert c.rl.group_size >= 2
    with pytest.raises(AttributeError):
        c.rl.gruop_size = 3  # locked: typos fail by name
    assert isinstance(c.tasks, tuple) and all("source_type" in t for t in c.tasks)
    if preset == "smoke":
        assert c.model.hf_path is None and c.model.preset == "tiny"
    else:
        assert c.model.dtype == "bfloat16"


def test_unknown_preset_names_the_valid_ones():
    mod = _load(os.path.join(ROOT, "configs", "qwen3vl_grpo.py"))
    with pytest.raises(ValueError, match="unknown preset 'huge'.*smoke, 2b, 4b, 8b, 32b"):
        mod.get_config("huge")


def test_load_run_config_fills_fields_added_since_the_run(tmp_path):
    """A run's saved config.json read back: its values (tuples restored, floats kept floats),
    and this version's defaults for fields the run did not have yet."""
    import json

    from configs import common

    saved = json.loads(common.build("qwen2_5_vl", "smoke", ("smoke",)).to_json_best_effort())
    del saved["rl"]["logits_chunk"], saved["ckpt"]["init_params_from"], saved["compile_cache_dir"]
    saved["rl"]["learning_rate"] = 2  # an int where the default is a float
    (tmp_path / "config.json").write_text(json.dumps(saved))
    c = common.load_run_config(str(tmp_path))
    assert c.model.family == "qwen2_5_vl" and c.preset == "smoke"
    assert c.rl.logits_chunk == 1024 and c.ckpt.init_params_from is None
    assert c.compile_cache_dir == "~/.cache/cua_jax/jax"
    assert c.rl.learning_rate == 2.0 and isinstance(c.rl.learning_rate, float)
    assert isinstance(c.rl.row_lengths, tuple) and isinstance(c.tasks[0], dict)
    assert c.env.viewport_width == 384
    with pytest.raises(FileNotFoundError, match="config.json does not exist"):
        common.load_run_config(str(tmp_path / "nope"))
