"""Hugging Face checkpoint import/export for `QwenVL`: ONE table, used both ways.

HF tensor names are first brought to the transformers-5 layout (`model.visual.*`,
`model.language_model.*`, `lm_head.*`); the original Qwen2.5-VL layout (`visual.*`,
`model.layers.*`, `model.embed_tokens.*`, `model.norm.*`) is accepted on load, and is what
`save_pretrained` writes for Qwen2.5-VL (as transformers itself and the published checkpoints
do). Then `TABLE` maps each name to a module path and the array transform:
  * "conv":  Conv3d weight [E, c, t, p, p] <-> patch matmul kernel [c*t*p*p, E]
  * "T":     Linear weight [out, in]       <-> kernel [in, out]
  * "experts_gate_up": MoE `mlp.experts.gate_up_proj` [E, 2F, D] (gate rows, then up rows)
             <-> [E, D, 2, F];  "experts_down": `mlp.experts.down_proj` [E, D, F] <-> [E, F, D]
  * None:    same array (biases, norm weights, embeddings, pos_embed)

Qwen3.5-MoE's experts are one tensor per expert (`mlp.experts.{e}.gate_proj.weight` [F, D],
`up_proj` [F, D], `down_proj` [D, F]: what transformers 5 writes for it and reads with its
qwen2_moe conversion); they are stacked on load into the arrays below and split again on
export (`PER_EXPERT`). Other MoE expert tensors are written as transformers 5 saves them
([E, 2F, D], [E, D, F]: its module layout). The published Qwen3-VL-MoE checkpoints store them
transposed ([E, D, 2F], [E, F, D]); both load, told apart by shape as transformers' own
conversion does (when D == 2F, resp. D == F, the shapes coincide and the transformers-5 layout
is assumed, as transformers assumes).

`from_pretrained` streams tensor by tensor and places each one directly with its target
NamedSharding (each device reads only its own slice through safetensors' lazy slices), so a
72B load never holds the whole model on one host. `save_pretrained` writes transformers-loadable
safetensors (sharded above `max_shard_bytes`, with an index), config.json,
generation_config.json and the tokenizer files of `tokenizer_dir`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from cua_jax import sharding as shd
from cua_jax.models.qwen_vl.config import QwenVLConfig
from cua_jax.models.qwen_vl.model import QwenVL
from cua_jax.models.qwen_vl.moe import set_expert_mesh

# Modules that are torch nn.Linear in transformers (their `weight` is transposed to `kernel`).
_LINEAR = "|".join(
    (
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
        "qkv",
        "proj",
        "linear_fc1",
        "linear_fc2",
        r"mlp\.0",
        r"mlp\.2",
        r"mlp\.gate",
        # Qwen3.5: Gated DeltaNet projections and the MoE shared expert's gate
        "in_proj_qkv",
        "in_proj_z",
        "in_proj_b",
        "in_proj_a",
        "out_proj",
        "shared_expert_gate",
    )
)


@dataclasses.dataclass(frozen=True)
class Rule:
    hf: str  # regex on the (new-layout) HF name
    ours: str  # replacement giving our dotted module path
    ours_re: str  # regex on our path (export direction)
    hf_out: str  # replacement giving the HF name
    kind: str | None  # "conv" | "T" | None


TABLE: tuple[Rule, ...] = (
    Rule(
        r"^(model\.visual\.patch_embed\.proj)\.weight$",
        r"\1.kernel",
        r"^(model\.visual\.patch_embed\.proj)\.kernel$",
        r"\1.weight",
        "conv",
    ),
    Rule(rf"^(.*\.(?:{_LINEAR}))\.weight$", r"\1.kernel", r"^(.*)\.kernel$", r"\1.weight", "T"),
    Rule(r"^lm_head\.weight$", "lm_head.kernel", r"^lm_head\.kernel$", "lm_head.weight", "T"),
    Rule(
        r"^(.*\.mlp\.experts\.gate_up_proj)$",
        r"\1",
        r"^(.*\.mlp\.experts\.gate_up_proj)$",
        r"\1",
        "experts_gate_up",
    ),
    Rule(
        r"^(.*\.mlp\.experts\.down_proj)$",
        r"\1",
        r"^(.*\.mlp\.experts\.down_proj)$",
        r"\1",
        "experts_down",
    ),
    Rule(r"^(.*)$", r"\1", r"^(.*)$", r"\1", None),
)

# Original Qwen2.5-VL checkpoint layout -> transformers-5 layout.
LEGACY_RENAMES: tuple[tuple[str, str], ...] = (
    (r"^visual\.", "model.visual."),
    (r"^model\.(?!visual\.|language_model\.)", "model.language_model."),
)


# transformers 5 writes Qwen2.5-VL back in its original layout (and Qwen3-VL in the new one);
# save_pretrained does the same so exported directories look like the published checkpoints.
EXPORT_RENAMES: dict[str, tuple[tuple[str, str], ...]] = {
    "qwen2_5_vl": ((r"^model\.visual\.", "visual."), (r"^model\.language_model\.", "model.")),
    "qwen3_vl": (),
    "qwen3_5": (),
}

# One tensor per expert (Qwen3.5-MoE): merged into / split from our stacked expert arrays.
PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
PER_EXPERT_FAMILIES = ("qwen3_5",)


def _per_expert_target(m: re.Match) -> tuple[str, int, str]:
    """(our stacked array's path, expert index, part) of a per-expert HF tensor name."""
    prefix, e, part = m.group(1), int(m.group(2)), m.group(3)
    return f"{prefix}.{'down_proj' if part == 'down_proj' else 'gate_up_proj'}", e, part


def _stack_expert(buf: np.ndarray, e: int, part: str, w: np.ndarray, name: str) -> None:
    """Write HF expert tensor `w` (gate/up [F, D], down [D, F]) into stacked `buf` (gate_up
    [E, D, 2, F], down [E, F, D])."""
    if e >= buf.shape[0]:
        raise ValueError(f"tensor {name!r}: expert {e} but the config has {buf.shape[0]} experts")
    want = buf.shape[1:][::-1] if part == "down_proj" else (buf.shape[3], buf.shape[1])
    if tuple(w.shape) != tuple(want):
        raise ValueError(
            f"tensor {name!r} has shape {tuple(w.shape)} but the config expects {tuple(want)}; "
            "check config.json matches the weights"
        )
    if part == "down_proj":
        buf[e] = w.T
    else:
        buf[e, :, 0 if part == "gate_proj" else 1, :] = w.T


def _split_experts(name: str, kind: str, ours: np.ndarray) -> dict[str, np.ndarray]:
    """Our stacked expert array -> per-expert HF tensors (inverse of `_stack_expert`)."""
    prefix = name.rsplit(".", 1)[0]
    if kind == "experts_down":  # [E, F, D] -> E x [D, F]
        return {f"{prefix}.{e}.down_proj.weight": ours[e].T for e in range(ours.shape[0])}
    out = {}
    for e in range(ours.shape[0]):  # [E, D, 2, F] -> E x ([F, D], [F, D])
        out[f"{prefix}.{e}.gate_proj.weight"] = ours[e, :, 0, :].T
        out[f"{prefix}.{e}.up_proj.weight"] = ours[e, :, 1, :].T
    return out


# Tensors a checkpoint may carry that the policy does not use: Qwen3.5's multi-token-prediction
# head (`mtp.*`, skipped by transformers' Qwen3.5 models too).
IGNORED_ON_LOAD: dict[str, str] = {"qwen3_5": r"^mtp\."}


def export_hf_name(path: str, family: str) -> tuple[str, str | None]:
    """Our module path -> (HF tensor name in the family's published layout, transform)."""
    name, kind = ours_to_hf(path)
    for pat, rep in EXPORT_RENAMES[family]:
        name = re.sub(pat, rep, name)
    return name, kind


def canonical_hf_name(name: str) -> str:
    for pat, rep in LEGACY_RENAMES:
        name = re.sub(pat, rep, name)
    return name


def hf_to_ours(hf_name: str) -> tuple[str, str | None]:
    name = canonical_hf_name(hf_name)
    for r in TABLE:
        if re.match(r.hf, name):
            return re.sub(r.hf, r.ours, name), r.kind
    raise AssertionError("TABLE ends with a catch-all")


def ours_to_hf(path: str) -> tuple[str, str | None]:
    for r in TABLE:
        if re.match(r.ours_re, path):
            return re.sub(r.ours_re, r.hf_out, path), r.kind
    raise AssertionError("TABLE ends with a catch-all")


def _hf_shape(ours_shape: tuple[int, ...], kind: str | None, cfg: QwenVLConfig) -> tuple[int, ...]:
    if kind == "T":
        return tuple(reversed(ours_shape))
    if kind == "conv":
        v = cfg.vision
        return (ours_shape[1], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size)
    if kind == "experts_gate_up":
        E, D, two, F = ours_shape
        return (E, two * F, D)
    if kind == "experts_down":
        E, F, D = ours_shape
        return (E, D, F)
    return ours_shape


def _published_expert_shape(ours_shape: tuple[int, ...], kind: str | None) -> tuple | None:
    """The shape of an expert tensor in the published checkpoints' layout (None: not one)."""
    if kind == "experts_gate_up":
        E, D, two, F = ours_shape
        return (E, D, two * F)
    if kind == "experts_down":
        return ours_shape
    return None


def _reader(sl, kind: str | None) -> Callable[[tuple[slice, ...]], np.ndarray]:
    """Read the `index` slice of OUR array from a lazy safetensors slice of the HF tensor.

    Kinds ending in "_published" read an expert tensor stored in the published layout."""

    def read(index: tuple[slice, ...]) -> np.ndarray:
        if kind == "T":
            i, o = index
            return np.asarray(sl[o, i]).T
        if kind == "conv":
            k, e = index
            w = np.asarray(sl[e])
            return w.reshape(w.shape[0], -1)[:, k].T
        if kind == "experts_gate_up":  # [E, 2F, D] -> [E, D, 2, F]
            e, d, two, f = index
            w = np.asarray(sl[e, :, d])
            w = w.reshape(w.shape[0], 2, -1, w.shape[2]).transpose(0, 3, 1, 2)
            return w[:, :, two, f]
        if kind == "experts_gate_up_published":  # [E, D, 2F] -> [E, D, 2, F]
            e, d, two, f = index
            w = np.asarray(sl[e, d, :])
            return w.reshape(*w.shape[:2], 2, -1)[:, :, two, f]
        if kind == "experts_down":  # [E, D, F] -> [E, F, D]
            e, f, d = index
            return np.asarray(sl[e, d, f]).transpose(0, 2, 1)
        return np.asarray(sl[tuple(index)] if index else sl[:])

    return read


def hf_array(ours: np.ndarray, kind: str | None, cfg: QwenVLConfig) -> np.ndarray:
    """Our array -> the HF tensor (export direction of `_reader`)."""
    if kind == "T":
        return ours.T
    if kind == "conv":
        v = cfg.vision
        return ours.T.reshape(
            ours.shape[1], v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size
        )
    if kind == "experts_gate_up":
        E, D, two, F = ours.shape
        return ours.transpose(0, 2, 3, 1).reshape(E, two * F, D)
    if kind == "experts_down":
        return ours.transpose(0, 2, 1)
    return ours


def _np_dtype(name: str):
    return {"float32": np.float32, "bfloat16": ml_dtypes.bfloat16}[name]


def _checkpoint_files(path: str) -> list[str]:
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(path, f) for f in files]
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(single):
        return [single]
    found = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not found:
        raise FileNotFoundError(f"no *.safetensors (or model.safetensors.index.json) in {path}")
    return [os.path.join(path, f) for f in found]


