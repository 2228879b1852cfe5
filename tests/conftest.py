"""The helpers of ``tests/support`` (on the path through pyproject's ``pythonpath``) that assert on
a test's behalf get pytest's assertion messages too, as they had inside the test modules."""

import pytest

pytest.register_assert_rewrite("file_check")
