import pytest


@pytest.fixture(scope="module")
def hf_model_qwen25(tmp_path_factory):
    """The tiny random Qwen2.5-VL (seed 2), saved by transformers and loaded by us: the engine
    batching and stress tests' model (one per module; needs the test extra's torch)."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from cua_jax.models import qwen_vl
    from tests.models.hf_tiny import make_hf_model

    d = tmp_path_factory.mktemp("hf")
    make_hf_model("qwen2_5_vl", seed=2).save_pretrained(str(d))
    return qwen_vl.from_pretrained(str(d))
