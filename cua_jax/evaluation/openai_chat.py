"""OpenAI chat-completions requests -> the policy's prompt, exactly as the trainer renders it.

    renderer = MessageRenderer(processor)                  # one per server (holds a reply cache)
    req = parse_request(body, max_tokens_default=256)      # ChatRequest, or raises RequestError
    prompt = renderer.render(req.messages)                 # ids, pixel_values, grids, session
    ... engine.generate(prompt.ids, prompt.pixel_values, prompt.grid, params, prompt.session)
    renderer.remember(req.messages, text, tokens, prompt.session)   # after the reply

Messages are OpenAI's: `{"role": "system"|"user"|"assistant", "content": str | [parts]}` with
parts `{"type": "text", "text": ...}` and `{"type": "image_url", "image_url": {"url":
"data:image/png;base64,..."}}` (data URIs only: the server never fetches a URL). They go through
the project's chat renderer (`QwenVLProcessor.chat`), each image preprocessed on its own as the
agent loop does, so a conversation built like the loop's transcript renders to the very ids the
trainer's rollout gives (`cua_jax.rl.rollout.render_transcript`).

Assistant messages: the loop appends the ids the sampler generated (`append_generated`), not a
re-tokenization of their text (which can differ). The renderer remembers the ids of every reply
it served, keyed by (the conversation's first system and user text, the reply's index among the
assistant messages, the reply's text), and renders an assistant message it served from those
ids; other assistant messages (written by the client) are tokenized as the chat template does.
The same entry names the engine session that holds the reply's K/V, so a request that extends an
earlier conversation reuses its cache (`Engine.generate(session_id=)`).
"""

from __future__ import annotations

import base64
import binascii
import collections
import dataclasses
import hashlib
import io
import itertools
import json
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

# Fields of a chat-completions request the server understands; others get a 400 naming them.
KNOWN_FIELDS = frozenset(
    {
        "model",
        "messages",
        "temperature",
        "top_p",
        "max_tokens",
        "max_completion_tokens",
        "stop",
        "seed",
        "logprobs",
        "top_logprobs",
        "n",
        "stream",
        "user",
    }
)
ROLES = ("system", "user", "assistant")
MAX_STOP = 4  # as OpenAI
MAX_N = 16
# Decoded images cost ~12 bytes a pixel at their peak (RGBA decode, RGB copy, the processor's
# float resize), read from PNG headers before anything is decoded: a 248 KB 8000x8000 PNG was
# 0.75 GB. Per image: a 4096x4096 screen (a 4K screenshot fits); per request: 32 images and
# 2^25 pixels (16 full-HD screenshots), so one request peaks near 0.4 GB, not tens of GB.
MAX_IMAGE_PIXELS = 4096 * 4096
MAX_IMAGES = 32
MAX_REQUEST_PIXELS = 2**25
# "omitted screenshot" text parts do not make two conversations different (history windows).
_IGNORED_KEY_TEXTS = ("(an earlier screenshot, omitted)",)


