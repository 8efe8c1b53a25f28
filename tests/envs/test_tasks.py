"""Task sources: every source type, combinations, the registry, and errors that name the fix."""

import json

import pytest

from cua_jax.env_api import Task
from envs import tasks as T
from envs.browser import suite


def test_builtin_filters_and_reproducible():
    ts = T.load_tasks(
        {
            "source_type": "builtin",
            "split": "train",
            "category": "forms",
            "difficulty": "medium",
            "limit": 20,
            "seed": 42,
        }
    )
    assert len(ts) == 20
    assert {t.category for t in ts} == {"forms"} and {t.difficulty for t in ts} == {"medium"}
    assert all(t.spec["kind"] == "builtin" and t.split == "train" for t in ts)
    again = T.load_tasks(
        {
            "source_type": "builtin",
            "split": "train",
            "category": "forms",
            "difficulty": "medium",
            "limit": 20,
            "seed": 42,
        }
    )
    assert [t.id for t in ts] == [t.id for t in again]
    other = T.load_tasks({"source_type": "builtin", "category": "forms", "limit": 20, "seed": 43})
    assert [t.id for t in ts] != [t.id for t in other]
    easy = T.load_tasks(
        {"source_type": "builtin", "templates": list(suite.SMOKE_TEMPLATES), "per_template": 3}
    )
    assert len(easy) == 3 * len(suite.SMOKE_TEMPLATES)
    assert {t.difficulty for t in easy} == {"easy"}


def test_other_sources_and_combination(tmp_path):
    f = tmp_path / "tasks.jsonl"
    rows = [
        Task(
            id="mine/1", instruction="Open the menu", source="custom", has_checker=False
        ).to_dict(),
        {"source_type": "ids", "task_ids": ["builtin/nav-link/5"]},
    ]
    f.write_text("# comment\n" + "\n".join(json.dumps(r) for r in rows) + "\n\n")
    ts = T.load_tasks(
        [
            {"source_type": "miniwob", "names": ["click-test", "enter-text"], "seeds_per_task": 2},
            {"source_type": "ids", "task_ids": ["builtin/click-button/17", "miniwob/click-test/3"]},
            {"source_type": "custom", "instructions": ["Find the pricing page", "Log out"]},
            {"source_type": "file", "path": str(f)},
        ]
    )
    ids = [t.id for t in ts]
    assert len(ts) == 4 + 2 + 2 + 2
    assert ids[4:6] == ["builtin/click-button/17", "miniwob/click-test/3"]
    assert (
        ts[4].seed == 17
        and ts[5].seed == 3
        and ts[5].spec == {"kind": "miniwob", "name": "click-test"}
    )
    assert [t.instruction for t in ts[6:8]] == ["Find the pricing page", "Log out"]
    assert not ts[6].has_checker and ts[6].spec["kind"] == "page"
    assert ids[8:] == ["mine/1", "builtin/nav-link/5"] and not ts[8].has_checker
    assert ts[8].spec == {"kind": "page"} and ts[9].spec["template"] == "nav-link"
    assert len({t.id for t in ts[:4]}) == 4  # miniwob instances get distinct ids


@pytest.mark.parametrize(
    "src,msg",
    [
        ({"source_type": "osworld2"}, "valid: builtin, miniwob, ids, custom, file"),
        ({"source_type": "builtin", "category": "games"}, "valid: click, forms"),
        ({"source_type": "builtin", "split": "test"}, "valid: train, eval"),
        ({"source_type": "builtin", "difficulty": "insane"}, "valid: easy, medium, hard"),
        ({"source_type": "builtin", "templates": ["nope"]}, "valid: click-button"),
        ({"source_type": "builtin", "limt": 3}, "valid keys: api_actions, category"),
        ({"source_type": "miniwob", "names": ["click-tset"]}, "valid: "),
        ({"source_type": "ids", "task_ids": ["builtin/click-button/x"]}, "builtin/<template>"),
        ({"source_type": "ids", "task_ids": ["zzz/1"]}, "ids start with one of"),
        ({"source_type": "custom", "instructions": []}, "non-empty list"),
        ({"source_type": "file", "path": "/nonexistent.jsonl"}, "does not exist"),
        ("builtin", "must be a dict"),
    ],
)
def test_bad_sources_name_the_fix(src, msg):
    with pytest.raises(T.TaskSourceError, match=msg.replace("(", r"\(")):
        T.load_tasks(src)


