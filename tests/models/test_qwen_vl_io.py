"""HF import/export: round trip through transformers, legacy layout, sharded files, bad input."""

import dataclasses
import json
import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
from flax import nnx  # noqa: E402
from safetensors.numpy import load_file, save_file  # noqa: E402

from cua_jax.models import qwen_vl  # noqa: E402
from cua_jax.models.qwen_vl.config import QwenVLConfig  # noqa: E402
from tests.models.hf_tiny import (  # noqa: E402
    hf_config,
    hf_logits,
    image_inputs,
    make_hf_model,
    prompt_ids,
)


def _params(model) -> dict[str, np.ndarray]:
    return {
        ".".join(map(str, p)): np.asarray(v.get_value())
        for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))
    }


@pytest.mark.parametrize(
    "family,tie", [("qwen2_5_vl", False), ("qwen3_vl", False), ("qwen2_5_vl", True)]
)
def test_round_trip_through_transformers(family, tie, tmp_path):
    """HF -> ours -> save_pretrained -> transformers: same logits, no missing/unexpected keys."""
    hf = make_hf_model(family, seed=5, tie_word_embeddings=tie)
    hf.save_pretrained(tmp_path / "hf")
    ours = qwen_vl.from_pretrained(str(tmp_path / "hf"))
    assert ours.config.tie_word_embeddings == tie
    assert hasattr(ours, "lm_head") != tie
    # a small shard limit forces a multi-file checkpoint with an index
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text('{"model_max_length": 32}')
    (tok / "chat_template.jinja").write_text("{{ messages }}")
    (tok / "unrelated.txt").write_text("not a tokenizer file")
    qwen_vl.save_pretrained(
        ours, str(tmp_path / "out"), tokenizer_dir=str(tok), max_shard_bytes=200_000
    )
    assert (tmp_path / "out" / "chat_template.jinja").read_text() == "{{ messages }}"
    assert (tmp_path / "out" / "tokenizer_config.json").exists()
    assert not (tmp_path / "out" / "unrelated.txt").exists()
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    # same tensor names as transformers' own save_pretrained
    hf_names = set(load_file(str(tmp_path / "hf" / "model.safetensors")))
    assert set(index["weight_map"]) == hf_names
    assert os.path.exists(tmp_path / "out" / "generation_config.json")
    cls = type(hf)
    back, info = cls.from_pretrained(
        str(tmp_path / "out"), output_loading_info=True, attn_implementation="eager"
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    back = back.float().eval()
    pv, grid = image_inputs(family, [(56, 84)], seed=1)
    ids = prompt_ids(grid, [4, 3], seed=2)[None]
    ref = hf_logits(hf, ids, pixel_values=pv, image_grid_thw=grid)
    np.testing.assert_allclose(
        hf_logits(back, ids, pixel_values=pv, image_grid_thw=grid), ref, atol=1e-5
    )
    # and ours reloaded from our own export has identical parameters
    again = qwen_vl.from_pretrained(str(tmp_path / "out"))
    a, b = _params(ours), _params(again)
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_both_qwen25_key_layouts_load(tmp_path):
    """Original Qwen2.5-VL names (visual.*, model.layers.*; what transformers writes) and the
    transformers-5 module names (model.visual.*, model.language_model.*) load identically."""
    hf_dir = tmp_path / "hf"
    make_hf_model("qwen2_5_vl", seed=6).save_pretrained(hf_dir)
    legacy = load_file(str(hf_dir / "model.safetensors"))
    assert "visual.merger.mlp.0.weight" in legacy and "model.layers.0.mlp.up_proj.weight" in legacy
    new = {}
    for name, arr in legacy.items():
        if name.startswith("visual."):
            name = "model." + name
        elif name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        new[name] = arr
    os.makedirs(tmp_path / "new")
    save_file(new, str(tmp_path / "new" / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((hf_dir / "config.json").read_text())
    (tmp_path / "new" / "config.json").write_text(json.dumps(cfg))
    a = _params(qwen_vl.from_pretrained(str(hf_dir)))
    b = _params(qwen_vl.from_pretrained(str(tmp_path / "new")))
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_bf16_load_and_remat_options(tmp_path):
    hf = make_hf_model("qwen3_vl", seed=7)
    hf.save_pretrained(tmp_path / "hf")
    ids = prompt_ids(None, [16], seed=3)[None]
    ref = hf_logits(hf, ids)
    fwd = nnx.jit(lambda m, ids: m(ids))
    full = qwen_vl.from_pretrained(str(tmp_path / "hf"), remat="full")
    np.testing.assert_allclose(np.asarray(fwd(full, ids)), ref, atol=1e-4)
    bf = qwen_vl.from_pretrained(str(tmp_path / "hf"), dtype="bfloat16", remat="dots")
    k = bf.model.language_model.layers[0].mlp.up_proj.kernel.get_value()
    assert k.dtype == np.dtype("bfloat16")
    out = np.asarray(fwd(bf, ids))
    assert out.dtype == np.float32
    # bf16 is not exact, but must track f32 logits closely on O(1)-scale outputs
    assert np.abs(out - ref).max() < 0.15 * np.abs(ref).max()


# ------------------------------------------------------------------------------ bad input
@pytest.fixture(scope="module")
def q25_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("q25")
    make_hf_model("qwen2_5_vl", seed=8).save_pretrained(d)
    return d


def test_image_token_count_mismatch_names_both_counts(q25_dir):
    model = qwen_vl.from_pretrained(str(q25_dir))
    pv, grid = image_inputs("qwen2_5_vl", [(56, 84)], seed=1)  # 6 merged tokens
    ids = prompt_ids(grid, [4, 3], seed=2)
    ids = np.concatenate([ids[:5], ids[6:]])[None]  # drop one image token -> 5
    with pytest.raises(ValueError, match=r"5 image tokens.*6 merged tokens"):
        model(ids, pixel_values=pv, image_grid_thw=grid)


def test_missing_tensor_is_named(q25_dir, tmp_path):
    tensors = load_file(str(q25_dir / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((q25_dir / "config.json").read_text())
    with pytest.raises(
        ValueError, match=r"missing 1 tensor.*'model\.layers\.1\.self_attn\.k_proj\.bias'"
    ):
        qwen_vl.from_pretrained(str(tmp_path))


def test_misshapen_tensor_is_named(q25_dir, tmp_path):
    tensors = load_file(str(q25_dir / "model.safetensors"))
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:, :-1].copy()
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((q25_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"up_proj\.weight.*\(256, 127\).*\(256, 128\)"):
        qwen_vl.from_pretrained(str(tmp_path))


def test_unexpected_tensor_is_named(q25_dir, tmp_path):
    tensors = load_file(str(q25_dir / "model.safetensors"))
    tensors["model.layers.5.mlp.up_proj.weight"] = np.zeros((256, 128), np.float32)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((q25_dir / "config.json").read_text())
    with pytest.raises(ValueError, match=r"unexpected tensor .*layers\.5\.mlp\.up_proj\.weight"):
        qwen_vl.from_pretrained(str(tmp_path))


def _hf_dict(family="qwen3_vl"):
    return hf_config(family).to_dict()


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda d: d.update(model_type="qwen3_moe"), "model_type='qwen3_moe'"),
        # a MoE model_type on a dense text config
        (lambda d: d.update(model_type="qwen3_vl_moe"), r"text_config\.num_experts is missing"),
        (lambda d: d.update(architectures=["Qwen3VLForSomething"]), "architectures"),
        (lambda d: d["text_config"].update(num_experts=8), r"text_config\.num_experts"),
        (lambda d: d["text_config"].pop("hidden_size"), r"text_config\.hidden_size is missing"),
        (lambda d: d["vision_config"].pop("depth"), r"vision_config\.depth is missing"),
        (
            lambda d: d["text_config"]["rope_parameters"].update(rope_type="yarn"),
            "rope_type='yarn'",
        ),
    ],
)
def test_unsupported_config_is_named(mutate, match):
    d = _hf_dict()
    mutate(d)
    with pytest.raises(ValueError, match=match):
        QwenVLConfig.from_hf_dict(d)


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_config_round_trip_and_flat_legacy_layout(family):
    cfg = QwenVLConfig.from_hf_dict(_hf_dict(family))
    preset = qwen_vl.tiny(family)  # the hf_tiny configs are the tiny preset, written for HF
    assert cfg.vision == preset.vision
    ids = ("bos_token_id", "eos_token_id", "pad_token_id")
    assert dataclasses.replace(cfg.text, **{k: getattr(preset.text, k) for k in ids}) == preset.text
    assert cfg.image_token_id == preset.image_token_id
    again = QwenVLConfig.from_hf_dict(cfg.to_hf_dict())
    assert again == cfg
    # transformers reads our export back as the same architecture
    hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf_dict())
    assert hf_cfg.text_config.hidden_size == cfg.text.hidden_size
    assert list(hf_cfg.text_config.rope_parameters["mrope_section"]) == list(cfg.text.mrope_section)
    if family == "qwen2_5_vl":  # the original flat config.json (text fields at top level)
        d = cfg.to_hf_dict()
        text = d.pop("text_config")
        rope = text.pop("rope_parameters")
        scaling = {"type": "mrope", "mrope_section": rope["mrope_section"]}
        flat = {**d, **text, "rope_theta": rope["rope_theta"], "rope_scaling": scaling}
        flat["model_type"] = "qwen2_5_vl"
        assert QwenVLConfig.from_hf_dict(flat) == cfg


# Published config.json files (abridged to the fields that matter), written out by hand.
QWEN25_VL_7B = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}
QWEN3_VL_4B = {
    "architectures": ["Qwen3VLForConditionalGeneration"],
    "image_token_id": 151655,
    "model_type": "qwen3_vl",
    "text_config": {
        "attention_bias": False,
        "bos_token_id": 151643,
        "dtype": "bfloat16",
        "eos_token_id": 151645,
        "head_dim": 128,
        "hidden_act": "silu",
        "hidden_size": 2560,
        "intermediate_size": 9728,
        "max_position_embeddings": 262144,
        "model_type": "qwen3_vl_text",
        "num_attention_heads": 32,
        "num_hidden_layers": 36,
        "num_key_value_heads": 8,
        "rms_norm_eps": 1e-06,
        "rope_scaling": {
            "mrope_interleaved": True,
            "mrope_section": [24, 20, 20],
            "rope_type": "default",
        },
        "rope_theta": 5000000,
        "tie_word_embeddings": True,
        "vocab_size": 151936,
    },
    "tie_word_embeddings": True,
    "video_token_id": 151656,
    "vision_config": {
        "deepstack_visual_indexes": [5, 11, 17],
        "depth": 24,
        "hidden_act": "gelu_pytorch_tanh",
        "hidden_size": 1024,
        "in_channels": 3,
        "intermediate_size": 4096,
        "model_type": "qwen3_vl",
        "num_heads": 16,
        "num_position_embeddings": 2304,
        "out_hidden_size": 2560,
        "patch_size": 16,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
    },
    "vision_end_token_id": 151653,
    "vision_start_token_id": 151652,
}