def _pixel_norm(path: str) -> dict[str, tuple[float, ...]]:
    """image_mean / image_std of the directory's preprocessor_config.json, when it has them:
    the normalization the vision tower applies to screens given as bytes."""
    pre = os.path.join(path, "preprocessor_config.json")
    if not os.path.isfile(pre):
        return {}
    with open(pre) as f:
        d = json.load(f)
    return {k: tuple(float(x) for x in d[k]) for k in ("image_mean", "image_std") if k in d}


def from_pretrained(
    path: str,
    dtype: str = "float32",
    mesh: jax.sharding.Mesh | None = None,
    rules: shd.Rules | None = None,
    *,
    compute_dtype: str | None = None,
    remat: str = "none",
) -> QwenVL:
    """Load a local HF Qwen2.5-VL / Qwen3-VL / Qwen3.5 directory (dense or MoE) into a `QwenVL`.

    `dtype` is the parameter dtype ("float32" | "bfloat16"), `compute_dtype` the activation
    dtype (default: `dtype`). With `mesh`, each tensor is created with its NamedSharding under
    `rules` (default `cua_jax.sharding.DEFAULT_RULES`) from per-device slices; otherwise on
    the default device. Raises ValueError naming the tensor for a missing, misshapen or
    unexpected tensor.
    """
    with open(os.path.join(path, "config.json")) as f:
        cfg = QwenVLConfig.from_hf_dict(
            json.load(f),
            param_dtype=dtype,
            dtype=compute_dtype or dtype,
            remat=remat,
            **_pixel_norm(path),
        )
    rules = shd.DEFAULT_RULES if rules is None else rules
    abstract = nnx.eval_shape(lambda: QwenVL(cfg, rngs=nnx.Rngs(0)))
    graphdef, state = nnx.split(abstract)
    targets = {".".join(map(str, p)): v for p, v in nnx.to_flat_state(state)}
    np_dtype = _np_dtype(dtype)
    loaded: dict[str, jax.Array] = {}

    def place(ours: str, var, read) -> jax.Array:
        shape = tuple(var.get_value().shape)
        if mesh is None:
            return jnp.asarray(read(tuple(slice(None) for _ in shape)).astype(np_dtype))
        sharding = shd.named_sharding(shd.logical_axes(var), shape, mesh, rules, ours)
        return jax.make_array_from_callback(shape, sharding, lambda idx: read(idx).astype(np_dtype))

    # per-expert tensors being stacked: our path -> (host buffer, (expert, part) pairs seen);
    # a stack is placed (and its buffer dropped) as soon as its last expert arrives
    stacks: dict[str, tuple[np.ndarray, set]] = {}
    for file in _checkpoint_files(path):
        with safe_open(file, framework="np") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
                ignored = IGNORED_ON_LOAD.get(cfg.family)
                if ignored and re.match(ignored, name):
                    continue
                per_expert = PER_EXPERT.match(canonical_hf_name(name))
                if per_expert and cfg.family in PER_EXPERT_FAMILIES:
                    ours, e, part = _per_expert_target(per_expert)
                    if ours not in targets:
                        raise ValueError(
                            f"unexpected tensor {name!r} in {file}: this {cfg.family} config "
                            f"has no {ours!r}; check config.json matches the weights"
                        )
                    var = targets[ours]
                    shape = tuple(var.get_value().shape)
                    buf, seen = stacks.setdefault(ours, (np.zeros(shape, np_dtype), set()))
                    _stack_expert(buf, e, part, f.get_tensor(name), name)
                    seen.add((e, part))
                    if len(seen) == shape[0] * (1 if part == "down_proj" else 2):
                        loaded[ours] = place(ours, var, lambda idx, buf=buf: buf[idx])
                        del stacks[ours]
                    continue
                ours, kind = hf_to_ours(name)
                if ours not in targets:
                    if ours == "lm_head.kernel" and cfg.tie_word_embeddings:
                        continue  # tied checkpoints may still carry a copy of the embedding
                    raise ValueError(
                        f"unexpected tensor {name!r} in {file} (maps to {ours!r}, which this "
                        f"{cfg.family} config does not have); check config.json matches the weights"
                    )
                var = targets[ours]
                shape = tuple(var.get_value().shape)
                sl = f.get_slice(name)
                want = _hf_shape(shape, kind, cfg)
                got = tuple(sl.get_shape())
                if got != want and got == _published_expert_shape(shape, kind):
                    kind = f"{kind}_published"
                elif got != want:
                    raise ValueError(
                        f"tensor {name!r} has shape {got} but the config expects {want}; "
                        "check config.json matches the weights"
                    )
                loaded[ours] = place(ours, var, _reader(sl, kind))
    for ours, (buf, seen) in stacks.items():
        E = buf.shape[0]
        parts = ("down_proj",) if ours.endswith("down_proj") else ("gate_proj", "up_proj")
        absent = sorted(f"{e}.{p}" for e in range(E) for p in parts if (e, p) not in seen)
        raise ValueError(
            f"checkpoint {path} is missing {len(absent)} per-expert tensor(s) of "
            f"{ours.rsplit('.', 1)[0]}: experts {absent[:10]}{' ...' if len(absent) > 10 else ''}"
        )
    missing = sorted(set(targets) - set(loaded))
    if missing:
        names = [export_hf_name(m, cfg.family)[0] for m in missing]
        raise ValueError(
            f"checkpoint {path} is missing {len(missing)} tensor(s): {names[:10]}"
            f"{' ...' if len(names) > 10 else ''}"
        )
    for p, var in targets.items():
        var.set_value(loaded[p])
    model = nnx.merge(graphdef, state)
    if mesh is not None:
        set_expert_mesh(model, mesh, rules)
    return model


