"""The run settings read from the environment (``runtime/env.py``, their one home): the memory
budget's sizes and refusals, and its use as the budget of a rank."""

import pytest

from ringmpi.runtime import env, memory


@pytest.mark.parametrize("text, value", [("4096", 4096), ("8G", 8 << 30), ("1.5m", 3 << 19), ("2KB", 2048),
                                         (" 1T ", 1 << 40)])
def test_memory_budget_sizes(monkeypatch, text, value):
    monkeypatch.setenv(env.MEMORY_BUDGET, text)
    assert env.memory_budget() == value
    assert memory.budget() == value


@pytest.mark.parametrize("text", ["0", "-1G", "lots", "G"])
def test_memory_budget_refuses_what_is_not_a_size(monkeypatch, text):
    monkeypatch.setenv(env.MEMORY_BUDGET, text)
    with pytest.raises(ValueError, match="RINGMPI_MEMORY_BUDGET must be a positive size"):
        env.memory_budget()


def test_memory_budget_unset_is_the_free_memory_share(monkeypatch):
    monkeypatch.delenv(env.MEMORY_BUDGET, raising=False)
    monkeypatch.setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4")
    monkeypatch.setattr(memory, "host_available", lambda: 10 << 30)
    assert env.memory_budget() is None
    assert memory.budget() == (10 << 30) // 4