class RequestError(ValueError):
    """A malformed request: the OpenAI error fields (HTTP 400)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code = message, param, code

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": "invalid_request_error",
                "param": self.param,
                "code": self.code,
            }
        }


@dataclasses.dataclass(frozen=True)
class ChatRequest:
    """A validated request (images decoded to u8[H, W, 3] arrays in `images`, in order)."""

    messages: list[dict[str, Any]]  # the renderer's form: parts {"type": "text"|"image"}
    images: list[np.ndarray]
    temperature: float
    top_p: float
    max_tokens: int
    stop: tuple[str, ...]
    seed: int | None
    logprobs: bool
    n: int
    model: str | None


# ------------------------------------------------------------------------------------ images


def encode_image(image: np.ndarray, fmt: str = "PNG") -> str:
    """A u8[H, W, 3] array as a data URI (PNG: lossless, so the server sees the same pixels)."""
    from PIL import Image

    buf = io.BytesIO()
    Image.fromarray(np.asarray(image, np.uint8)).save(buf, format=fmt)
    mime = "png" if fmt.upper() == "PNG" else fmt.lower()
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def decode_image(url: Any, param: str, max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """u8[H, W, 3] of a `data:image/...;base64,` URI; RequestError naming `param` otherwise,
    and (code "image_too_large", before decoding) for an image of more than `max_pixels`."""
    from PIL import Image

    if not isinstance(url, str):
        raise RequestError(f"{param} must be a string (a data: URI)", param, "invalid_image_url")
    if not url.startswith("data:"):
        raise RequestError(
            f"{param}: only data: URIs (data:image/png;base64,...) are accepted; this server "
            "never fetches URLs",
            param,
            "invalid_image_url",
        )
    head, _, data = url.partition(",")
    if not head.startswith("data:image/") or not head.endswith(";base64"):
        raise RequestError(
            f"{param}: expected data:image/<type>;base64,<data>, got {head[:40]!r}",
            param,
            "invalid_image_url",
        )
    try:
        raw = base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError) as e:
        raise RequestError(f"{param}: bad base64 ({e})", param, "invalid_image") from None
    try:
        with Image.open(io.BytesIO(raw)) as im:
            if im.width * im.height > max_pixels:
                raise RequestError(
                    f"{param}: a {im.width}x{im.height} image is over the {max_pixels} pixel "
                    f"limit (at most {MAX_IMAGE_PIXELS} per image, {MAX_REQUEST_PIXELS} per "
                    "request); send it scaled down",
                    param,
                    "image_too_large",
                )
            arr = np.asarray(im.convert("RGB"), np.uint8)
    except RequestError:
        raise
    except Exception as e:  # noqa: BLE001 -- any decoder failure is the client's bad image
        raise RequestError(
            f"{param}: not a decodable image ({type(e).__name__}: {e})", param, "invalid_image"
        ) from None
    if arr.ndim != 3 or min(arr.shape[:2]) < 1:
        raise RequestError(f"{param}: empty image", param, "invalid_image")
    return arr


# ------------------------------------------------------------------------------ validation


def _number(body: Mapping[str, Any], key: str, default: float, lo: float, hi: float) -> float:
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not lo <= v <= hi:
        raise RequestError(f"{key}={v!r} must be a number in [{lo}, {hi}]", key, "invalid_value")
    return float(v)


def _integer(body: Mapping[str, Any], key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise RequestError(f"{key}={v!r} must be an integer in [{lo}, {hi}]", key, "invalid_value")
    return int(v)


def _content(msg: Mapping[str, Any], i: int, images: list[np.ndarray]) -> str | list[dict]:
    where = f"messages[{i}].content"
    content = msg.get("content")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(
            f"{where} must be a string or a list of content parts", where, "invalid_value"
        )
    parts: list[dict] = []
    for j, part in enumerate(content):
        p = f"{where}[{j}]"
        if not isinstance(part, dict):
            raise RequestError(f"{p} must be an object", p, "invalid_value")
        kind = part.get("type")
        if kind == "text":
            if set(part) - {"type", "text"} or not isinstance(part.get("text"), str):
                raise RequestError(
                    f'{p}: a text part is {{"type": "text", "text": str}}', p, "invalid_value"
                )
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "image_url":
            iu = part.get("image_url")
            if set(part) - {"type", "image_url"} or not isinstance(iu, dict):
                raise RequestError(
                    f'{p}: an image part is {{"type": "image_url", "image_url": {{"url": ...}}}}',
                    p,
                    "invalid_value",
                )
            if set(iu) - {"url", "detail"}:
                extra = sorted(set(iu) - {"url", "detail"})
                raise RequestError(f"{p}.image_url: unknown field(s) {extra}", p, "unknown_field")
            if len(images) >= MAX_IMAGES:
                raise RequestError(
                    f"{p}: more than {MAX_IMAGES} images in one request", p, "too_many_images"
                )
            used = sum(im.shape[0] * im.shape[1] for im in images)
            budget = min(MAX_IMAGE_PIXELS, MAX_REQUEST_PIXELS - used)
            images.append(decode_image(iu.get("url"), f"{p}.image_url.url", budget))
            parts.append({"type": "image"})
        else:
            raise RequestError(
                f"{p}: unsupported content part type {kind!r} (use 'text' or 'image_url')",
                p,
                "invalid_value",
            )
    return parts


def _messages(msgs: Any) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    """The request's messages as (role, content) dicts, and the images their content holds."""
    if not isinstance(msgs, list) or not msgs:
        raise RequestError("messages must be a non-empty list", "messages", "invalid_value")
    images: list[np.ndarray] = []
    out: list[dict[str, Any]] = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise RequestError(f"messages[{i}] must be an object", f"messages[{i}]")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise RequestError(
                f"messages[{i}]: unknown field(s) {extra}", f"messages[{i}]", "unknown_field"
            )
        role = m.get("role")
        if role not in ROLES:
            raise RequestError(
                f"messages[{i}].role={role!r}: expected one of {list(ROLES)}",
                f"messages[{i}].role",
                "invalid_value",
            )
        out.append({"role": role, "content": _content(m, i, images)})
    return out, images


