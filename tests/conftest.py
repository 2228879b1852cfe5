"""The helpers of ``tests/support`` (on the path through pyproject's ``pythonpath``) that assert on
a test's behalf get pytest's assertion messages too, as they had inside the test modules; and a
module whose tests wait on long background work (NVRTC's compiles, the MPICH venv's build) starts
it as soon as the session knows it will run them; a module with ``RUN_LAST = True`` (the one that
waits longest for its background work) runs after every other."""

import pytest

pytest.register_assert_rewrite("file_check", "training")


def _modules_with(session, name):
    seen = []
    for item in session.items:
        module = getattr(item, "module", None)
        if module is not None and hasattr(module, name) and module not in seen:
            seen.append(module)
    return seen


def pytest_collection_modifyitems(session, config, items):
    items.sort(key=lambda item: bool(getattr(getattr(item, "module", None), "RUN_LAST", False)))


def pytest_collection_finish(session):
    for module in _modules_with(session, "start_compiling"):
        module.start_compiling(session.items)


def pytest_sessionfinish(session):
    for module in _modules_with(session, "stop_compiling"):
        module.stop_compiling()
