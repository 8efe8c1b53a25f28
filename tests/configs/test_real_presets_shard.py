"""Every real preset's mesh and sharding rules divide the real checkpoint's shapes.

The shapes are those of the published `config.json` files (text and vision towers); the model is
built abstractly (`nnx.eval_shape`, no memory), so a 72B layout is checked on a laptop. A preset
whose tensor-parallel size does not divide a weight would otherwise fail only on the TPU slice,
at `shard_model`, after the checkpoint download.
"""

import jax
import pytest
from flax import nnx
from jax.sharding import AbstractMesh

from configs import qwen3vl_grpo, qwen25vl_grpo
from cua_jax import sharding as shd
from cua_jax.models import qwen_vl

_IDS = dict(image_token_id=151655, video_token_id=151656, vision_start_token_id=151652,
            vision_end_token_id=151653)  # fmt: skip
# Qwen2.5-VL: one 675M vision tower for every size (out_hidden_size = the text width).
_Q25_VISION = dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16,
                   fullatt_block_indexes=[7, 15, 23, 31], window_size=112)  # fmt: skip
# Qwen3-VL: a smaller tower for 2B / 4B than for 8B / 32B.
_Q3_VISION_SMALL = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16,
                        num_position_embeddings=2304,
                        deepstack_visual_indexes=[5, 11, 17])  # fmt: skip
_Q3_VISION = dict(depth=27, hidden_size=1152, intermediate_size=4304, num_heads=16,
                  num_position_embeddings=2304,
                  deepstack_visual_indexes=[8, 16, 24])  # fmt: skip
# (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings, vision)
REAL = {
    ("qwen2_5_vl", "3b"): (2048, 11008, 36, 16, 2, 151936, True, _Q25_VISION),
    ("qwen2_5_vl", "7b"): (3584, 18944, 28, 28, 4, 152064, False, _Q25_VISION),
    ("qwen2_5_vl", "32b"): (5120, 27648, 64, 40, 8, 152064, False, _Q25_VISION),
    ("qwen2_5_vl", "72b"): (8192, 29568, 80, 64, 8, 152064, False, _Q25_VISION),
    ("qwen3_vl", "2b"): (2048, 6144, 28, 16, 8, 151936, True, _Q3_VISION_SMALL),
    ("qwen3_vl", "4b"): (2560, 9728, 36, 32, 8, 151936, True, _Q3_VISION_SMALL),
    ("qwen3_vl", "8b"): (4096, 12288, 36, 32, 8, 151936, False, _Q3_VISION),
    ("qwen3_vl", "32b"): (5120, 25600, 64, 64, 8, 151936, False, _Q3_VISION),
}
MODULES = {"qwen2_5_vl": qwen25vl_grpo, "qwen3_vl": qwen3vl_grpo}


def real_config(family: str, size: str) -> qwen_vl.QwenVLConfig:
    hidden, inter, layers, heads, kv, vocab, tied, vision = REAL[family, size]
    text = dict(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                tie_word_embeddings=tied)  # fmt: skip
    if family == "qwen3_vl":
        text["head_dim"] = 128
    d = {"model_type": family, "text_config": text, "tie_word_embeddings": tied,
         "vision_config": dict(vision, out_hidden_size=hidden), **_IDS}  # fmt: skip
    return qwen_vl.QwenVLConfig.from_hf_dict(d)


def test_every_real_preset_is_listed():
    listed = {(f, p) for f, m in MODULES.items() for p in m.PRESETS if p != "smoke"}
    assert listed == set(REAL)


@pytest.mark.parametrize("family,size", sorted(REAL))
@pytest.mark.parametrize("fsdp", [8, 32])
def test_preset_mesh_divides_the_real_model(family, size, fsdp):
    config = MODULES[family].get_config(size)
    rules = tuple(shd.DEFAULT_RULES) + tuple(tuple(r) for r in config.mesh.rules)
    mesh = AbstractMesh((config.mesh.data, fsdp, config.mesh.tensor), shd.MESH_AXES)
    cfg = real_config(family, size)
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    specs = shd.param_specs(state, rules)
    shapes = {".".join(map(str, p)): v.get_value().shape for p, v in nnx.to_flat_state(state)}
    assert specs.keys() == shapes.keys()
    for path, spec in specs.items():
        shd._check_divisible(path, shapes[path], spec, mesh)
    n = sum(x.size for x in jax.tree.leaves(state))
    assert 1e9 < n < 1e11  # the model really is the checkpoint's size