def parse_request(body: Any, *, max_tokens_default: int, max_tokens_limit: int) -> ChatRequest:
    """Validates a chat-completions body; raises RequestError (param names the bad field)."""
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", None, "invalid_json")
    unknown = sorted(set(body) - KNOWN_FIELDS)
    if unknown:
        raise RequestError(
            f"unknown field(s) {unknown}; this server takes {sorted(KNOWN_FIELDS)}",
            unknown[0],
            "unknown_field",
        )
    if body.get("stream"):
        raise RequestError("stream=true is not supported", "stream", "unsupported_value")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise RequestError(
            "top_logprobs is not supported (only the chosen tokens' log-probs)",
            "top_logprobs",
            "unsupported_value",
        )
    out, images = _messages(body.get("messages"))
    stop = body.get("stop")
    stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
    if (
        not isinstance(stop, list)
        or len(stop) > MAX_STOP
        or not all(isinstance(s, str) and s for s in stop)
    ):
        raise RequestError(
            f"stop must be a non-empty string or a list of at most {MAX_STOP} of them",
            "stop",
            "invalid_value",
        )
    max_tokens = _integer(body, "max_completion_tokens", 1, max_tokens_limit)
    if max_tokens is None:
        max_tokens = _integer(body, "max_tokens", 1, max_tokens_limit)
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise RequestError("logprobs must be true or false", "logprobs", "invalid_value")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise RequestError("model must be a string", "model", "invalid_value")
    return ChatRequest(
        messages=out,
        images=images,
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 1e-6, 1.0),
        max_tokens=max_tokens or max_tokens_default,
        stop=tuple(stop),
        seed=_integer(body, "seed", -(2**63), 2**63 - 1),
        logprobs=logprobs,
        n=_integer(body, "n", 1, MAX_N) or 1,
        model=model,
    )


