"""Session-wide: which modules' train steps the shared launches run (tests/parallel/train_cases)."""

import pytest

from tests.parallel import train_cases


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(items):
    train_cases.select_pooled(items)
