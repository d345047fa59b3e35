import pytest

from raypipe import InvalidInput, SamplingParams


def test_defaults_are_greedy():
    params = SamplingParams()
    assert params.greedy and params.max_tokens == 16 and params.stop is None


def test_normalises_stop_string_and_integral_floats():
    params = SamplingParams(max_tokens=4.0, stop="END", stop_token_ids=(3, 4))
    assert params.max_tokens == 4 and params.stop == ["END"] and params.stop_token_ids == [3, 4]


@pytest.mark.parametrize("field, value", [
    ("max_tokens", 0), ("max_tokens", -3), ("max_tokens", True), ("max_tokens", 2.5), ("max_tokens", "8"),
    ("temperature", -0.1), ("temperature", float("nan")), ("temperature", float("inf")), ("temperature", "hot"),
    ("top_p", 0.0), ("top_p", 1.5), ("top_k", -1), ("seed", -1), ("seed", 2**63), ("seed", 1.5),
    ("stop", ""), ("stop", [""]), ("stop", [1]), ("stop", ["s"] * 17), ("stop_token_ids", [-1]),
    ("stop_token_ids", 5), ("ignore_eos", "yes"),
])
def test_nonsense_is_invalid_input_naming_the_field(field, value):
    with pytest.raises(InvalidInput) as info:
        SamplingParams(**{field: value})
    assert info.value.item == f"sampling_params.{field}"
