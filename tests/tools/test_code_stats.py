"""tools/code_stats.py counts what the structure reviews quote, on a file written here."""

import pytest

from tools import code_stats


def test_file_stats_counts_long_functions_local_project_imports_and_skip_markers(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(60))  # 60 body lines + def = 61
    marker = code_stats.FMT_SKIP
    src = f"""import os


class Small:
    def short(self):
        import json  # the standard library: not a project import
        from cua_jax.job import builders
        return json, builders


def long():
{body}
    from envs import tasks
    from . import sibling
    return tasks, sibling


X = (1, 2)  {marker}
"""
    path = tmp_path / "m.py"
    path.write_text(src)
    s = code_stats.file_stats(path)
    assert s["lines"] == len(src.splitlines())
    assert s["long_functions"] == [("long", 64)]
    assert s["classes"] == [("Small", 5)]
    # cua_jax (line 7), envs and the relative import (lines 72, 73); json is not the project's
    assert s["local_imports"] == [7, 72, 73]
    assert s["fmt_skip"] == 1


def test_bad_folder_is_a_one_line_error(capsys):
    with pytest.raises(SystemExit) as e:
        code_stats.main(["no_such_folder"])
    assert e.value.code == 2
    assert "no_such_folder: not a folder" in capsys.readouterr().err


def test_import_cycles_finds_a_circle_through_module_level_imports_only(tmp_path):
    pkg = tmp_path / "cua_jax"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cua_jax import b\n")
    (pkg / "b.py").write_text("import cua_jax.c\n")
    (pkg / "c.py").write_text("try:\n    from cua_jax.a import x\nexcept ImportError:\n    pass\n")
    (pkg / "d.py").write_text("from cua_jax import a\n\n\ndef f():\n    from cua_jax import d\n")
    (pkg / "e.py").write_text("def g():\n    from cua_jax import f\n")
    (pkg / "f.py").write_text("from cua_jax import e\n")
    # a -> b -> c -> a at module level; e <-> f only through a function: not a cycle
    assert code_stats.import_cycles(tmp_path) == [["cua_jax.a", "cua_jax.b", "cua_jax.c"]]
    assert code_stats.import_cycles() == []  # this repository
