"""tools/bench_decode.py on a file (no browser): a table row with both decoders' CPU times, the
frame's row against the PNG, and the decode thread against inline."""

import io
import sys

import numpy as np
from PIL import Image

from tools import bench_decode


def test_a_file_gets_a_row(tmp_path, capsys, monkeypatch):
    path = tmp_path / "screen.png"
    rgb = np.random.default_rng(0).integers(0, 256, (48, 64, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    path.write_bytes(buf.getvalue())
    argv = ["bench_decode.py", "--viewports=", "--rounds=1", "--decodes=2", "--files", str(path)]
    monkeypatch.setattr(sys, "argv", argv)
    bench_decode.main()
    out = capsys.readouterr().out.splitlines()
    row, frame = [ln for ln in out if ln.startswith("| screen.png")]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[1] == str(len(buf.getvalue())) and cells[4].endswith("x")
    # the same screen as a host's frame: its bytes and both decodes' CPU
    cells = [c.strip() for c in frame.strip("|").split("|")]
    assert cells[1] == str(len(buf.getvalue())) and int(cells[2]) > 0 and cells[5].endswith("x")
    (handoff,) = [ln for ln in out if ln.startswith("| 1 screens")]
    assert handoff.rstrip("|").strip().endswith("x")
