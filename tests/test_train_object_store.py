"""A workdir on object storage (`--workdir=gs://bucket/run`): the run writes its config,
metrics, episode pages, curves and summary there through `etils.epath`, not into a local
`./gs:/bucket/run` folder.

`gs://` is served here by an in-memory fsspec file system registered under the `gs`/`gcs`
protocols (epath's fsspec backend asks fsspec for "gcs"), so no network is needed. Array data of
orbax checkpoints goes through tensorstore's own GCS driver, and orbax asks the bucket's
namespace through google-cloud-storage (not installed here); neither reaches this fake, so the
job's checkpoints are redirected to a local directory, and the checkpoint directory is checked
to stay a `gs://` URI (which orbax opens itself).
"""

import json
import os

import fsspec
import pytest
from etils.epath.backend import _FileSystemSpecBackend
from fsspec.implementations.memory import MemoryFileSystem

from cua_jax.checkpoint.orbax_io import checkpoint_dir
from cua_jax.job import builders, train
from cua_jax.metrics import MetricsWriter, read_metrics
from tests.test_train_forced_mesh import _config, _load_tasks, _Pool


class _FakeGCS(MemoryFileSystem):
    protocol = ("gs", "gcs")
    store: dict = {}  # noqa: RUF012 -- fsspec's class-level store
    pseudo_dirs = [""]  # noqa: RUF012

    def __init__(self, *args, finalize_on_close=None, **kwargs):
        del finalize_on_close  # epath passes it for gcsfs
        super().__init__(*args, **kwargs)


@pytest.fixture
def fake_gcs(tmp_path, monkeypatch):
    for name in ("gs", "gcs"):
        fsspec.register_implementation(name, _FakeGCS, clobber=True)
    # epath keeps the file system it first made for a protocol: another module's fake GCS
    # (tests/db) may be that one in this worker
    _FileSystemSpecBackend._get_filesystem.cache_clear()
    _FakeGCS.store.clear()
    monkeypatch.chdir(tmp_path)  # a `./gs:` folder written by mistake would land here
    yield _FakeGCS()
    _FakeGCS.store.clear()
    assert not os.path.exists(tmp_path / "gs:")


def test_metrics_writer_rewrites_the_jsonl_on_object_storage(fake_gcs):
    w = MetricsWriter("gs://bucket/m", tensorboard=False)
    w.write(0, {"a": 1.0})
    w.write(1, {"a": 2.0})
    w.write(2, {"a": 3.0})
    w.truncate_after(1)  # a resumed run drops the rows after its checkpoint
    w.write(2, {"a": 4.0})
    w.close()
    rows = read_metrics("gs://bucket/m/metrics.jsonl")
    assert [(r["step"], r["a"]) for r in rows] == [(0, 1.0), (1, 2.0), (2, 4.0)]
    # a writer on an existing file (a resumed run) appends after the rows there
    w2 = MetricsWriter("gs://bucket/m", tensorboard=False)
    w2.write(3, {"a": 5.0})
    assert [r["step"] for r in read_metrics("gs://bucket/m/metrics.jsonl")] == [0, 1, 2, 3]


def test_checkpoint_directories_on_object_storage_stay_uris(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert checkpoint_dir("gs://bucket/run/checkpoints") == "gs://bucket/run/checkpoints"
    assert checkpoint_dir("rel/ckpts") == str(tmp_path / "rel" / "ckpts")


def test_the_main_job_writes_its_files_to_a_gs_workdir(fake_gcs, tmp_path, monkeypatch):
    local_ckpts = str(tmp_path / "ckpts")
    real = builders.build_checkpointer
    monkeypatch.setattr(
        builders, "build_checkpointer", lambda config, workdir: real(config, local_ckpts)
    )
    c = _config()
    size = (c.env.viewport_width, c.env.viewport_height)
    train.main(c, "gs://bucket/run", env_factory=lambda: _Pool(size), load_tasks=_load_tasks)
    fs = fake_gcs
    files = {p.split("bucket/run/", 1)[1] for p in fs.find("gs://bucket/run")}
    assert {"config.json", "metrics.jsonl", "summary.json", "curves.png"} <= files
    assert any(f.startswith("episodes/train_step") for f in files), files
    rows = read_metrics("gs://bucket/run/metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1]  # eval@0 (of no eval tasks), GRPO step 1
    assert json.loads(fs.cat("gs://bucket/run/summary.json"))["steps"] == 1
    assert fs.cat("gs://bucket/run/curves.png")[:4] == b"\x89PNG"
    assert os.listdir(os.path.join(local_ckpts, "checkpoints")) == ["1"]
