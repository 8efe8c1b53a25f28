"""tools/export_hf.py: a checkpoint (full FT and LoRA) -> an HF dir whose logits equal ours."""

import os
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from configs import qwen3vl_grpo  # noqa: E402
from cua_jax import sharding as shd  # noqa: E402
from cua_jax.checkpoint.orbax_io import Checkpointer  # noqa: E402
from cua_jax.job import builders  # noqa: E402
from cua_jax.models.qwen_vl.vision import lift_pixels  # noqa: E402
from tests.models.hf_tiny import hf_logits  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _fake_run(workdir, lora_rank):
    """A run directory as train.main leaves it, with parameters moved away from their init."""
    c = qwen3vl_grpo.get_config("smoke")
    c.unlock()
    c.model.lora_rank = lora_rank
    os.makedirs(workdir, exist_ok=True)
    with open(os.path.join(workdir, "config.json"), "w") as f:
        f.write(c.to_json_best_effort())
    mesh = shd.make_mesh(1, 1, 1, devices=jax.devices()[:1])
    model, proc = builders.build_model_and_processor(c, mesh, shd.DEFAULT_RULES)
    learner = builders.build_learner(model, c, mesh, shd.DEFAULT_RULES, sft=False)
    model = learner.model  # the policy as the learner trains it (LoRA applied, sharded)
    state = learner.state_dict()
    rng = np.random.default_rng(0)
    state["params"] = jax.tree.map(
        lambda x: x + 0.05 * rng.standard_normal(x.shape).astype(x.dtype), state["params"]
    )
    learner.load_state_dict(state)
    ck = Checkpointer(os.path.join(workdir, "checkpoints"))
    ck.save(7, learner.state_dict(), {"cursor": 0}, force=True)
    ck.close()
    return model, proc


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_export_matches_our_logits(tmp_path, lora_rank):
    import transformers

    wd, out = str(tmp_path / "run"), str(tmp_path / "hf")
    model, proc = _fake_run(wd, lora_rank)
    screen = np.random.default_rng(1).integers(0, 255, (288, 384, 3), np.uint8)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "click"}]}]
    rendered, vis = proc.render_chat(msgs, images=[screen], add_generation_prompt=True)
    ids = rendered.input_ids[None]
    ours = np.asarray(
        model(ids, pixel_values=vis["pixel_values"], image_grid_thw=vis["image_grid_thw"])
    )
    tool = [sys.executable, os.path.join(ROOT, "tools", "export_hf.py")]
    r = subprocess.run(
        [*tool, f"--workdir={wd}", f"--out={out}"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "exported step 7" in r.stdout
    hf, info = transformers.Qwen3VLForConditionalGeneration.from_pretrained(
        out, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    # transformers takes the screens as floats: the bytes lifted as our model lifts them (the
    # lift is bit-equal to the float processor: tests/models/test_screen_bytes.py)
    pv = np.asarray(vis["pixel_values"])
    if pv.dtype == np.uint8:
        pv = np.asarray(lift_pixels(pv, model.config))
    theirs = hf_logits(hf.float().eval(), ids, None, pv, vis["image_grid_thw"])
    np.testing.assert_allclose(theirs, ours, atol=1e-4, rtol=0)
    assert os.path.isfile(os.path.join(out, "cua_jax_tokenizer.model"))
    # generate() stops at the shipped tokenizer's <|im_end|> and pads with <|endoftext|>
    gen = transformers.GenerationConfig.from_pretrained(out)
    tok = proc.tokenizer
    assert gen.eos_token_id in (tok.eos_id, [tok.eos_id]) and gen.pad_token_id == tok.pad_id