def _to_host(x: jax.Array) -> np.ndarray:
    if not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "merges.txt",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "chat_template.json",
    "chat_template.jinja",
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)


def save_pretrained(
    model: QwenVL,
    out_dir: str,
    tokenizer_dir: str | None = None,
    *,
    max_shard_bytes: int = 4 * 1024**3,
) -> None:
    """Write `model` as a transformers-loadable HF directory (process 0 writes on multi-host)."""
    cfg = model.config
    tensors: dict[str, np.ndarray] = {}
    for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        ours = ".".join(map(str, path))
        name, kind = export_hf_name(ours, cfg.family)
        host = _to_host(var.get_value())
        if cfg.family in PER_EXPERT_FAMILIES and kind in ("experts_gate_up", "experts_down"):
            split = _split_experts(name, kind, host)
            tensors.update({n: np.ascontiguousarray(a) for n, a in split.items()})
            continue
        tensors[name] = np.ascontiguousarray(hf_array(host, kind, cfg))
    if jax.process_index() != 0:
        return
    os.makedirs(out_dir, exist_ok=True)
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    meta = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
    else:
        weight_map = {}
        for i, shard in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, os.path.join(out_dir, fname), metadata=meta)
            weight_map.update({n: fname for n in shard})
        total = int(sum(t.nbytes for t in tensors.values()))
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=2)
    gen: dict[str, Any] = {
        k: getattr(cfg.text, k)
        for k in ("bos_token_id", "eos_token_id", "pad_token_id")
        if getattr(cfg.text, k) is not None
    }
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
    source_gen = (
        None if tokenizer_dir is None else os.path.join(tokenizer_dir, "generation_config.json")
    )
    if source_gen is not None and os.path.exists(source_gen):
        # the source checkpoint's own (eos lists, sampling defaults) rather than our minimal one
        shutil.copy(source_gen, os.path.join(out_dir, "generation_config.json"))
    if tokenizer_dir is not None:
        for fname in TOKENIZER_FILES:
            src = os.path.join(tokenizer_dir, fname)
            if os.path.exists(src):
                shutil.copy(src, os.path.join(out_dir, fname))