@pytest.mark.parametrize("d", [QWEN25_VL_7B, QWEN3_VL_4B], ids=["qwen2_5_vl_7b", "qwen3_vl_4b"])
def test_published_configs_parse_build_and_shard(d):
    """Real config.json layouts parse, agree with transformers' reading, build abstractly (no
    memory) with the right parameter count, and divide over an fsdp=4 x tensor=2 mesh."""
    from cua_jax import sharding as shd

    cfg = QwenVLConfig.from_hf_dict(d, param_dtype="bfloat16", dtype="bfloat16")
    hf_cfg = transformers.AutoConfig.for_model(**d)
    assert cfg.text.mrope_section == tuple(hf_cfg.text_config.rope_parameters["mrope_section"])
    assert cfg.text.rope_theta == hf_cfg.text_config.rope_parameters["rope_theta"]
    assert cfg.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert cfg.vision.deepstack_visual_indexes == tuple(
        getattr(hf_cfg.vision_config, "deepstack_visual_indexes", ())
    )
    model = nnx.eval_shape(lambda: qwen_vl.QwenVL(cfg, rngs=nnx.Rngs(0)))
    state = nnx.state(model, nnx.Param)
    n = sum(int(np.prod(v.get_value().shape)) for _, v in nnx.to_flat_state(state))
    with torch.device("meta"):
        ref = transformers.AutoModelForImageTextToText.from_config(hf_cfg)
    assert n == sum(p.numel() for p in ref.parameters())
    mesh = shd.make_mesh(fsdp=4, tensor=2)
    shardings = shd.param_shardings(state, mesh)
    assert len(jax.tree.leaves(shardings)) == len(nnx.to_flat_state(state))


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
def test_from_pretrained_onto_mesh_reads_per_device_slices(family, tmp_path):
    """Loading straight onto an fsdp=4 x tensor=2 mesh (each device reads its own slice of the
    transposed / reshaped tensors) equals a plain load, placed as the rules say."""
    from cua_jax import sharding as shd

    make_hf_model(family, seed=9).save_pretrained(tmp_path)
    mesh = shd.make_mesh(fsdp=4, tensor=2)
    sharded = qwen_vl.from_pretrained(str(tmp_path), mesh=mesh)
    plain = _params(qwen_vl.from_pretrained(str(tmp_path)))
    state = nnx.state(sharded, nnx.Param)
    specs = shd.param_specs(state)
    for path, var in nnx.to_flat_state(state):
        name = ".".join(map(str, path))
        arr = var.get_value()
        assert arr.sharding.spec == specs[name], name
        np.testing.assert_array_equal(np.asarray(arr), plain[name], err_msg=name)
    patch = sharded.model.visual.patch_embed.proj.kernel.get_value()
    assert len({s.index for s in patch.addressable_shards}) == 4  # split over fsdp


