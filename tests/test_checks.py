"""mstar_jax.checks: the int, number, bool and choice checks every layer makes, and their messages."""

import math
import re

import numpy as np
import pytest

from mstar_jax.checks import brief, check_bool, check_choice, check_int, check_number, is_int


def test_is_int_refuses_bools_and_takes_numpy_ints_only_when_asked():
    assert is_int(3)
    assert is_int(-1)
    assert not is_int(True)
    assert not is_int(3.0)
    assert not is_int("3")
    assert not is_int(np.int64(3))
    assert is_int(np.int64(3), numpy=True)
    assert is_int(np.uint8(0), numpy=True)
    assert not is_int(np.bool_(True), numpy=True)
    assert not is_int(None, numpy=True)


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"minimum": 1}, 0, "n=0 must be an int >= 1"),
        ({"minimum": 1}, True, "n=True must be an int >= 1"),
        ({"minimum": 0}, False, "n=False must be an int >= 0"),
        ({"minimum": 1}, 2.0, "n=2.0 must be an int >= 1"),
        ({"minimum": 1}, "2", "n='2' must be an int >= 1"),
        ({"minimum": 1}, None, "n=None must be an int >= 1"),
        ({}, 2.0, "n=2.0 must be an int"),
        ({"minimum": 0, "below": 3}, 3, "n=3 must be an int in [0, 3)"),
        ({"minimum": 0, "below": 3}, -1, "n=-1 must be an int in [0, 3)"),
        ({"minimum": 1, "maximum": 4}, 5, "n=5 must be an int in [1, 4]"),
        ({"maximum": 4}, 5, "n=5 must be an int <= 4"),
        ({"below": 4}, 4, "n=4 must be an int < 4"),
        ({"minimum": 1, "allow_none": True}, 0, "n=0 must be None or an int >= 1"),
        ({"minimum": 1, "allow_none": True}, "x", "n='x' must be None or an int >= 1"),
        ({"minimum": 1}, np.int64(3), "n=np.int64(3) must be an int >= 1"),
        ({"minimum": 1, "numpy": True}, np.int8(-1), "n=np.int8(-1) must be an int >= 1"),
        ({"minimum": 1, "numpy": True}, np.bool_(True), "n=np.True_ must be an int >= 1"),
    ],
)
def test_check_int_refuses_with_the_field_the_value_and_what_is_allowed(kwargs, value, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_int("n", value, **kwargs)


def test_check_int_returns_python_ints_and_lets_none_through_when_allowed():
    assert check_int("n", 1, minimum=1) == 1
    assert check_int("n", 0, minimum=0, below=1) == 0
    assert check_int("n", 4, minimum=1, maximum=4) == 4
    value = check_int("n", np.int32(7), minimum=1, numpy=True)
    assert value == 7
    assert type(value) is int
    assert check_int("n", None, minimum=1, allow_none=True) is None
    assert check_int("n", -5) == -5  # no bounds: any int


def test_check_int_type_error_names_the_type_and_keeps_value_errors_for_bounds():
    with pytest.raises(TypeError, match=r"^n=True must be an int >= 1, got bool$"):
        check_int("n", True, minimum=1, type_error=True)
    with pytest.raises(TypeError, match=r"^n=1\.0 must be an int >= 0, got float$"):
        check_int("n", 1.0, minimum=0, type_error=True)
    with pytest.raises(ValueError, match=r"^n=0 must be an int >= 1$"):
        check_int("n", 0, minimum=1, type_error=True)


def test_check_int_takes_one_upper_bound():
    with pytest.raises(TypeError, match="at most one of maximum= and below="):
        check_int("n", 1, maximum=2, below=3)


@pytest.mark.parametrize(
    ("kwargs", "value", "message"),
    [
        ({"minimum": 0.0}, -1.0, "x=-1.0 must be a finite number >= 0.0"),
        ({"minimum": 0.0}, math.nan, "x=nan must be a finite number >= 0.0"),
        ({"minimum": 0.0}, math.inf, "x=inf must be a finite number >= 0.0"),
        ({"minimum": 0.0}, True, "x=True must be a number >= 0.0"),
        ({"minimum": 0.0}, None, "x=None must be a number >= 0.0"),
        ({"minimum": 0.0}, "fast", "x='fast' must be a number >= 0.0"),
        ({"minimum": 0.0, "exclusive": True}, 0, "x=0 must be a finite number > 0.0"),
        ({"minimum": 0.0, "exclusive": True}, True, "x=True must be a number > 0.0"),
        ({"minimum": 0, "finite": False}, -1, "x=-1 must be a number >= 0"),
        ({"minimum": 0, "finite": False}, math.nan, "x=nan must be a number >= 0"),
        ({"minimum": 0, "note": "0: greedy"}, -0.5, "x=-0.5 must be a finite number >= 0 (0: greedy)"),
        ({"minimum": 0, "note": "0: greedy"}, True, "x=True must be a number >= 0 (0: greedy)"),
        ({"minimum": 0.0, "allow_none": True}, -1, "x=-1 must be None or a finite number >= 0.0"),
    ],
)
def test_check_number_refuses_with_the_field_the_value_and_what_is_allowed(kwargs, value, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        check_number("x", value, **kwargs)


def test_check_number_hints_at_yaml_reading_an_exponent_as_a_string():
    hint = " (YAML reads '1e-3' as a string: write it with a dot and a signed exponent, e.g. 1.0e-3)"
    with pytest.raises(
        ValueError, match=f"^{re.escape('x=' + repr('1e-3') + ' must be a number >= 0.0' + hint)}$"
    ):
        check_number("x", "1e-3", minimum=0.0)
    with pytest.raises(ValueError, match=r"^x='soon' must be a number >= 0\.0$"):  # no hint: not a number
        check_number("x", "soon", minimum=0.0)


def test_check_number_returns_floats_and_lets_none_and_infinity_through_when_asked():
    value = check_number("x", 1, minimum=0)
    assert value == 1.0
    assert type(value) is float
    assert check_number("x", 0.0, minimum=0.0) == 0.0
    assert check_number("x", np.float64(0.5), minimum=0.0) == 0.5  # a float subclass
    assert check_number("x", None, minimum=0.0, allow_none=True) is None
    assert check_number("x", math.inf, minimum=0, finite=False) == math.inf


def test_check_bool_takes_bools_only():
    assert check_bool("b", True) is True
    assert check_bool("b", False) is False
    for value, shown in ((1, "1"), ("yes", "'yes'"), (None, "None"), (np.bool_(True), "np.True_")):
        with pytest.raises(ValueError, match=f"^b={re.escape(shown)} must be a bool$"):
            check_bool("b", value)


def test_check_choice_takes_one_of_the_choices_of_their_type():
    assert check_choice("c", "rows", ("rows", "decode")) == "rows"
    for value, shown in (("other", "'other'"), (["rows"], "['rows']"), (np.array(["rows"]), None)):
        with pytest.raises(ValueError, match=r"must be one of \['rows', 'decode'\]$") as raised:
            check_choice("c", value, ("rows", "decode"))
        if shown is not None:
            assert str(raised.value).startswith(f"c={shown} ")
    with pytest.raises(ValueError, match=r"^c=True must be one of \[1, 2\]$"):
        check_choice("c", True, (1, 2))


def test_an_int_beyond_every_float_is_out_of_range_not_an_overflow():
    with pytest.raises(ValueError, match=r"^x=1000000000.*\.\.\. must be a finite number in \[0, 4\]$"):
        check_number("x", 10**400, minimum=0, maximum=4)
    with pytest.raises(ValueError, match=r"must be a finite number >= 0$"):
        check_number("x", -(10**400), minimum=0)


def test_a_refusal_names_a_long_value_without_echoing_it():
    long_text, huge = "v" * 10**6, 10**5000  # past Python's digits for str(): repr itself raises
    for check in (
        lambda: check_choice("voice", long_text, ("a",)),
        lambda: check_int("n", long_text),
        lambda: check_int("n", huge, maximum=4),
        lambda: check_bool("b", long_text),
        lambda: check_number("x", long_text, minimum=0),
        lambda: check_number("x", "1" * 10**6, minimum=0),
    ):
        with pytest.raises(ValueError, match=r"^\w+=.+ must be ") as refused:
            check()
        message = str(refused.value)
        assert len(message) < 300, message[:400]
    assert str(refused.value).startswith("x='11111111")
    with pytest.raises(ValueError, match=r"^n=<an int of 16610 bits> must be an int in \[0, 4\]$"):
        check_int("n", huge, minimum=0, maximum=4)
    with pytest.raises(ValueError, match=r"^c=<a list too long to show> must be one of \['a'\]$"):
        check_choice("c", [huge], ("a",))


def _cut(text: str) -> str:
    return text if len(text) <= 60 else text[:57] + "..."


def test_brief_is_repr_cut_to_60_characters():
    itself, mapping, tuple_of_list = [1], {}, ([],)
    itself.append(itself)
    mapping["me"] = mapping
    tuple_of_list[0].append(tuple_of_list)
    values = [
        None, True, 3.5, "it's", "v" * 100, [], (), {}, set(), frozenset(), (1,), ((1,),), [1, (2,)],
        {1: [2, 3], "k": {"z": (4,)}}, {1, 2, 3}, frozenset({1}), [frozenset({1, 2})] * 10,
        list(range(100)), {i: str(i) * 5 for i in range(30)}, itself, mapping, tuple_of_list,
        np.int64(7), [np.float32(0.5)],
    ]  # fmt: skip
    for value in values:
        assert brief(value) == _cut(repr(value))
    assert brief(itself) == "[1, [...]]"  # a list inside itself, as repr shows it


def test_brief_of_a_yaml_alias_bomb_writes_only_what_it_shows():
    bomb = [0] * 9
    for _ in range(19):  # nine references to the level below at each level: 9**20 zeros
        bomb = [bomb] * 9
    assert brief(bomb) == "[" * 20 + "0, 0, 0, 0, 0, 0, 0, 0, 0], [0, 0, 0,..."
    assert len(brief(bomb)) == 60
    shared = {"a": [bomb] * 9, "b": 1}
    assert brief(shared) == "{'a': [" + "[" * 20 + "0, 0, 0, 0, 0, 0, 0, 0, 0], [0..."
    deep: list = []
    for _ in range(100_000):  # deeper than repr can recurse
        deep = [deep]
    assert brief(deep) == "[" * 57 + "..."
    with pytest.raises(ValueError, match=r"^token_counts\[0\]=\[\[\[\[.*\.\.\. must be an int >= 1$"):
        check_int("token_counts[0]", bomb, minimum=1)
