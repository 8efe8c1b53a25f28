"""cua_jax.config.limits: one row per numeric config key; NaN, infinite, negative and zero values
the issue found accepted are rejected naming the key, value and range; every preset passes."""

import glob
import importlib.util
import math
import os

import pytest

from configs import common
from cua_jax.config.limits import LIMITS, LimitError, check_limits

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG_FILES = sorted(
    p
    for p in glob.glob(os.path.join(ROOT, "configs", "*.py"))
    if os.path.basename(p) not in ("__init__.py", "common.py")
)
FAMILIES = ("qwen3_vl", "qwen2_5_vl")


def _load(path):
    spec = importlib.util.spec_from_file_location(os.path.basename(path)[:-3], path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _presets():
    for path in CONFIG_FILES:
        for preset in _load(path).PRESETS:
            yield pytest.param(path, preset, id=f"{os.path.basename(path)}:{preset}")


def _numeric_keys(node, prefix=""):
    """Dotted keys of the int/float leaves (and sequences of numbers) of a ConfigDict."""
    for k, v in node.items():
        key = f"{prefix}{k}"
        if isinstance(v, common.ConfigDict):
            yield from _numeric_keys(v, key + ".")
        elif isinstance(v, int | float) and not isinstance(v, bool):
            yield key
        elif (
            isinstance(v, tuple)
            and v
            and all(isinstance(x, int | float) and not isinstance(x, bool) for x in v)
        ):
            yield key


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_has_every_numeric_key(family):
    keys = set(_numeric_keys(common.base_config(family)))
    assert keys - set(LIMITS) == set(), "numeric keys with no row in config_limits.LIMITS"
    assert set(LIMITS) - keys == set(), "rows of config_limits.LIMITS for no config key"


@pytest.mark.parametrize("path,preset", list(_presets()))
def test_every_preset_passes(path, preset):
    check_limits(_load(path).get_config(preset))


# The values issue 20 found accepted, and a few more of each kind.
BAD = [
    ("sft.learning_rate", math.nan, "a finite number > 0"),
    ("rl.learning_rate", math.inf, "a finite number > 0"),
    ("rl.learning_rate", 0.0, "a finite number > 0"),
    ("total_steps", -5, "an integer >= 0"),
    ("sft.steps", -3, "an integer >= 0"),
    ("rl.clip_low", 5.0, "in [0, 1)"),
    ("rl.clip_high", -0.1, ">= 0"),
    ("rl.rows_per_step", 0, "an integer >= 1"),
    ("env.max_history_images", -1, "an integer >= 1"),
    ("env.step_timeout_s", -1.0, "a finite number > 0"),
    ("env.viewport_width", 0, "in [64, 8192]"),
    ("env.viewport_height", 0, "in [64, 8192]"),
    ("env.desktop_command_cpu_s", 0.5, "in [1, 86400] or 0"),
    ("sampler.decode_chunk", 0, "an integer >= 1"),
    ("rl.temperature", -math.inf, "> 0"),
    ("optim.b2", 1.0, "in [0, 1)"),
    ("optim.grad_clip", math.nan, ">= 0"),
    ("mesh.fsdp", 0, "an integer >= 1 or -1"),
    ("ckpt.init_params_step", -2, ">= 0 or -1"),
    ("sft.recovery_share", 1.5, "in [0, 1]"),
    ("rl.row_lengths", (512, 0), "a sequence of integers >= 1"),
    ("rl.row_lengths", (), "a sequence of integers >= 1"),
]


@pytest.mark.parametrize("key,value,allowed", BAD, ids=[f"{k}={v!r}" for k, v, _ in BAD])
def test_bad_values_are_rejected_naming_key_value_and_range(key, value, allowed):
    c = _load(os.path.join(ROOT, "configs", "qwen3vl_grpo.py")).get_config("smoke")
    section, _, name = key.rpartition(".")
    node = c[section] if section else c
    with node.ignore_type():
        setattr(node, name, value)
    with pytest.raises(LimitError) as info:
        check_limits(c)
    msg = str(info.value)
    assert msg.startswith(f"config.{key}={value!r} is out of range: "), msg
    assert allowed in msg, msg
    assert isinstance(info.value, ValueError)


def test_values_with_a_meaning_of_their_own_pass():
    c = _load(os.path.join(ROOT, "configs", "qwen25vl_grpo.py")).get_config("smoke")
    c.mesh.fsdp = -1
    c.ckpt.init_params_step = -1
    c.total_steps = 0  # SFT and evaluation only
    c.rl.logits_chunk = 0
    c.sampler.kv_memory_fraction = 0.9
    check_limits(c)


def test_a_nan_from_the_command_line_is_rejected():
    """What `--config.sft.learning_rate=nan` gives: the flag parser accepts it as a float."""
    from absl import flags
    from ml_collections import config_flags

    path = os.path.join(ROOT, "configs", "qwen3vl_grpo.py")
    argv = ["prog", f"--config={path}:smoke", "--config.sft.learning_rate=nan"]
    fv = flags.FlagValues()
    config_flags.DEFINE_config_file("config", flag_values=fv, sys_argv=argv)
    fv(argv)
    assert math.isnan(fv.config.sft.learning_rate)
    with pytest.raises(LimitError, match=r"config\.sft\.learning_rate=nan is out of range"):
        check_limits(fv.config)
