"""aiocoll._env: the one parser of numbers in environment variables."""

from __future__ import annotations

import pytest

from aiocoll._env import env_float, env_int


def test_unset_and_blank_mean_the_default_and_numbers_are_read() -> None:
    env = {"A": "7", "B": "", "C": "  ", "D": "2.5"}
    assert env_int("A", env) == 7 and env_int("B", env) is None and env_int("C", env) is None
    assert env_int("MISSING", env) is None
    assert env_float("D", env) == 2.5 and env_float("A", env) == 7.0 and env_float("B", env) is None


@pytest.mark.parametrize("parse", [env_int, env_float])
def test_garbage_names_the_variable_and_its_value(parse: object) -> None:
    with pytest.raises(ValueError, match=r"AIOCOLL_X='fast' is not .*set a number or unset it"):
        parse("AIOCOLL_X", {"AIOCOLL_X": "fast"})  # type: ignore[operator]
