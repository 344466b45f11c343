"""Strict boolean environment switches."""

import pytest

from hpctrain.errors import EnvError
from hpctrain.runtime.env import env_flag


@pytest.mark.parametrize("raw, expected", [
    ("1", True), ("true", True), ("YES", True), (" on ", True),
    ("0", False), ("False", False), ("no", False), ("off", False), ("", False),
])
def test_clear_spellings(raw, expected):
    assert env_flag("X", {"X": raw}) is expected


def test_unset_gives_the_default_and_unclear_values_are_errors():
    assert env_flag("X", {}) is False and env_flag("X", {}, default=True) is True
    with pytest.raises(EnvError, match="X='maybe' is not a clear boolean"):
        env_flag("X", {"X": "maybe"})
