"""Tokenizers behind one small interface: a Hugging Face tokenizer from a local directory, and
the SentencePiece tokenizer shipped with the project for the tiny presets (no download).

Both split text on Qwen's special tokens first, so `<|im_start|>`, `<|image_pad|>`,
`<tool_call>`, ... are always single ids, and encoding a concatenation of segments that meet at
a special token equals concatenating their encodings (chat rendering relies on this to append
turns without re-tokenizing earlier ones).
"""

from __future__ import annotations

import abc
import functools
import importlib.resources
import os
import re
from collections.abc import Sequence
from typing import Any

# Qwen2.5-VL's added tokens in id order, then the four Qwen3-VL adds. `special` ones are dropped by
# decode(skip_special_tokens=True); the others (tool calls, thinking) are text the model writes.
QWEN_SPECIAL_TOKENS: tuple[str, ...] = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
    "<tool_call>",
    "</tool_call>",
    "<|fim_prefix|>",
    "<|fim_middle|>",
    "<|fim_suffix|>",
    "<|fim_pad|>",
    "<|repo_name|>",
    "<|file_sep|>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
)
NON_SPECIAL_ADDED_TOKENS = frozenset(
    {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>"}
)

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
ENDOFTEXT = "<|endoftext|>"
VISION_START = "<|vision_start|>"
VISION_END = "<|vision_end|>"
IMAGE_PAD = "<|image_pad|>"
VIDEO_PAD = "<|video_pad|>"
TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# Relative to the cua_jax package (shipped as package data).
DEFAULT_TOKENIZER_PATH = "assets/tokenizer/qwen_sp.model"


class Tokenizer(abc.ABC):
    """What the rest of cua_jax needs from a tokenizer.

    encode never adds BOS/EOS (Qwen has none); chat.py writes every template token itself.
    """

    @abc.abstractmethod
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special-token strings in it become their single ids."""

    @abc.abstractmethod
    def encode_text(self, text: str) -> list[int]:
        """Token ids of `text` read as plain text: a control-token string in it (`<|im_end|>`,
        `<|image_pad|>`, ...) is encoded as its characters, never as the control token, so
        text from a user or a web page cannot close its turn or forge an image slot. The
        non-special added tokens (`<tool_call>`, `<think>`) stay single ids, as in `encode`
        (transformers' `split_special_tokens=True`)."""

    @abc.abstractmethod
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        """Text of `ids`; with skip_special_tokens, `<|...|>` tokens are left out."""

    @abc.abstractmethod
    def token_bytes(self) -> list[bytes | None]:
        """What each id writes into the decoded text, as bytes (a byte-level piece may be part
        of a UTF-8 character); None for control tokens (`<|im_end|>`, `<|image_pad|>`, ...).
        The non-special added tokens (`<tool_call>`) write their own text. Constrained
        decoding (`cua_jax.sampler.grammar`) reads the vocabulary through this."""

    @abc.abstractmethod
    def _lookup(self, token: str) -> int | None:
        """Id of one whole token string, or None if the vocabulary lacks it."""

    @property
    @abc.abstractmethod
    def vocab_size(self) -> int:
        """Number of ids (embedding rows needed), added tokens included."""

    def token_to_id(self, token: str) -> int:
        """Id of one whole token such as "<|im_start|>"; KeyError naming it if absent."""
        idx = self._lookup(token)
        if idx is None:
            raise KeyError(
                f"token {token!r} is not in the vocabulary of {type(self).__name__}; "
                "Qwen-VL chat rendering needs Qwen's special tokens"
            )
        return idx

    # Special ids used by chat rendering, the processor and the sampler.
    @functools.cached_property
    def im_start_id(self) -> int:
        return self.token_to_id(IM_START)

    @functools.cached_property
    def im_end_id(self) -> int:
        return self.token_to_id(IM_END)

    @functools.cached_property
    def endoftext_id(self) -> int:
        return self.token_to_id(ENDOFTEXT)

    @functools.cached_property
    def vision_start_id(self) -> int:
        return self.token_to_id(VISION_START)

    @functools.cached_property
    def vision_end_id(self) -> int:
        return self.token_to_id(VISION_END)

    @functools.cached_property
    def image_pad_id(self) -> int:
        return self.token_to_id(IMAGE_PAD)

    @functools.cached_property
    def video_pad_id(self) -> int:
        return self.token_to_id(VIDEO_PAD)

    @functools.cached_property
    def tool_call_start_id(self) -> int:
        return self.token_to_id(TOOL_CALL_START)

    @functools.cached_property
    def tool_call_end_id(self) -> int:
        return self.token_to_id(TOOL_CALL_END)

    @property
    def pad_id(self) -> int:
        """Padding id: Qwen pads with <|endoftext|>."""
        return self.endoftext_id

    @property
    def eos_id(self) -> int:
        """End of an assistant turn: <|im_end|> (instruct models stop there)."""
        return self.im_end_id

    def vision_token_ids(self) -> dict[str, int]:
        """The model-config fields that name this tokenizer's vision tokens, e.g. for
        `qwen_vl.config.tiny(family, vocab_size=tok.vocab_size, **tok.vision_token_ids())`."""
        return {
            "image_token_id": self.image_pad_id,
            "video_token_id": self.video_pad_id,
            "vision_start_token_id": self.vision_start_id,
            "vision_end_token_id": self.vision_end_id,
        }

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """Ids that end sampling: <|im_end|> and <|endoftext|> (Qwen's generation_config)."""
        return (self.im_end_id, self.endoftext_id)


class HFTokenizer(Tokenizer):
    """A transformers tokenizer (tokenizer.json etc.) loaded from a local directory."""

    def __init__(self, hf_tokenizer: Any):
        self.hf = hf_tokenizer
        self._special_ids = frozenset(
            idx
            for tok, idx in hf_tokenizer.get_added_vocab().items()
            if tok not in NON_SPECIAL_ADDED_TOKENS
        )

    @classmethod
    def from_dir(cls, path: str | os.PathLike[str]) -> HFTokenizer:
        """Loads with AutoTokenizer from `path` only; never contacts a hub."""
        from transformers import AutoTokenizer  # heavy import, only when asked for

        if not os.path.isdir(path):
            raise FileNotFoundError(
                f"tokenizer directory {os.fspath(path)!r} does not exist; pass a local Hugging "
                "Face model directory (with tokenizer.json / tokenizer_config.json)"
            )
        return cls(AutoTokenizer.from_pretrained(os.fspath(path), local_files_only=True))

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def encode_text(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False, split_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self.hf.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)

    def token_bytes(self) -> list[bytes | None]:
        byte_of = {c: b for b, c in _bytes_to_unicode().items()}
        added = {i: t for t, i in self.hf.get_added_vocab().items()}
        out: list[bytes | None] = []
        for i, piece in enumerate(self.hf.convert_ids_to_tokens(list(range(len(self.hf))))):
            if i in self._special_ids or piece is None:
                out.append(None)
            elif i in added:
                out.append(added[i].encode())
            elif all(c in byte_of for c in piece):  # byte-level BPE (Qwen): one char a byte
                out.append(bytes(byte_of[c] for c in piece))
            else:  # SentencePiece-style pieces
                out.append(piece.replace(_SP_SPACE, " ").encode())
        return out

    def _lookup(self, token: str) -> int | None:
        idx = self.hf.convert_tokens_to_ids(token)
        if idx is None or (idx == self.hf.unk_token_id and token != self.hf.unk_token):
            return None
        return int(idx)

    @property
    def pad_id(self) -> int:
        """The tokenizer's own pad token when it has one (Qwen: <|endoftext|>)."""
        pad = self.hf.pad_token_id
        return self.endoftext_id if pad is None else int(pad)

    @property
    def vocab_size(self) -> int:
        # len() counts added tokens; .vocab_size does not. The embedding may be larger still
        # (Qwen pads it); that is the model config's business.
        return len(self.hf)


# SentencePiece writes spaces as this meta symbol; a literal one in the text would decode to a
# space, so SentencePieceTokenizer encodes it through its UTF-8 byte pieces instead.
_SP_SPACE = "\u2581"


class SentencePieceTokenizer(Tokenizer):
    """The project's small SentencePiece BPE model (tools/make_tokenizer.py trains it).

    Qwen's special tokens are user-defined symbols (single ids, never split), digits are split
    one per token, normalization is the identity and byte fallback covers any character, so
    decode(encode(text)) == text for every string.
    """

    def __init__(self, model_proto: bytes):
        import sentencepiece as spm

        self.sp = spm.SentencePieceProcessor(model_proto=model_proto)
        self._ids = {tok: self.sp.piece_to_id(tok) for tok in QWEN_SPECIAL_TOKENS}
        for tok, idx in self._ids.items():
            if self.sp.id_to_piece(idx) != tok:
                raise ValueError(
                    f"SentencePiece model lacks the special token {tok!r}; retrain it with "
                    "tools/make_tokenizer.py"
                )
        self._special_ids = frozenset(
            idx for tok, idx in self._ids.items() if tok not in NON_SPECIAL_ADDED_TOKENS
        )
        self._split_re = re.compile(
            "(" + "|".join(re.escape(t) for t in QWEN_SPECIAL_TOKENS) + f"|{_SP_SPACE})"
        )
        self._space_byte_ids = [self.sp.piece_to_id(f"<0x{b:02X}>") for b in _SP_SPACE.encode()]

    @classmethod
    def from_file(cls, path: str | os.PathLike[str]) -> SentencePieceTokenizer:
        with open(path, "rb") as f:
            return cls(f.read())

    def encode(self, text: str) -> list[int]:
        return self._encode(text, literal=False)

    def encode_text(self, text: str) -> list[int]:
        return self._encode(text, literal=True)

    def _encode(self, text: str, literal: bool) -> list[int]:
        ids: list[int] = []
        for part in self._split_re.split(text):
            if not part:
                continue
            if literal and part in self._ids and self._ids[part] in self._special_ids:
                # A control token's string as text: its first character and the rest encoded
                # apart (each alone is no user-defined symbol), as byte-level BPE splits it.
                ids.extend(self.sp.encode(part[0]) + self.sp.encode(part[1:]))
            elif part in self._ids:
                ids.append(self._ids[part])
            elif part == _SP_SPACE:
                ids.extend(self._space_byte_ids)
            else:
                ids.extend(self.sp.encode(part))
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        ids = [int(i) for i in ids]
        if skip_special_tokens:
            ids = [i for i in ids if i not in self._special_ids]
        return self.sp.decode(ids)

    def token_bytes(self) -> list[bytes | None]:
        out: list[bytes | None] = []
        for i in range(self.sp.get_piece_size()):
            piece = self.sp.id_to_piece(i)
            if i in self._special_ids or self.sp.is_unknown(i) or self.sp.is_control(i):
                out.append(None)
            elif self.sp.is_byte(i):  # <0xAB>
                out.append(bytes([int(piece[3:5], 16)]))
            else:
                out.append(piece.replace(_SP_SPACE, " ").encode())
        return out

    def _lookup(self, token: str) -> int | None:
        idx = self.sp.piece_to_id(token)
        return idx if self.sp.id_to_piece(idx) == token and not self.sp.is_unknown(idx) else None

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()


@functools.cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table, which byte-level BPE vocabularies use."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


@functools.cache
def load_default_tokenizer() -> SentencePieceTokenizer:
    """The SentencePiece tokenizer shipped in cua_jax/assets/tokenizer/ (for tiny presets)."""
    ref = importlib.resources.files("cua_jax").joinpath(DEFAULT_TOKENIZER_PATH)
    if not ref.is_file():
        raise FileNotFoundError(
            f"shipped tokenizer cua_jax/{DEFAULT_TOKENIZER_PATH} is missing; regenerate it with "
            "`python tools/make_tokenizer.py`"
        )
    return SentencePieceTokenizer(ref.read_bytes())