# ------------------------------------------------------------------------------- rendering


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A request's prompt: ids i32[P], pixel values of all its images, their grids, and the
    engine session to continue (None: a new conversation)."""

    ids: np.ndarray
    pixel_values: np.ndarray | None
    grid: np.ndarray | None
    session: str | None


def _texts(content: Any) -> list[str]:
    if isinstance(content, str):
        return [content]
    return [p["text"] for p in content if p.get("type") == "text"]


def conversation_key(messages: Sequence[Mapping[str, Any]]) -> str:
    """Names a conversation: the text of its leading system message(s) and first user message
    (images and "omitted screenshot" texts left out, so a history window keeps the name)."""
    parts: list[Any] = []
    for m in messages:
        texts = [t for t in _texts(m["content"]) if t not in _IGNORED_KEY_TEXTS]
        parts.append([m["role"], texts])
        if m["role"] == "user":
            break
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()


class ReplyCache:
    """(conversation, assistant index, reply text) -> (generated ids, engine session); LRU."""

    def __init__(self, capacity: int = 65536):
        self.capacity = capacity
        self._d: collections.OrderedDict[tuple, tuple[tuple[int, ...], str]] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, key: tuple) -> tuple[tuple[int, ...], str] | None:
        with self._lock:
            v = self._d.get(key)
            if v is not None:
                self._d.move_to_end(key)
            return v

    def put(self, key: tuple, tokens: Sequence[int], session: str) -> None:
        with self._lock:
            self._d[key] = (tuple(int(t) for t in tokens), session)
            self._d.move_to_end(key)
            while len(self._d) > self.capacity:
                self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


class MessageRenderer:
    """Renders validated messages with a `QwenVLProcessor` (see the module docstring)."""

    def __init__(self, processor: Any, cache: ReplyCache | None = None):
        self.processor = processor
        self.chat = processor.chat
        self.cache = cache if cache is not None else ReplyCache()
        self._sessions = itertools.count()
        self._prefix = hashlib.sha1(str(id(self)).encode()).hexdigest()[:8]

    def new_session(self) -> str:
        return f"serve/{self._prefix}/{next(self._sessions)}"

    @staticmethod
    def _reply_key(conv: str, index: int, text: str) -> tuple:
        return (conv, index, text)

    def remember(
        self, messages: Sequence[Mapping[str, Any]], text: str, tokens: Sequence[int], session: str
    ) -> None:
        """Records a reply served for `messages` (so a later request that quotes it renders
        the generated ids, and continues `session`)."""
        n_asst = sum(m["role"] == "assistant" for m in messages)
        key = self._reply_key(conversation_key(messages), n_asst, text)
        self.cache.put(key, tokens, session)

    def render(self, messages: Sequence[Mapping[str, Any]], images: Sequence[np.ndarray]) -> Prompt:
        """The prompt (ending with the assistant header) of validated messages and their images
        (in order). Raises RequestError when the chat template refuses them."""
        conv = conversation_key(messages)
        vis = [self.processor.preprocess_images([im]) for im in images]
        image_iter = iter(vis)
        chat = self.chat
        rendered = None
        session = None
        n_asst = 0
        try:
            i = 0
            while i < len(messages):
                j = i
                while j < len(messages) and messages[j]["role"] != "assistant":
                    j += 1
                seg = list(messages[i:j])
                if seg:
                    n_img = sum(
                        1
                        for m in seg
                        if not isinstance(m["content"], str)
                        for p in m["content"]
                        if p["type"] == "image"
                    )
                    seg_vis = [next(image_iter) for _ in range(n_img)]
                    grid = (
                        np.concatenate([v["image_grid_thw"] for v in seg_vis])
                        if seg_vis
                        else np.zeros((0, 3), np.int32)
                    )
                    if rendered is None:
                        rendered = chat.render(seg, grid, add_generation_prompt=True)
                    else:
                        rendered = chat.extend(rendered, seg, grid, add_generation_prompt=True)
                if j < len(messages):  # an assistant message
                    msg = messages[j]
                    text = "".join(_texts(msg["content"]))
                    known = self.cache.get(self._reply_key(conv, n_asst, text))
                    n_asst += 1
                    if known is not None and rendered is not None:
                        if not rendered.open_assistant:
                            rendered = chat.extend(rendered, [], None, add_generation_prompt=True)
                        rendered = chat.append_generated(rendered, known[0])
                        session = known[1]
                    elif rendered is None:
                        rendered = chat.render([msg], None, add_generation_prompt=False)
                    else:
                        rendered = chat.extend(rendered, [msg], None, add_generation_prompt=False)
                i = j + 1
            if not rendered.open_assistant:
                rendered = chat.extend(rendered, [], None, add_generation_prompt=True)
        except ValueError as e:
            raise RequestError(f"messages: {e}", "messages", "invalid_value") from None
        pv = np.concatenate([v["pixel_values"] for v in vis]) if vis else None
        grid = np.concatenate([v["image_grid_thw"] for v in vis]).astype(np.int32) if vis else None
        return Prompt(rendered.input_ids, pv, grid, session)


__all__ = [
    "MAX_IMAGES",
    "MAX_IMAGE_PIXELS",
    "MAX_REQUEST_PIXELS",
    "ChatRequest",
    "MessageRenderer",
    "Prompt",
    "ReplyCache",
    "RequestError",
    "conversation_key",
    "decode_image",
    "encode_image",
    "parse_request",
]