@pytest.mark.parametrize("family", ["qwen2_5_vl", "qwen3_vl"])
@pytest.mark.parametrize("top", [True, False, None])
@pytest.mark.parametrize("text", [True, False, None])
def test_tie_and_norm_defaults_read_as_transformers_reads_them(family, top, text):
    """Where config.json puts (or omits) tie_word_embeddings and rms_norm_eps, we read what
    transformers' config class reads: Qwen3-VL ties by the top level only (reading text_config
    too tied a Qwen3-VL with its own lm_head and dropped that head silently)."""
    d = _hf_dict(family)
    d.pop("tie_word_embeddings", None)
    d["text_config"].pop("tie_word_embeddings", None)
    d["text_config"].pop("rms_norm_eps", None)
    if top is not None:
        d["tie_word_embeddings"] = top
    if text is not None:
        d["text_config"]["tie_word_embeddings"] = text
    ours = QwenVLConfig.from_hf_dict(json.loads(json.dumps(d)))
    theirs = transformers.AutoConfig.for_model(**json.loads(json.dumps(d)))
    assert ours.tie_word_embeddings == bool(theirs.tie_word_embeddings)
    assert ours.text.rms_norm_eps == theirs.text_config.rms_norm_eps


def test_export_keeps_the_source_generation_config(tmp_path):
    """A source checkpoint's generation_config.json (eos lists, sampling defaults) is carried
    over to the export instead of our bos/eos/pad-only one."""
    src = tmp_path / "src"
    src.mkdir()
    gen = {"eos_token_id": [7, 8], "temperature": 0.7, "top_p": 0.8, "do_sample": True}
    (src / "generation_config.json").write_text(json.dumps(gen))
    model = qwen_vl.QwenVL(qwen_vl.tiny("qwen3_vl", vocab_size=64), rngs=nnx.Rngs(0))
    qwen_vl.save_pretrained(model, str(tmp_path / "out"), tokenizer_dir=str(src))
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text()) == gen
    qwen_vl.save_pretrained(model, str(tmp_path / "bare"))
    assert "temperature" not in json.loads(
        (tmp_path / "bare" / "generation_config.json").read_text()
    )
