"""Renders multi-turn conversations with images into Qwen-VL token ids and a loss mask.

The text is that of the Qwen2.5-VL or Qwen3-VL-Instruct chat template (tests compare it with
transformers' apply_chat_template for both):

    <|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n     (Qwen2.5-VL default only)
    <|im_start|>user\\n<|vision_start|><|image_pad|>*n<|vision_end|>text<|im_end|>\\n
    <|im_start|>assistant\\ncontent<|im_end|>\\n
    ...
    <|im_start|>assistant\\n                      (add_generation_prompt=True)

with n = t*h*w / merge**2 pad tokens for an image of grid (t, h, w). Messages are Hugging Face
style: {"role": "user", "content": "text"} or {"role": "user", "content": [{"type": "image"},
{"type": "text", "text": "..."}]}.

The loss mask marks what the policy is trained on: an assistant message's content tokens (and,
for Qwen3-VL, its rendered tool_calls) and its closing <|im_end|>. The "<|im_start|>assistant\\n"
header, the "\\n" after <|im_end|>, image tokens and every system/user/tool token are not trained.

Text between special tokens is tokenized as one string, as in the whole text, except that an
assistant message's header and content are tokenized apart (the sampler starts generating right
after "assistant\\n", so training sees the same boundary). Tests check the ids equal transformers'
processor on the template text. Each turn ends at a special token or "\\n", so `extend()` appends
a turn to an earlier rendering without touching its ids: the sampler keeps its KV cache.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from cua_jax.data.image import num_image_tokens
from cua_jax.data.positions import get_rope_index
from cua_jax.data.tokenizer import (
    IM_END,
    IM_START,
    IMAGE_PAD,
    VIDEO_PAD,
    VISION_END,
    VISION_START,
    Tokenizer,
)

QWEN25_DEFAULT_SYSTEM = "You are a helpful assistant."

Message = Mapping[str, Any]


@dataclasses.dataclass(frozen=True)
class RenderedChat:
    """One rendered conversation (unbatched).

    input_ids:        i32[T]
    loss_mask:        bool[T]   True on trained (assistant) tokens
    image_grid_thw:   i32[n_images, 3]  grids of the images, in order of their pad runs
    text:             the rendered text, one <|image_pad|> per image (as apply_chat_template)
    open_assistant:   True when it ends with "<|im_start|>assistant\\n" (a generation prompt)
    """

    input_ids: np.ndarray
    loss_mask: np.ndarray
    image_grid_thw: np.ndarray
    text: str
    open_assistant: bool

    def __len__(self) -> int:
        return int(self.input_ids.shape[0])


def _is_image(item: Mapping[str, Any]) -> bool:
    # Same test as the Qwen2.5-VL template: type "image", or an "image"/"image_url" key.
    return item.get("type") == "image" or "image" in item or "image_url" in item


def _is_video(item: Mapping[str, Any]) -> bool:
    return item.get("type") == "video" or "video" in item


def count_images(messages: Sequence[Message]) -> int:
    """Number of image items in `messages` (each gets one vision block)."""
    n = 0
    for msg in messages:
        content = msg.get("content")
        if not isinstance(content, str) and content is not None:
            n += sum(1 for item in content if _is_image(item))
    return n


def images_in_messages(messages: Sequence[Message]) -> list[Any]:
    """The image payloads ("image" or "image_url" values) of the image items, in order."""
    found = []
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, str) or content is None:
            continue
        for item in content:
            if _is_image(item):
                found.append(item.get("image", item.get("image_url")))
    return found


STYLES = ("qwen2_5_vl", "qwen3_vl", "qwen3_5")
# Qwen3.5's template opens the assistant turn it generates with an empty thinking block when
# thinking is off (its default; transformers' response parser for the family anchors on it)
QWEN35_ASSISTANT_HEADER = "assistant\n<think>\n\n</think>\n\n"


class ChatRenderer:
    """Renders conversations for one tokenizer, vision merge size and template style.

    style "qwen2_5_vl": Qwen2.5-VL's template. Inserts the system message "You are a helpful
      assistant." when the conversation does not start with one; any role is written as is.
    style "qwen3_vl": Qwen3-VL-Instruct's template. No default system message; a system message
      only as the first message; assistant `tool_calls` are written as <tool_call> blocks
      (trained, like the content); consecutive "tool" messages become one user turn of
      <tool_response> blocks.
    style "qwen3_5": Qwen3-VL's, with Qwen3.5's thinking-off assistant header (every assistant
      turn opens with "<think>\n\n</think>\n\n", untrained, as the generation prompt does: an
      episode's transcript is append-only, so the turns it replays keep the block the model
      saw, where the template drops it from turns before the last user message) and
      `tool_calls` in its XML syntax (`cua_jax.actions.qwen35`).
    """

    def __init__(self, tokenizer: Tokenizer, merge_size: int = 2, style: str = "qwen2_5_vl"):
        if style not in STYLES:
            raise ValueError(f"unknown chat template style {style!r}: expected one of {STYLES}")
        self.tokenizer = tokenizer
        self.merge_size = merge_size
        self.style = style
        self.default_system = QWEN25_DEFAULT_SYSTEM if style == "qwen2_5_vl" else None
        self._im_start = tokenizer.im_start_id
        self._im_end = tokenizer.im_end_id
        self._newline = tokenizer.encode("\n")

    @classmethod
    def for_family(cls, tokenizer: Tokenizer, family: str, merge_size: int = 2) -> ChatRenderer:
        """The renderer of a model family: "qwen2_5_vl" or "qwen3_vl"."""
        if family in ("qwen2_5_vl", "qwen2_vl"):
            return cls(tokenizer, merge_size, "qwen2_5_vl")
        if family in ("qwen3_vl", "qwen3_5"):
            return cls(tokenizer, merge_size, family)
        raise ValueError(
            f"unknown model family {family!r}: expected 'qwen2_5_vl', 'qwen3_vl' or 'qwen3_5'"
        )

    # ---- text ----------------------------------------------------------------------------------

    def render_text(self, messages: Sequence[Message], add_generation_prompt: bool = False) -> str:
        """Template text, one <|image_pad|> per image: apply_chat_template(tokenize=False)."""
        return self.render(messages, None, add_generation_prompt, _text_only=True).text

    # ---- ids -----------------------------------------------------------------------------------

    def render(
        self,
        messages: Sequence[Message],
        image_grid_thw: np.ndarray | Sequence[Sequence[int]] | None = None,
        add_generation_prompt: bool = False,
        *,
        _text_only: bool = False,
    ) -> RenderedChat:
        """Ids, loss mask and text of a whole conversation.

        image_grid_thw: i32[n_images, 3], one row per image item in the messages, in order.
        """
        if not messages:
            raise ValueError("cannot render an empty conversation: pass at least one message")
        head: list[Message] = []
        if messages[0].get("role") != "system" and self.default_system is not None:
            head = [{"role": "system", "content": self.default_system}]
        empty = RenderedChat(
            input_ids=np.zeros((0,), np.int32),
            loss_mask=np.zeros((0,), bool),
            image_grid_thw=np.zeros((0, 3), np.int32),
            text="",
            open_assistant=False,
        )
        return self._append(
            empty, [*head, *messages], image_grid_thw, add_generation_prompt, _text_only
        )

    def extend(
        self,
        prev: RenderedChat,
        new_messages: Sequence[Message],
        image_grid_thw: np.ndarray | Sequence[Sequence[int]] | None = None,
        add_generation_prompt: bool = False,
    ) -> RenderedChat:
        """`prev` followed by `new_messages`; prev.input_ids is a prefix of the result.

        image_grid_thw: grids of the images in `new_messages` only. If `prev` ends with a
        generation prompt, new_messages must start with the assistant message that answers it.
        extend(render(m[:k], add_generation_prompt=...), m[k:]) == render(m), except that in
        the qwen3_vl style a "tool" message continuing a tool run of `prev` opens a new turn.
        """
        return self._append(prev, new_messages, image_grid_thw, add_generation_prompt, False)

    def append_generated(self, prev: RenderedChat, generated_ids: Sequence[int]) -> RenderedChat:
        """Closes an open assistant turn with tokens the sampler produced.

        The sampled ids are trained (they are what the policy did). If sampling stopped without
        <|im_end|> (length limit), one is added untrained so the conversation can go on. The
        "\\n" after <|im_end|> follows, untrained, as the template writes it.
        """
        if not prev.open_assistant:
            raise ValueError(
                "append_generated needs a rendering that ends with a generation prompt; render "
                "with add_generation_prompt=True first"
            )
        gen = [int(i) for i in generated_ids]
        ids, mask = list(gen), [True] * len(gen)
        if not gen or gen[-1] != self._im_end:
            ids.append(self._im_end)
            mask.append(False)
        ids += self._newline
        mask += [False] * len(self._newline)
        return RenderedChat(
            input_ids=np.concatenate([prev.input_ids, np.asarray(ids, np.int32)]),
            loss_mask=np.concatenate([prev.loss_mask, np.asarray(mask, bool)]),
            image_grid_thw=prev.image_grid_thw,
            text=prev.text + self.tokenizer.decode(ids),
            open_assistant=False,
        )

    # ---- internals -----------------------------------------------------------------------------

    def _append(
        self,
        prev: RenderedChat,
        messages: Sequence[Message],
        image_grid_thw: np.ndarray | Sequence[Sequence[int]] | None,
        add_generation_prompt: bool,
        text_only: bool,
    ) -> RenderedChat:
        n_images = count_images(messages)
        if text_only:
            grids = np.ones((n_images, 3), np.int32)  # placeholder: text has one pad per image
        else:
            grids = np.asarray(
                image_grid_thw if image_grid_thw is not None else np.zeros((0, 3)), np.int32
            ).reshape(-1, 3)
            if grids.shape[0] != n_images:
                raise ValueError(
                    f"the messages contain {n_images} image item(s) but image_grid_thw has "
                    f"{grids.shape[0]} row(s); pass one (t, h, w) grid per image, in order"
                )
        out = _Emitter(self.tokenizer, text_only)
        qwen3 = self.style in ("qwen3_vl", "qwen3_5")
        header = QWEN35_ASSISTANT_HEADER if self.style == "qwen3_5" else "assistant\n"
        open_assistant = prev.open_assistant
        image_index = 0

        def emit_content(i: int, role: str, content: Any, trained: bool, images: bool) -> None:
            nonlocal image_index
            if isinstance(content, str):
                out.text(content, trained)
                return
            for item in content:
                if _is_image(item):
                    if not images:
                        raise ValueError(
                            f"message {i} ({role}) has an image item, which the {self.style} "
                            "chat template does not render; images go in user (or tool) messages"
                        )
                    n = num_image_tokens(grids[image_index], self.merge_size)
                    image_index += 1
                    out.ids(  # image tokens are inputs, never targets
                        [self.tokenizer.vision_start_id]
                        + [self.tokenizer.image_pad_id] * (0 if text_only else n)
                        + [self.tokenizer.vision_end_id],
                        VISION_START + IMAGE_PAD + VISION_END,
                        False,
                    )
                elif _is_video(item):
                    raise NotImplementedError(
                        f"message {i} has a video item; cua_jax renders images only "
                        f"({VIDEO_PAD} is reserved)"
                    )
                elif "text" in item:
                    out.text(str(item["text"]), trained)

        for i, msg in enumerate(messages):
            role = msg.get("role")
            if not isinstance(role, str) or not role:
                raise ValueError(f"message {i} has no 'role' string: {dict(msg)!r}")
            content = msg.get("content")
            if content is None:
                raise ValueError(
                    f"message {i} ({role}) has no 'content'; pass a string or a list of "
                    "{'type': 'image'} / {'type': 'text', 'text': ...} items"
                )
            tool_calls = msg.get("tool_calls")
            if tool_calls and not qwen3:
                raise ValueError(
                    f"message {i} has 'tool_calls', which Qwen2.5-VL's chat template does not "
                    "render; write the <tool_call>...</tool_call> text into its content"
                )
            if open_assistant:
                if i != 0 or role != "assistant":
                    raise ValueError(
                        "the earlier rendering ends with a generation prompt, so the next "
                        f"message must be the assistant's answer, got role {role!r}"
                    )
                open_assistant = False  # header already rendered
            elif qwen3 and role == "tool":
                if i == 0 or messages[i - 1].get("role") != "tool":
                    out.ids([self._im_start], IM_START, False)
                    out.text("user", False)
                out.text("\n<tool_response>\n", False)
                emit_content(i, role, content, False, images=True)
                out.text("\n</tool_response>", False)
                if i + 1 == len(messages) or messages[i + 1].get("role") != "tool":
                    out.ids([self._im_end], IM_END, False)
                    out.text("\n", False)
                continue
            elif qwen3 and role == "system" and (i > 0 or len(prev) > 0):
                raise ValueError(
                    f"message {i} is a system message after the start; Qwen3-VL's chat "
                    "template renders a system message only as the first message"
                )
            else:
                out.ids([self._im_start], IM_START, False)
                out.text(header if role == "assistant" else f"{role}\n", False)
            trained = role == "assistant"
            # Qwen3-VL's template writes only the text of system and assistant contents.
            emit_content(i, role, content, trained, images=not (qwen3 and role != "user"))
            if tool_calls:
                for j, call in enumerate(tool_calls):
                    if j > 0 or content:
                        out.text("\n", trained)
                    call = call.get("function", call)
                    args = call.get("arguments", {})
                    if self.style == "qwen3_5":
                        if j == 0 and content:
                            out.text("\n", trained)  # the template: "\n\n" after content
                        out.text(_xml_tool_call(call["name"], args), trained)
                        continue
                    args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                    out.text(
                        f'<tool_call>\n{{"name": "{call["name"]}", "arguments": {args}}}'
                        "\n</tool_call>",
                        trained,
                    )
            out.ids([self._im_end], IM_END, trained)
            out.text("\n", False)
        if add_generation_prompt:
            if open_assistant:
                raise ValueError("the rendering already ends with a generation prompt")
            out.ids([self._im_start], IM_START, False)
            out.text(header, False)
            open_assistant = True
        ids, mask, text = out.finish()
        return RenderedChat(
            input_ids=np.concatenate([prev.input_ids, np.asarray(ids, np.int32)]),
            loss_mask=np.concatenate([prev.loss_mask, np.asarray(mask, bool)]),
            image_grid_thw=(
                prev.image_grid_thw if text_only else np.concatenate([prev.image_grid_thw, grids])
            ),
            text=prev.text + text,
            open_assistant=open_assistant,
        )


def _xml_tool_call(name: str, arguments: Any) -> str:
    """One call as Qwen3.5's template writes it: a <parameter=k> element per argument, lists and
    objects as JSON, everything else as its string."""
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    params = "".join(
        f"<parameter={k}>\n"
        + (json.dumps(v, ensure_ascii=False) if isinstance(v, dict | list) else str(v))
        + "\n</parameter>\n"
        for k, v in arguments.items()
    )
    return f"<tool_call>\n<function={name}>\n{params}</function>\n</tool_call>"


class _Emitter:
    """Collects (ids, trained) pieces. Adjacent text with the same trained flag is tokenized as
    one string, as the tokenizer sees it in the whole text; it is cut only where the flag
    changes (the "assistant\\n" header / content boundary) and at id pieces (special tokens)."""

    def __init__(self, tokenizer: Tokenizer, text_only: bool):
        self._tok = tokenizer
        self._text_only = text_only
        self._ids: list[int] = []
        self._mask: list[bool] = []
        self._text: list[str] = []
        self._pending: list[str] = []
        self._pending_trained = False

    def _flush(self) -> None:
        s = "".join(self._pending)
        self._pending = []
        if s and not self._text_only:
            # Every template token arrives through `ids`; text is only ever text (a user's
            # "<|im_end|>" must not end its turn), hence encode_text, not encode.
            piece = self._tok.encode_text(s)
            self._ids.extend(piece)
            self._mask.extend([self._pending_trained] * len(piece))

    def text(self, s: str, trained: bool) -> None:
        if not s:
            return
        if trained != self._pending_trained:
            self._flush()
            self._pending_trained = trained
        self._pending.append(s)
        self._text.append(s)

    def ids(self, ids: list[int], text: str, trained: bool) -> None:
        self._flush()
        self._ids.extend(ids)
        self._mask.extend([trained] * len(ids))
        self._text.append(text)

    def finish(self) -> tuple[list[int], list[bool], str]:
        self._flush()
        return self._ids, self._mask, "".join(self._text)


def mrope_position_ids(
    input_ids: np.ndarray,
    image_grid_thw: np.ndarray | None,
    attention_mask: np.ndarray | None,
    *,
    image_token_id: int,
    spatial_merge_size: int = 2,
) -> np.ndarray:
    """M-RoPE positions i32[3, B, T] of a (padded) batch, from the model's get_rope_index.

    input_ids i32[B, T]; image_grid_thw i32[n_images, 3] of all rows' images in order;
    attention_mask i32[B, T] (0 = padding, left or right), or None.
    """
    # Imported here: the rope module pulls in jax, which plain tokenization does not need.

    position_ids, _ = get_rope_index(
        np.asarray(input_ids),
        None if image_grid_thw is None else np.asarray(image_grid_thw),
        None if attention_mask is None else np.asarray(attention_mask),
        image_token_id=image_token_id,
        spatial_merge_size=spatial_merge_size,
    )
    return np.asarray(position_ids, np.int32)


def position_ids(rendered: RenderedChat, tokenizer: Tokenizer, merge_size: int = 2) -> np.ndarray:
    """M-RoPE positions i32[3, T] of one rendering (same for Qwen2.5-VL and Qwen3-VL images)."""
    return mrope_position_ids(
        rendered.input_ids[None],
        rendered.image_grid_thw,
        None,
        image_token_id=tokenizer.image_pad_id,
        spatial_merge_size=merge_size,
    )[:, 0]
