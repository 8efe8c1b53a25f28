r"""Export a training run's checkpoint to a Hugging Face directory (merged LoRA, config, tokenizer).

    python tools/export_hf.py --workdir=/tmp/cua_smoke --out=/tmp/cua_smoke_hf [--step=N]

transformers' `AutoModelForImageTextToText.from_pretrained(OUT)` (or the Qwen2.5-VL / Qwen3-VL
class) loads the result with no missing or unexpected keys, and its logits equal cua_jax's.
"""

from __future__ import annotations

import os
import sys

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _ROOT not in sys.path:
    sys.path.insert(0, _ROOT)

from absl import app, flags  # noqa: E402

_WORKDIR = flags.DEFINE_string("workdir", None, "The training run's directory.", required=True)
_OUT = flags.DEFINE_string("out", None, "Where to write the Hugging Face directory.", required=True)
_STEP = flags.DEFINE_integer("step", None, "Checkpoint step (default: the latest).")


def main(argv: list[str]) -> None:
    del argv
    from configs.common import load_run_config
    from cua_jax.checkpoint.hf_export import export_checkpoint

    config = load_run_config(_WORKDIR.value)
    step = export_checkpoint(_WORKDIR.value, _OUT.value, step=_STEP.value, config=config)
    print(f"exported step {step} of {_WORKDIR.value} to {_OUT.value}")


if __name__ == "__main__":
    app.run(main)
