"""config.mid is checked before any work: a missing shard directory is one ConfigError naming
the key and the command that writes one."""

import pytest

from configs import qwen3vl_grpo
from cua_jax.config.checks import ConfigError
from cua_jax.demos.grounding import render_sample
from cua_jax.demos.shards import write_shards
from cua_jax.job.builders import check_mid


def test_mid_needs_shard_directories(tmp_path):
    c = qwen3vl_grpo.get_config("smoke")
    c.mid.source = str(tmp_path / "none")
    check_mid(c)  # mid.steps=0: nothing to check
    c.mid.steps = 5
    with pytest.raises(ConfigError, match=r"config\.mid\.source=.*make_grounding_data"):
        check_mid(c)
    write_shards((render_sample(i) for i in range(3)), str(tmp_path / "train"))
    c.mid.source = str(tmp_path / "train")
    check_mid(c)
    c.mid.heldout = str(tmp_path)  # a directory, but no index.json
    with pytest.raises(ConfigError, match=r"config\.mid\.heldout="):
        check_mid(c)
