"""The browser package's dependency direction: env.py uses adapters.py, never the other way."""

import ast
import inspect

from envs.browser import adapters
from envs.browser.env import BrowserEnv


def test_adapters_import_nothing_from_the_env_module():
    tree = ast.parse(inspect.getsource(adapters))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(node.module)
            imported.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    assert "envs.browser.env" not in imported, imported
    assert "envs.browser" in imported  # the check reads real imports (miniwob, pages, suite)


def test_browser_env_has_what_an_adapter_reads():
    env = BrowserEnv()  # nothing starts until the env is entered
    members = set(adapters.AdapterHost.__annotations__) | {"hold_inline"}
    missing = {m for m in members if not hasattr(env, m)}
    assert not missing, missing
    assert callable(env.hold_inline)
