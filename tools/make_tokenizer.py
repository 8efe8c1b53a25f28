"""Trains the small SentencePiece tokenizer shipped in cua_jax/assets/tokenizer/.

    python tools/make_tokenizer.py            # rewrites cua_jax/assets/tokenizer/qwen_sp.model
    python tools/make_tokenizer.py --check    # retrains in memory, fails if the file differs

The tiny model presets and the smoke run use it so nothing is downloaded. The corpus is
generated here from a fixed seed (chat-template text, computer-use tool calls, pyautogui
actions, UI vocabulary), and training is single-threaded without shuffling, so the output is
byte-for-byte reproducible.

Model: BPE, ~1.5k pieces; Qwen's special tokens and "\\n" are user-defined symbols (single ids,
never split); digits are split one per piece (coordinates are written digit by digit, as Qwen's
tokenizer does); identity normalization and byte fallback make every string round-trip.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import pathlib
import random
import string
import sys

import sentencepiece as spm

from cua_jax.data.tokenizer import DEFAULT_TOKENIZER_PATH, QWEN_SPECIAL_TOKENS

VOCAB_SIZE = 1536
SEED = 0
OUT = pathlib.Path(__file__).resolve().parents[1] / "cua_jax" / DEFAULT_TOKENIZER_PATH

UI_WORDS = (
    "click button submit checkbox login username password dropdown select toggle settings "
    "scroll page next previous back type form field input text email search menu option save "
    "cancel close open file edit view window tab link icon image label radio slider enter "
    "delete remove add new create update confirm ok yes no sign in out up down left right top "
    "bottom home account profile address phone name first last date time color size list item "
    "table row column cell sort filter apply reset clear copy paste cut undo redo zoom browser "
    "terminal folder document spreadsheet slide chart font bold italic underline align center "
    "desktop taskbar notification dialog popup modal banner footer header sidebar navigation "
    "checkout cart price quantity order shipping payment card number city country state zip "
    "message send reply forward inbox draft subject to from cc attach upload download share "
    "task done the a an of and or with for on at by is are this that it its into your you "
    "please then after before when if until screen cursor mouse keyboard key press hold drag "
    "drop double right-click highlight find replace go visit website url address bar mode"
).split()

ACTIONS = ("left_click", "right_click", "double_click", "mouse_move", "left_click_drag")
KEYS = ("enter", "tab", "escape", "backspace", "ctrl+c", "ctrl+v", "ctrl+a", "ctrl+s", "alt+f4")


def _phrase(rng: random.Random, lo: int = 3, hi: int = 10) -> str:
    return " ".join(rng.choice(UI_WORDS) for _ in range(rng.randint(lo, hi)))


def _tool_call(rng: random.Random) -> str:
    kind = rng.random()
    if kind < 0.5:
        args = {
            "action": rng.choice(ACTIONS),
            "coordinate": [rng.randint(0, 1919), rng.randint(0, 1079)],
        }
    elif kind < 0.7:
        args = {"action": "type", "text": _phrase(rng, 1, 4)}
    elif kind < 0.8:
        args = {"action": "key", "keys": rng.choice(KEYS).split("+")}
    elif kind < 0.9:
        args = {"action": "scroll", "pixels": rng.choice([-1, 1]) * rng.randint(1, 10) * 100}
    else:
        args = {"action": rng.choice(["wait", "terminate"]), "status": "success"}
    call = {"name": "computer_use", "arguments": args}
    return f"<tool_call>\n{json.dumps(call)}\n</tool_call>"


def _pyautogui(rng: random.Random) -> str:
    x, y = rng.randint(0, 1919), rng.randint(0, 1079)
    return rng.choice(
        [
            f"pyautogui.click({x}, {y})",
            f"pyautogui.doubleClick({x}, {y})",
            f"pyautogui.moveTo({x}, {y})",
            f"pyautogui.typewrite('{_phrase(rng, 1, 3)}')",
            f"pyautogui.hotkey('{rng.choice(['ctrl', 'alt', 'shift'])}', '{rng.choice('acsvz')}')",
            f"pyautogui.scroll({rng.randint(-10, 10)})",
            "DONE",
            "FAIL",
            "WAIT",
        ]
    )


def _conversation(rng: random.Random) -> str:
    parts = ["<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"]
    for _ in range(rng.randint(1, 3)):
        user = _phrase(rng).capitalize() + rng.choice([".", "?", "!", ""])
        parts.append(
            "<|im_start|>user\n<|vision_start|>"
            + "<|image_pad|>" * rng.randint(1, 4)
            + f"<|vision_end|>{user}<|im_end|>\n"
        )
        thought = _phrase(rng, 2, 8).capitalize() + "."
        action = _tool_call(rng) if rng.random() < 0.7 else _pyautogui(rng)
        parts.append(f"<|im_start|>assistant\n{thought}\n{action}<|im_end|>\n")
    return "".join(parts)


def make_corpus(seed: int = SEED, n: int = 4000) -> list[str]:
    """Training sentences (one per line: SentencePiece learns within lines only)."""
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        r = rng.random()
        if r < 0.5:
            text = _conversation(rng)
        elif r < 0.75:
            text = _tool_call(rng)
        elif r < 0.9:
            text = _pyautogui(rng)
        else:
            text = _phrase(rng, 5, 20).capitalize() + "."
        lines.extend(text.split("\n"))
    # Every printable ASCII character at least once, so none needs byte fallback.
    lines.append(string.printable.strip())
    lines.append(" ".join(string.ascii_letters + string.digits + string.punctuation))
    return [line for line in lines if line]


def train(seed: int = SEED) -> bytes:
    """The serialized SentencePiece model proto."""
    out = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(make_corpus(seed)),
        model_writer=out,
        model_type="bpe",
        vocab_size=VOCAB_SIZE,
        character_coverage=1.0,
        byte_fallback=True,
        split_digits=True,
        user_defined_symbols=[*QWEN_SPECIAL_TOKENS, "\n"],
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        allow_whitespace_only_pieces=True,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        num_threads=1,
        shuffle_input_sentence=False,
        minloglevel=2,
    )
    return out.getvalue()


def main(argv: list[str] | None = None) -> int:
    """The command line: runs what the module docstring describes."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="verify the shipped file only")
    parser.add_argument("--out", type=pathlib.Path, default=OUT)
    args = parser.parse_args(argv)
    proto = train()
    digest = hashlib.sha256(proto).hexdigest()
    if args.check:
        same = args.out.is_file() and args.out.read_bytes() == proto
        print(f"{args.out}: {'up to date' if same else 'DIFFERS from a fresh training'}")
        return 0 if same else 1
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_bytes(proto)
    sp = spm.SentencePieceProcessor(model_proto=proto)
    print(f"wrote {args.out} ({len(proto)} bytes, {sp.get_piece_size()} pieces, sha256 {digest})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
