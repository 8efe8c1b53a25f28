"""QwenVLProcessor: image processing, chat rendering and tokenization for the Qwen-VL policy.

    proc = QwenVLProcessor.from_pretrained(hf_dir)      # a local Hugging Face model directory
    proc = QwenVLProcessor.default("qwen3_vl")          # shipped tokenizer, for tiny presets
    batch = proc(text=[...], images=[...])              # like transformers' processor:
    # input_ids i32[B, T], attention_mask i32[B, T], pixel_values f32[N, C*T*P*P],
    # image_grid_thw i32[n_images, 3]; each <|image_pad|> in the text becomes
    # t*h*w/merge**2 pad tokens for its image.

    rendered, vision = proc.render_chat(messages, add_generation_prompt=True)  # ids, loss mask
    rendered, new_vision = proc.extend_chat(rendered, more_messages)         # ids stay a prefix
    batch = proc.collate([rendered, ...], padding_side="left")   # + loss_mask, position_ids

Outputs are numpy (no torch). Parity with transformers' Qwen2_5_VLProcessor / Qwen3VLProcessor
is tested in tests/data/test_processor.py.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from cua_jax.data.chat import (
    ChatRenderer,
    Message,
    RenderedChat,
    images_in_messages,
    mrope_position_ids,
)
from cua_jax.data.image import ImageConfig, ImageLike, num_image_tokens, preprocess_images
from cua_jax.data.tokenizer import (
    HFTokenizer,
    Tokenizer,
    load_default_tokenizer,
)

FAMILIES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")  # qwen3_5: Qwen3-VL's images, its own chat


def _flatten_images(images: Any) -> list[ImageLike]:
    if images is None:
        return []
    if isinstance(images, (list, tuple)):
        flat: list[ImageLike] = []
        for item in images:
            flat.extend(_flatten_images(item) if isinstance(item, (list, tuple)) else [item])
        return flat
    return [images]


def pad_sequences(
    seqs: Sequence[np.ndarray], pad_value: int | bool, padding_side: str
) -> tuple[np.ndarray, np.ndarray]:
    """Stacks 1-D arrays to [B, T_max]; returns (padded, attention_mask i32[B, T_max])."""
    if padding_side not in ("right", "left"):
        raise ValueError(f"padding_side must be 'right' or 'left', got {padding_side!r}")
    t_max = max((len(s) for s in seqs), default=0)
    dtype = seqs[0].dtype if seqs else np.int32
    out = np.full((len(seqs), t_max), pad_value, dtype)
    mask = np.zeros((len(seqs), t_max), np.int32)
    for b, s in enumerate(seqs):
        sl = slice(0, len(s)) if padding_side == "right" else slice(t_max - len(s), t_max)
        out[b, sl] = s
        mask[b, sl] = 1
    return out, mask


class QwenVLProcessor:
    """Ties a Tokenizer, the image settings and chat rendering together.

    family: "qwen2_5_vl", "qwen3_vl" or "qwen3_5" (chooses the chat template style; images come
    from `image_config`).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        image_config: ImageConfig | None = None,
        family: str = "qwen2_5_vl",
    ):
        if family not in FAMILIES:
            raise ValueError(f"unknown model family {family!r}: expected one of {FAMILIES}")
        self.tokenizer = tokenizer
        self.family = family
        self.image_config = image_config or ImageConfig.for_family(
            "qwen3_vl" if family == "qwen3_5" else family
        )
        self.chat = ChatRenderer.for_family(tokenizer, family, self.image_config.merge_size)

    # ---- construction --------------------------------------------------------------------------

    @classmethod
    def from_pretrained(
        cls, hf_dir: str | os.PathLike[str], resize_backend: str = "pil"
    ) -> QwenVLProcessor:
        """Reads preprocessor_config.json (or processor_config.json), config.json and the
        tokenizer files of a local Hugging Face Qwen2.5-VL / Qwen3-VL directory.

        resize_backend: "pil" to equal transformers' PIL image processor, "torchvision" to equal
        its torchvision one (see cua_jax.data.image).
        """
        path = pathlib.Path(hf_dir)
        if not path.is_dir():
            raise FileNotFoundError(f"processor directory {os.fspath(hf_dir)!r} does not exist")
        image_cfg: dict[str, Any] | None = None
        if (path / "preprocessor_config.json").is_file():
            image_cfg = json.loads((path / "preprocessor_config.json").read_text())
        elif (path / "processor_config.json").is_file():
            image_cfg = json.loads((path / "processor_config.json").read_text()).get(
                "image_processor"
            )
        family = None
        if (path / "config.json").is_file():
            model_type = json.loads((path / "config.json").read_text()).get("model_type")
            family = {
                "qwen2_5_vl": "qwen2_5_vl",
                "qwen2_vl": "qwen2_5_vl",
                "qwen3_vl": "qwen3_vl",
                "qwen3_vl_moe": "qwen3_vl",
                "qwen3_5": "qwen3_5",
                "qwen3_5_moe": "qwen3_5",
            }.get(model_type)
        if family is None:
            # No config.json: Qwen3-VL is the one with 16-pixel patches.
            family = "qwen3_vl" if image_cfg and image_cfg.get("patch_size") == 16 else "qwen2_5_vl"
        if image_cfg is None:
            raise FileNotFoundError(
                f"{path} has neither preprocessor_config.json nor processor_config.json; "
                "copy them from the model's Hugging Face directory"
            )
        return cls(
            HFTokenizer.from_dir(path),
            ImageConfig.from_preprocessor_config(image_cfg, resize_backend),
            family,
        )

    @classmethod
    def default(cls, family: str = "qwen3_vl", **image_overrides: Any) -> QwenVLProcessor:
        """The shipped SentencePiece tokenizer + the family's default image settings.

        image_overrides (e.g. max_pixels=...) replace ImageConfig fields; tiny presets use them
        to keep screenshots to a few dozen tokens. "qwen3_5" is Qwen3-VL's processor and chat
        rendering (transformers maps Qwen3.5's model types to Qwen3VLProcessor).
        """
        image = "qwen3_vl" if family == "qwen3_5" else family
        return cls(
            load_default_tokenizer(), ImageConfig.for_family(image, **image_overrides), family
        )

    # ---- images --------------------------------------------------------------------------------

    def preprocess_images(self, images: Sequence[ImageLike]) -> dict[str, np.ndarray]:
        """pixel_values f32[N, C*T*P*P] and image_grid_thw i32[n_images, 3]."""
        return preprocess_images(images, self.image_config)

    # ---- text + images, as transformers' processor ---------------------------------------------

    def __call__(
        self,
        text: str | Sequence[str],
        images: Any = None,
        padding: bool | str = True,
        padding_side: str = "right",
    ) -> dict[str, np.ndarray]:
        """Tokenizes texts whose images appear as `<|image_pad|>` (one per image, in order).

        images: a flat list over the whole batch (or one list per text; flattened in order).
        padding: True / "longest" pads to the longest text; False requires equal lengths.
        Returns input_ids i32[B, T], attention_mask i32[B, T], and, with images,
        pixel_values f32[N, C*T*P*P] and image_grid_thw i32[n_images, 3].
        """
        texts = [text] if isinstance(text, str) else list(text)
        flat_images = _flatten_images(images)
        tok = self.tokenizer
        encoded = [np.asarray(tok.encode(t), np.int32) for t in texts]
        n_placeholders = sum(int((ids == tok.image_pad_id).sum()) for ids in encoded)
        if n_placeholders != len(flat_images):
            raise ValueError(
                f"the text has {n_placeholders} image placeholder(s) (<|image_pad|>) but "
                f"{len(flat_images)} image(s) were given; put one <|image_pad|> per image "
                "(apply_chat_template writes them)"
            )
        out: dict[str, np.ndarray] = {}
        if flat_images:
            vision = self.preprocess_images(flat_images)
            counts = iter(
                num_image_tokens(g, self.image_config.merge_size) for g in vision["image_grid_thw"]
            )
            expanded = []
            for ids in encoded:
                reps = np.ones(len(ids), np.int64)
                for pos in np.flatnonzero(ids == tok.image_pad_id):
                    reps[pos] = next(counts)
                expanded.append(np.repeat(ids, reps))
            encoded = expanded
            out.update(vision)
        if padding in (True, "longest"):
            input_ids, attention_mask = pad_sequences(encoded, tok.pad_id, padding_side)
        elif padding in (False, "do_not_pad"):
            lengths = {len(ids) for ids in encoded}
            if len(lengths) > 1:
                raise ValueError(
                    f"texts have different token lengths {sorted(lengths)}; pass padding=True "
                    "to pad them"
                )
            input_ids = np.stack(encoded) if encoded else np.zeros((0, 0), np.int32)
            attention_mask = np.ones_like(input_ids)
        else:
            raise ValueError(f"padding must be True, False or 'longest', got {padding!r}")
        return {"input_ids": input_ids, "attention_mask": attention_mask, **out}

    # ---- chat ----------------------------------------------------------------------------------

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = False
    ) -> str:
        """The chat text with one <|image_pad|> per image, as transformers' tokenize=False."""
        return self.chat.render_text(messages, add_generation_prompt)

    def render_chat(
        self,
        messages: Sequence[Message],
        images: Sequence[ImageLike] | None = None,
        add_generation_prompt: bool = False,
    ) -> tuple[RenderedChat, dict[str, np.ndarray]]:
        """Renders a conversation and preprocesses its images.

        images: one per image item, in order; by default the items' own "image" payloads.
        Returns (RenderedChat, {"pixel_values", "image_grid_thw"}).
        """
        images = list(images) if images is not None else images_in_messages(messages)
        if any(im is None for im in images):
            raise ValueError(
                "an image item has no 'image' payload; pass images=[...] to render_chat"
            )
        vision = self.preprocess_images(images)
        rendered = self.chat.render(messages, vision["image_grid_thw"], add_generation_prompt)
        return rendered, vision

    def extend_chat(
        self,
        prev: RenderedChat,
        new_messages: Sequence[Message],
        images: Sequence[ImageLike] | None = None,
        add_generation_prompt: bool = False,
    ) -> tuple[RenderedChat, dict[str, np.ndarray]]:
        """Appends turns to an earlier rendering (its ids stay a prefix) and preprocesses the new
        turns' images. Returns (RenderedChat, {"pixel_values", "image_grid_thw"} of the new
        images only); the sampler appends them to what it already holds."""
        images = list(images) if images is not None else images_in_messages(new_messages)
        if any(im is None for im in images):
            raise ValueError(
                "an image item has no 'image' payload; pass images=[...] to extend_chat"
            )
        vision = self.preprocess_images(images)
        rendered = self.chat.extend(
            prev, new_messages, vision["image_grid_thw"], add_generation_prompt
        )
        return rendered, vision

    def collate(
        self, rendered: Sequence[RenderedChat], padding_side: str = "right"
    ) -> dict[str, np.ndarray]:
        """Pads renderings into a batch for training or scoring.

        Returns input_ids i32[B, T], attention_mask i32[B, T], loss_mask bool[B, T],
        position_ids i32[3, B, T] (M-RoPE, padding at 0) and image_grid_thw i32[n, 3] (all
        rows' images in order; their pixel_values are the concatenation of each rendering's).
        """
        input_ids, attention_mask = pad_sequences(
            [r.input_ids for r in rendered], self.tokenizer.pad_id, padding_side
        )
        loss_mask, _ = pad_sequences([r.loss_mask for r in rendered], False, padding_side)
        grids = (
            np.concatenate([r.image_grid_thw for r in rendered])
            if rendered
            else np.zeros((0, 3), np.int32)
        )
        return {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "loss_mask": loss_mask,
            "position_ids": mrope_position_ids(
                input_ids,
                grids,
                attention_mask,
                image_token_id=self.tokenizer.image_pad_id,
                spatial_merge_size=self.image_config.merge_size,
            ),
            "image_grid_thw": grids.astype(np.int32),
        }
