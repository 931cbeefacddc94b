import pytest

from mla_tune.tuning.space import ConfigError, ParamSpace, config_key, load_backend_space


def _space():
    return ParamSpace.from_mapping({"a": [1, 2], "b": ["x", "y", "z"], "c": [True, False]})


def test_grid_enumerates_product_in_order():
    grid = list(_space().grid())
    assert len(grid) == _space().size() == 12
    assert grid[0] == {"a": 1, "b": "x", "c": True}
    assert grid[-1] == {"a": 2, "b": "z", "c": False}


@pytest.mark.parametrize("bad", [
    {"a": 3, "b": "x", "c": True},            # value not declared
    {"a": 1, "b": "x"},                       # missing parameter
    {"a": 1, "b": "x", "c": True, "d": 0},    # unknown parameter
    {"a": "1", "b": "x", "c": True},          # wrong type
    {"a": True, "b": "x", "c": True},         # bool is not an int choice
    ["a", 1],                                 # not a mapping
])
def test_validate_rejects_points_outside_space(bad):
    with pytest.raises(ConfigError):
        _space().validate(bad)


def test_validate_accepts_json_floats_for_ints():
    assert _space().validate({"a": 2.0, "b": "y", "c": False})["a"] == 2


def test_defaults_fill_knobs_a_stored_config_predates():
    s = _space().with_defaults({"c": True, "elsewhere": 1})  # knobs outside are dropped
    assert s.defaults == (("c", True),)
    assert s.validate({"a": 1, "b": "x"}) == {"a": 1, "b": "x", "c": True}
    assert s.validate({"a": 1, "b": "x", "c": False})["c"] is False  # given wins
    assert s.restrict({"a": 2}).validate({"a": 2, "b": "y"})["c"] is True
    with pytest.raises(ConfigError, match="missing"):
        s.validate({"a": 1, "c": True})  # no default for b
    with pytest.raises(ConfigError, match="not one of"):
        s.restrict({"c": False}).validate({"a": 1, "b": "x"})  # the default left the space


def test_config_key_is_canonical():
    assert config_key({"b": 1, "a": 2}) == config_key({"a": 2, "b": 1}) == '{"a":2,"b":1}'


def test_restrict_and_device_overrides():
    s = _space().restrict({"a": 2})
    assert s.choices("a") == (2,) and s.size() == 6
    with pytest.raises(ConfigError):
        _space().restrict({"a": 5})
    cpu = load_backend_space("torch", "cpu")
    gpu = load_backend_space("torch", "cuda")
    assert cpu.names == gpu.names and cpu.size() < gpu.size()


def test_restrict_to_lists_keeps_declaration_order():
    s = _space().restrict({"b": ["z", "x"], "c": False})
    assert s.choices("b") == ("x", "z") and s.choices("c") == (False,)
    assert s.size() == 4


def test_parse_pin():
    from mla_tune.tuning.space import parse_pin

    assert parse_pin("triton.num_splits=1,4") == ("triton", "num_splits", [1, 4])
    assert parse_pin("torch.compute_dtype=bfloat16") == ("torch", "compute_dtype", ["bfloat16"])
    assert parse_pin("triton.fast_mode=true") == ("triton", "fast_mode", [True])
    for bad in ("triton=1", "num_splits=1", "triton.num_splits=", "triton.x"):
        with pytest.raises(ConfigError):
            parse_pin(bad)