def test_malformed_jsonl_names_the_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"id": "a", "instruction": "x"}\n{not json}\n')
    with pytest.raises(T.TaskSourceError, match=r"bad.jsonl:2: not valid JSON"):
        T.load_tasks({"source_type": "file", "path": str(f)})
    f.write_text('{"id": "a", "instrution": "x"}\n')
    with pytest.raises(T.TaskSourceError, match=r":1: unknown task field\(s\) \['instrution'\]"):
        T.load_tasks({"source_type": "file", "path": str(f)})


def test_registry_lets_other_packages_add_sources():
    def load_desktop(cfg):
        return [
            Task(id=f"unit-test/{i}", instruction=f"do {i}", source="desktop", spec={"kind": "vm"})
            for i in range(cfg.get("n", 1))
        ]

    T.register_source("desktop-test", load_desktop, keys=("n",))
    # A prefix of its own: the real "desktop" one (envs.vm) must survive this test.
    T.register_id_prefix("unit-test", lambda tid: Task(id=tid, instruction="x", source="desktop"))
    try:
        ts = T.load_tasks(
            [
                {"source_type": "desktop-test", "n": 2},
                {"source_type": "ids", "task_ids": ["unit-test/abc"]},
            ]
        )
        assert [t.id for t in ts] == ["unit-test/0", "unit-test/1", "unit-test/abc"]
        with pytest.raises(T.TaskSourceError, match="valid keys: n"):
            T.load_tasks({"source_type": "desktop-test", "m": 1})
    finally:
        T._SOURCES.pop("desktop-test")
        T._SOURCE_KEYS.pop("desktop-test")
        T._ID_PREFIXES.pop("unit-test")


def test_config_dict_sources():
    """Configs hand over ml_collections ConfigDicts (not Mappings) and tuples of dicts."""
    import ml_collections

    one = ml_collections.ConfigDict({"source_type": "builtin", "limit": 3, "seed": 5})
    assert [t.id for t in T.load_tasks(one)] == [
        t.id for t in T.load_tasks({"source_type": "builtin", "limit": 3, "seed": 5})
    ]
    assert len(T.load_tasks((one, {"source_type": "custom", "instructions": ["x"]}))) == 4


def test_bad_task_files_and_values_are_one_task_source_error(tmp_path):
    """Each was a traceback (AttributeError, RecursionError, UnicodeDecodeError, TypeError) and
    exit 1 from launch/tpu.py and tools/eval.py, which turn a TaskSourceError into one line."""
    spec_str = tmp_path / "spec_str.jsonl"
    spec_str.write_text('{"id": "a", "instruction": "x", "spec": "a string"}\n')
    me = tmp_path / "me.jsonl"
    me.write_text(json.dumps({"source_type": "file", "path": str(me)}) + "\n")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"  # a -> b -> a
    a.write_text(json.dumps({"source_type": "file", "path": str(b)}) + "\n")
    b.write_text(
        '{"id": "t", "instruction": "x"}\n' + json.dumps({"source_type": "file", "path": str(a)})
    )
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(b'{"id": "t", "instruction": "x"}\n{"id": "caf\xe9", "instruction": "x"}\n')
    deep = tmp_path / "deep.jsonl"
    deep.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    cases = [
        ({"source_type": "file", "path": str(spec_str)}, "1: task field 'spec' must be an object"),
        ({"source_type": "file", "path": str(me)}, f"task file {me} includes itself"),
        ({"source_type": "file", "path": str(a)}, f"({a} -> {b} -> {a})"),
        ({"source_type": "file", "path": str(latin)}, "latin.jsonl:2: not UTF-8 text (byte 43"),
        ({"source_type": "file", "path": str(deep)}, "deep.jsonl:1: JSON nested too deep"),
        ({"source_type": "builtin", "limit": "x"}, "limit must be an integer >= 0"),
        ({"source_type": "builtin", "seed": "abc"}, "seed must be an integer"),
        ({"source_type": "miniwob", "names": ["click-test"], "limit": "x"}, "limit must be"),
        ({"source_type": "custom", "instructions": ["x"], "max_steps": "9"}, "max_steps must be"),
        ("junk", "got str 'junk'"),
        (["junk"], "source #0 must be a dict"),
        (7, "got int 7"),
    ]
    for src, msg in cases:
        with pytest.raises(T.TaskSourceError) as e:
            T.load_tasks(src)
        assert msg in str(e.value) and "\n" not in str(e.value), (src, str(e.value))
    with pytest.raises(T.TaskSourceError, match="config.tasks: source #0"):
        T.source_dicts(("junk",), "config.tasks")
    assert T._reading == []  # nothing left on the include stack after the errors
