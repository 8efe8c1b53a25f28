"""The collectives of a compiled program and the bytes each device moves over the interconnect.

`hlo_collectives(text)` reads a compiled module's HLO text (`compiled.as_text()`): one entry per
collective instruction with its kind, buffer bytes, group size, the bytes one device moves and
how many times it runs (the product of the known trip counts of the while loops around it: a
micro-batch scan's body runs once per micro-batch). `moved_bytes` sums them.

Bytes one device moves, by kind, for a buffer of b bytes over a group of g devices (ring
algorithms, what the device receives):

- all-gather: (g-1)/g of the gathered result; all-to-all: (g-1)/g of its buffer;
- all-reduce: 2(g-1)/g (a reduce-scatter then an all-gather); reduce-scatter: (g-1) x its
  scattered result; collective-permute: its buffer;
- ragged-all-to-all: (g-1)/g of the smaller of its input and output buffers. A dispatch sends
  a device's own rows (its input, n x K of them) into a worst-case receive buffer (its output,
  g x n x K rows); the return trip sends from that receive buffer back into the n x K rows: on
  both trips the smaller buffer is the rows moved (exact for a router that spreads the rows
  evenly over the devices).
"""

from __future__ import annotations

import math
import re
from collections import defaultdict

_KINDS = (
    "ragged-all-to-all",
    "collective-permute",
    "reduce-scatter",
    "all-gather",
    "all-reduce",
    "all-to-all",
)
_DTYPE_BYTES = {
    "f64": 8,
    "s64": 8,
    "u64": 8,
    "f32": 4,
    "s32": 4,
    "u32": 4,
    "bf16": 2,
    "f16": 2,
    "s16": 2,
    "u16": 2,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_INST = re.compile(rf"=\s*(.+?)\s+({'|'.join(_KINDS)})(-start)?\((.*)")
_DTYPES = "|".join(sorted(_DTYPE_BYTES, key=len, reverse=True))
_ARRAY = re.compile(rf"\b({_DTYPES})\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\)\s*->.*\{\s*$")
_DEF = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.+?)\s+[\w\-]+\(")
_WHILE = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")
_TRIP = re.compile(r'known_trip_count"?\s*[:=]\s*\{\s*"?n"?\s*[:=]\s*"?(\d+)')
_CALLS = re.compile(
    r"\b(?:to_apply|calls|body|condition)=%?([\w.\-]+)|branch_computations=\{([^}]*)\}"
)


def _array_bytes(text: str) -> list[int]:
    return [
        _DTYPE_BYTES[dt] * math.prod(int(d) for d in dims.split(",") if d)
        for dt, dims in _ARRAY.findall(text)
    ]


def _group_size(line: str, kind: str) -> int:
    if (rg := re.search(r"replica_groups=mesh\[([^\]]*)\] \{([^}]*)\}", line)) is not None:
        dims = {k: int(v) for k, v in re.findall(r"'(\w+)'=(\d+)", rg.group(1))}
        return math.prod(dims[a] for a in re.findall(r"'(\w+)'", rg.group(2)))
    if (rg := re.search(r"replica_groups=\{\{([\d,]+)\}", line)) is not None:
        return len(rg.group(1).split(","))
    if (rg := re.search(r"replica_groups=\[(\d+),(\d+)\]", line)) is not None:
        return int(rg.group(2))
    return 2 if kind == "collective-permute" else 1


def _multipliers(lines: list[str]) -> dict[str, int]:
    """How many times each computation runs per call of the entry: a while body its loop's known
    trip count times its caller's count (1 where the count is unknown); others their caller's."""
    owner: dict[int, str] = {}
    entry, current = None, None
    for i, line in enumerate(lines):
        m = _COMPUTATION.match(line)
        if m is not None:
            current = m.group(1)
            if line.lstrip().startswith("ENTRY"):
                entry = current
        owner[i] = current or ""
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    for i, line in enumerate(lines):
        caller = owner[i]
        body = _WHILE.search(line)
        trips = int(t.group(1)) if body and (t := _TRIP.search(line)) else 1
        for one, many in _CALLS.findall(line):
            for name in (one or many).replace("%", "").split(","):
                name = name.strip()
                if name:
                    edges[caller].append((name, trips if body and name == body.group(1) else 1))
    mult: dict[str, int] = defaultdict(int)
    if entry is None:
        return defaultdict(lambda: 1)
    mult[entry] = 1
    order, seen = [entry], {entry}
    while order:  # HLO call graphs are acyclic; a computation's callers come first in BFS order
        nxt = []
        for c in order:
            for callee, trips in edges.get(c, ()):
                mult[callee] += mult[c] * trips
                if callee not in seen:
                    seen.add(callee)
                    nxt.append(callee)
        order = nxt
    return mult


def hlo_collectives(text: str) -> list[dict]:
    """One dict per collective instruction of a compiled module's HLO text: kind, buffer bytes
    (an async start's largest array; a variadic op's arrays summed), group size, `moved` (the
    bytes one device moves per run, the module docstring's model) and `runs` (times it runs)."""
    lines = text.splitlines()
    mult = _multipliers(lines)
    shapes = {m.group(1): m.group(2) for line in lines if (m := _DEF.match(line)) is not None}
    owner = ""
    out = []
    for line in lines:
        if (c := _COMPUTATION.match(line)) is not None:
            owner = c.group(1)
            continue
        m = _INST.search(line)
        if m is None:
            continue
        shape, kind, start, operands = m.group(1), m.group(2), m.group(3), m.group(4)
        sizes = _array_bytes(shape)
        nbytes = max(sizes or [0]) if start or kind == "ragged-all-to-all" else sum(sizes)
        g = _group_size(line, kind)
        frac = (g - 1) / g if g > 1 else 0.0
        if kind == "ragged-all-to-all":
            # its first operand is the send buffer; compiled text may name it without its shape
            first = operands.split(",")[0].strip()
            sent = _array_bytes(first) or _array_bytes(shapes.get(first.lstrip("%"), ""))
            moved = frac * min(sent[0] if sent else nbytes, nbytes)
        else:
            factor = {"all-reduce": 2 * frac, "collective-permute": 1.0, "reduce-scatter": g - 1}
            moved = factor.get(kind, frac) * nbytes
        runs = mult.get(owner, 1) or 1
        out.append(dict(kind=kind, bytes=nbytes, group=g, moved=moved, runs=runs))
    return out


def moved_bytes(text: str) -> dict[str, float]:
    """Bytes one device moves per run of the module, by collective kind (runs counted)."""
    out: dict[str, float] = defaultdict(float)
    for c in hlo_collectives(text):
        out[c["kind"]] += c["moved"] * c["runs"]
    return dict(out)
