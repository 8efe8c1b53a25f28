"""cua_jax's Gated DeltaNet layer (cua_jax/models/qwen_vl/gated_deltanet.py) against
transformers' `Qwen3_5GatedDeltaNet` on a tiny random config, f32, within 1e-4.

The HF layer is built locally with every parameter re-drawn (norm weight, dt_bias and A_log
included) and loaded into ours with `load_hf_tensors`. D = 40 differs from every projection's
output size, so a transposed kernel fails on shape or value.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet  # noqa: E402

from cua_jax.models.qwen_vl.gated_deltanet import (  # noqa: E402
    GatedDeltaNet,
    GatedDeltaNetConfig,
    LinearAttnState,
    layer_types,
    load_hf_tensors,
)

TOL = 1e-4
T = 70  # two chunks of 64, the second partial
HF_FIELDS = dict(
    hidden_size=40,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
)


def _hf_config(**kw):
    return transformers.Qwen3_5TextConfig(
        vocab_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        **HF_FIELDS,
        **kw,
    )


@pytest.fixture(scope="module")
def pair():
    torch.manual_seed(0)
    hf = Qwen3_5GatedDeltaNet(_hf_config(), layer_idx=0).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            scale = 0.3 if name.endswith("weight") and "norm" not in name else 0.5
            p.copy_(torch.randn_like(p) * scale + (1.0 if name == "norm.weight" else 0.0))
    cfg = GatedDeltaNetConfig.from_hf_dict(hf_cfg_dict := _hf_config().to_dict())
    assert cfg.hidden_size == hf_cfg_dict["hidden_size"]
    ours = GatedDeltaNet(cfg, rngs=nnx.Rngs(0))
    load_hf_tensors(ours, {k: v.numpy() for k, v in hf.state_dict().items()})
    return hf, ours


def _x(batch, length, seed):
    return np.random.default_rng(seed).standard_normal((batch, length, 40)).astype(np.float32)


def _hf(hf, x, **kw):
    with torch.no_grad():
        return hf(torch.from_numpy(x), **kw).numpy()


def _close(a, b, tol=TOL):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    err = float(np.max(np.abs(a - b)))
    assert err <= tol, f"max abs diff {err} > {tol}"


@nnx.jit
def _forward(layer, x, state, segment_ids=None, attention_mask=None):
    return layer(x, state=state, segment_ids=segment_ids, attention_mask=attention_mask)


def test_prefill_equals_transformers(pair):
    hf, ours = pair
    x = _x(2, T, 0)
    want = _hf(hf, x)
    assert np.abs(want).max() > 1.0  # outputs of scale ~1-10: 1e-4 is ~1e-5 relative
    y, _ = _forward(ours, x, None)
    _close(y, want)


def test_prefill_then_decode_equals_transformers_with_its_cache(pair):
    hf, ours = pair
    P = 37
    x = _x(2, P + 5, 1)
    full = _hf(hf, x)
    cache = transformers.DynamicCache(config=_hf_config())
    y, state = _forward(ours, x[:, :P], None)
    _close(y, _hf(hf, x[:, :P], cache=cache))
    _close(y, full[:, :P])
    for t in range(P, x.shape[1]):
        y_t, state = _forward(ours, x[:, t : t + 1], state)
        _close(y_t, _hf(hf, x[:, t : t + 1], cache=cache))
        _close(y_t, full[:, t : t + 1])
        layer = cache.layers[0]
        # transformers keeps W conv inputs, of which the oldest is never read
        _close(state.conv, layer.conv_states[0].transpose(1, 2).numpy()[:, 1:], 1e-5)
        _close(state.recurrent, layer.recurrent_states[0].numpy())
    assert state.recurrent.dtype == jnp.float32


def test_left_padding_with_attention_mask_equals_transformers(pair):
    hf, ours = pair
    x = _x(2, 20, 2)
    mask = np.ones((2, 20), np.int64)
    mask[0, :6] = 0
    want = _hf(hf, x, attention_mask=torch.from_numpy(mask))
    y, _ = _forward(ours, x, None, attention_mask=jnp.asarray(mask))
    _close(y, want)


def test_packed_row_equals_the_samples_alone_and_decode_continues(pair):
    _, ours = pair
    la = lb = 35  # sample B starts inside the first chunk and ends inside the second
    x = _x(1, la + lb + 1, 3)
    seg = jnp.asarray(np.repeat([1, 2], [la, lb])[None].astype(np.int32))
    y, state = _forward(ours, x[:, : la + lb], None, segment_ids=seg)
    y_a, _ = _forward(ours, x[:, :la], None)
    y_b, state_b = _forward(ours, x[:, la : la + lb], None)
    _close(y[:, :la], y_a)
    _close(y[:, la:], y_b)
    _close(state.conv, state_b.conv, 1e-5), _close(state.recurrent, state_b.recurrent, 1e-5)
    # the next token of sample B: decode from the packed row's state
    y_next, _ = _forward(ours, x[:, -1:], state)
    y_next_b, _ = _forward(ours, x[:, -1:], state_b)
    _close(y_next, y_next_b)
    # (that the reset matters at all is checked in test_gated_delta_rule.py)


def test_state_zeros_matches_the_layer_and_loading_checks_names(pair):
    _, ours = pair
    _, state = _forward(ours, _x(3, 2, 4), LinearAttnState.zeros(ours.cfg, 3))
    zeros = LinearAttnState.zeros(ours.cfg, 3)
    assert jax.tree.map(jnp.shape, state) == jax.tree.map(jnp.shape, zeros)
    assert [a.dtype for a in state] == [a.dtype for a in zeros]
    hf_names = {k: np.zeros(1) for k in ("A_log", "dt_bias", "conv1d.weight")}
    with pytest.raises(ValueError, match="missing .*in_proj_qkv.kernel"):
        load_hf_tensors(ours, hf_names)


@pytest.mark.parametrize("n_layers,interval", [(8, 4), (6, 3), (5, 2)])
def test_layer_types_follow_transformers(n_layers, interval):
    cfg = transformers.Qwen3_5TextConfig(
        num_hidden_layers=n_layers, full_attention_interval=interval
    )
    assert layer_types(n_layers, interval) == tuple(cfg.layer_types)
