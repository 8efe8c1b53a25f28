"""Whether an eval measured anything, and writing its result only when it did.

    check_sampling(samples, temperature)       # ValueError naming the flag
    failure = eval_failure(result, trajs)      # None, or why the result is not a result
    path = write_result(out_dir, result, failure)

An eval whose episodes were mostly infrastructure faults (a dead browser host, an endpoint that
does not serve the model asked for) scores what little ran, or nothing; one with a NaN in its
numbers wrote a bare `NaN` that is not JSON. Either used to replace the last good `eval.json`
(and the database's row for that step) and exit 0. Now such a result goes to `eval.failed.json`
beside it, `eval.json` keeps the last good one, and the caller exits non-zero with the cause.
"""

from __future__ import annotations

import collections
import json
import math
import os
from collections.abc import Sequence
from typing import Any

# An eval is a failure when more than this share of its episodes were infrastructure faults.
MAX_INFRA_FAULT_SHARE = 0.5
RESULT_FILE, FAILED_FILE = "eval.json", "eval.failed.json"


def check_sampling(samples: int, temperature: float | None) -> None:
    """Raises ValueError (naming the flag) for --samples < 0 or a --temperature that is not a
    finite number >= 0 (NaN passes `< 0` checks and samples garbage)."""
    if samples < 0:
        raise ValueError(f"--samples={samples} must be >= 0")
    if temperature is not None and not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature={temperature} must be a finite number >= 0 (0: greedy)")


def _non_finite(obj: Any, where: str = "") -> str | None:
    """The key path of the first NaN or infinite number in `obj`, else None."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return where or "(the result)"
    if isinstance(obj, dict):
        items: Any = obj.items()
    elif isinstance(obj, list | tuple):
        items = enumerate(obj)
    else:
        return None
    for k, v in items:
        found = _non_finite(v, f"{where}.{k}" if where else str(k))
        if found:
            return found
    return None


def eval_failure(result: dict[str, Any], trajs: Sequence[Any]) -> str | None:
    """Why `result` is not a measurement, else None: most episodes (`trajs`, each with
    `infra_fault` and `failure_reason`) were infrastructure faults (the commonest cause is
    named), or a number in it is NaN or infinite."""
    faults = [t for t in trajs if t.infra_fault]
    if trajs and len(faults) > MAX_INFRA_FAULT_SHARE * len(trajs):
        reasons = collections.Counter((t.failure_reason or "?")[:300] for t in faults)
        reason, n = reasons.most_common(1)[0]
        return (
            f"{len(faults)} of {len(trajs)} episodes were infrastructure faults, not "
            f"measurements ({n} of them: {reason})"
        )
    bad = _non_finite(result)
    if bad:
        return f"{bad} is {result_value(result, bad)!r}, not a finite number"
    return None


def _strict(obj: Any) -> Any:
    """`obj` with NaN and infinite numbers as strings ("nan", "inf"): strict JSON."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _strict(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_strict(v) for v in obj]
    return obj


def result_value(result: dict[str, Any], path: str) -> Any:
    """The value at a `_non_finite` key path (for the message)."""
    obj: Any = result
    for k in path.split("."):
        obj = obj[int(k)] if isinstance(obj, list | tuple) else obj.get(k)
    return obj


def write_result(out_dir: str, result: dict[str, Any], failure: str | None = None) -> str:
    """Writes `result` to OUT/eval.json (atomically, strict JSON), or with a `failure` to
    OUT/eval.failed.json (with the failure in it, NaN as a string) leaving eval.json as
    it was. Returns the path written."""
    if failure is not None:
        text = json.dumps(_strict({**result, "failure": failure}), indent=2, default=str)
        path = os.path.join(out_dir, FAILED_FILE)
    else:
        text = json.dumps(result, indent=2, allow_nan=False)
        path = os.path.join(out_dir, RESULT_FILE)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)  # a crash mid-write leaves the old file, never half of a new one
    return path


__all__ = [
    "FAILED_FILE",
    "MAX_INFRA_FAULT_SHARE",
    "RESULT_FILE",
    "check_sampling",
    "eval_failure",
    "write_result",
]
