"""Spec validation, canonical form and hashing (no GPU, no torch)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specgen.spec import LayerSpec, SpecError, load_specs, parse_yaml, validate
from strategies import specs as random_specs

KB90 = {
    "name": "kb90",
    "input": {"channels": 8, "size": [16, 64, 64]},
    "conv": {"out_channels": 64, "kernel": 3},
    "epilogue": [
        {"leaky_relu": {"negative_slope": 0.2}},
        {"add": {"param": "sum_tensor"}},
        {"clamp": {"min": -1.0, "max": 1.0}},
        {"gelu": {"approximate": "none"}},
    ],
}


def problems(data) -> str:
    with pytest.raises(SpecError) as err:
        validate(data)
    return str(err.value)


def with_(path: str, value, base=KB90):
    import copy

    data = copy.deepcopy(base)
    node = data
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if isinstance(node, list) else node[k]
    last = keys[-1]
    if isinstance(node, list):
        node[int(last)] = value
    else:
        node[last] = value
    return data


def test_example_files_load():
    assert [s.name for s in load_specs("examples/kb90.yaml")] == ["kb90"]
    assert len(load_specs("examples/zoo.yaml")) >= 12


def test_spec_is_frozen_and_hashable():
    spec = validate(KB90)
    with pytest.raises(Exception):
        spec.name = "other"
    assert hash(spec.shape_hash) and len(spec.shape_hash) == 16


def test_equivalent_spellings_hash_equal():
    a = validate(KB90)
    spelled = with_("conv", {"kernel": [3, 3, 3], "out_channels": 64, "stride": [1, 1, 1], "padding": 0, "bias": True})
    spelled["epilogue"][3] = "gelu"
    spelled = {k: spelled[k] for k in reversed(list(spelled))}  # key order
    b = validate(spelled)
    assert a.canonical_json() == b.canonical_json()
    assert a.shape_hash == b.shape_hash


@pytest.mark.parametrize(
    "path,value",
    [
        ("input.size", [16, 64, 62]),
        ("conv.kernel", [3, 3, 1]),
        ("conv.stride", 2),
        ("conv.padding", 1),
        ("conv.bias", False),
        ("epilogue.0", {"leaky_relu": {"negative_slope": 0.21}}),
        ("epilogue.2", {"clamp": {"min": -1.0, "max": 0.5}}),
        ("epilogue.3", {"gelu": {"approximate": "tanh"}}),
        ("name", "kb90b"),
    ],
)
def test_any_change_that_changes_code_changes_the_hash(path, value):
    assert validate(with_(path, value)).shape_hash != validate(KB90).shape_hash


def test_shapes_and_params():
    spec = validate(KB90)
    assert spec.output_shape(128) == (128, 64, 14, 62, 62)
    assert spec.params() == {"sum_tensor": (64, 1, 1, 1)}
    kb65 = load_specs("examples/kb65.yaml")[0]
    assert kb65.output_shape(4) == (4,)


@pytest.mark.parametrize(
    "data,expected",
    [
        (with_("name", "9lives"), "name: String should match pattern"),
        (with_("input.channels", 0), "input.channels: Input should be greater than 0 (got 0)"),
        (with_("input.size", [0, 4, 4]), "input.size[0]: Input should be greater than 0"),
        (with_("input.size", [2, 2, 2, 2]), "input.size: List should have at most 3 items"),
        (with_("conv.kernel", 5, with_("input.size", [4, 4, 4])), "the kernel spans 5"),
        (with_("conv.groups", 3), "must both be divisible by groups (3)"),
        (with_("conv.stride", [1, 1]), "conv.stride: expected one value or 3"),
        (with_("conv.colour", "red"), "conv.colour: unknown field; expected one of out_channels, kernel, stride"),
        (with_("conv.paddng", 1), "conv.paddng: unknown field (did you mean padding?); expected one of out_channels"),
        (with_("input.chanels", 8), "input.chanels: unknown field (did you mean channels?); expected one of channels, size (got 8)"),
        (with_("precison", "tf32"), "precison: unknown field (did you mean precision?)"),
        (with_("tile", {"engin": "tma"}), "tile.engin: unknown field (did you mean engine?)"),
        (with_("epilogue.0", {"leaky_relu": {"slope": 0.1}}), "epilogue[0].leaky_relu.slope: unknown field; expected one of negative_slope"),
        (with_("epilogue.0", {"group_norm": {"num_groups": 2, "groups": 2}}), "group_norm.groups: unknown field (did you mean num_groups?)"),
        (with_("epilogue.0", {"relu": {"inplace": True}}), "epilogue[0].relu.inplace: unknown field: this op takes no arguments"),
        (with_("epilogue.0", "maxpool"), "epilogue[0]: unknown op 'maxpool' (did you mean max_pool?); a stage is one op"),
        (with_("epilogue.0", {"leaky_relu": {"negative_slope": float("nan")}}), "negative_slope: Input should be a finite number"),
        (with_("epilogue.0", {"leaky_relu": {"negative_slope": float("inf")}}), "finite number"),
        (with_("epilogue.2", {"clamp": {"min": -1e39}}), "outside float32's range"),
        (with_("epilogue.1", {"expr": "x * 1e39"}), "not a finite float32"),
        (with_("epilogue.0", "swish"), "epilogue[0]: unknown op 'swish' (write silu); a stage is one op"),
        (with_("epilogue.0", "ReLU6"), "epilogue[0]: unknown op 'ReLU6' (write hardtanh: {min_val: 0.0, max_val: 6.0})"),
        (with_("epilogue.0", "sigmod"), "epilogue[0]: unknown op 'sigmod' (did you mean sigmoid?)"),
        (with_("epilogue.0", "zzz"), "epilogue[0]: unknown op 'zzz'; a stage is one op"),
        (with_("epilogue.0", {"relu": {}, "tanh": {}}), "epilogue[0]: a stage is one op"),
        (with_("epilogue.1", {"add": {"value": 1.0, "param": "b"}}), "give exactly one of value"),
        (with_("epilogue.1", {"add": {"param": "x y"}}), "String should match pattern"),
        (with_("epilogue.1", {"add": {"param": "conv"}}), "parameter name 'conv' is reserved"),
        (with_("epilogue.1", {"expr": "x + __import__('os')"}), "unknown function"),
        (with_("epilogue.1", {"expr": "x.real"}), "outside the expression grammar"),
        (with_("epilogue.1", {"expr": "x ** 0.5"}), "whole-number exponent"),
        (with_("epilogue.1", {"expr": "1 + 2"}), "does not use x"),
        (with_("epilogue.1", {"expr": "x * (0 < x < 1)"}), "a comparison is one of > >= < <= between two expressions"),
        (with_("epilogue.1", {"expr": "x * (x == 0)"}), "(no chains, no ==)"),
        (with_("epilogue.1", {"expr": "where(x > 0, x)"}), "where takes 3 positional argument(s)"),
        (with_("epilogue.1", {"max": {"dims": [1]}}), "write amin/amax"),
        (with_("epilogue.1", {"sum": {"dims": [0]}}), "dim 0 is the batch"),
        (with_("epilogue.1", {"sum": {"dims": [5]}}), "dim 5 is out of range"),
        (with_("epilogue.1", {"avg_pool": {"kernel": 20}}), "the window spans 20"),
        (with_("epilogue.1", {"max_pool": {"kernel": 2, "padding": 2}}), "padding 2 must be at most half"),
        (with_("precision", "fp8"), "precision: Input should be 'fp32'"),
        (with_("tile", {"threads": 100}), "tile.threads: Input should be a multiple of 32"),
    ],
)
def test_bad_specs_say_where_what_and_why(data, expected):
    assert expected in problems(data)


def test_padding_same_and_valid_are_the_numbers_pytorch_pads():
    same = validate(with_("conv.padding", "same"))
    assert same.canonical()["conv"]["padding"] == [1, 1, 1] and same.shapes()[0].sizes[1:] == (16, 64, 64)
    assert same.canonical_json() == validate(with_("conv.padding", 1)).canonical_json()  # the same layer, the same kernel
    dilated = validate(with_("conv", {"out_channels": 8, "kernel": [3, 3, 5], "dilation": [1, 2, 2], "padding": "same"}))
    assert dilated.canonical()["conv"]["padding"] == [1, 2, 4]
    assert validate(with_("conv.padding", "valid")).canonical()["conv"]["padding"] == [0, 0, 0]
    assert "padding 'same' over an even kernel span" in problems(with_("conv", {"out_channels": 8, "kernel": 2, "padding": "same"}))
    assert "padding 'same' needs stride 1" in problems(with_("conv", {"out_channels": 8, "kernel": 3, "stride": 2, "padding": "same"}))
    assert "padding: a number, one per spatial dim, 'same' or 'valid' (got 'full')" in problems(with_("conv.padding", "full"))


def test_pool_after_reduction_and_param_after_channel_reduction():
    data = with_("epilogue", [{"sum": {"dims": [1]}}, {"avg_pool": 2}])
    assert "pooling after a reduction is not supported" in problems(data)
    data = with_("epilogue", [{"sum": {"dims": [1]}}, {"mul": {"param": "s"}}])
    assert "needs the channel dim" in problems(data)


def test_yaml_errors_name_line_and_keep_every_problem(tmp_path):
    with pytest.raises(SpecError, match=r"line 2, column 1: malformed YAML: found duplicate key 'name'"):
        parse_yaml("name: a\nname: b\n")
    with pytest.raises(SpecError, match="malformed YAML"):
        parse_yaml("name: [1, 2\n")
    with pytest.raises(SpecError, match="the file holds no spec"):
        parse_yaml("")
    with pytest.raises(SpecError, match="the file holds no spec"):
        parse_yaml("[]\n")
    two = "- {name: a, input: {channels: 0, size: [4]}, conv: {out_channels: 2, kernel: 1}}\n- {name: a}\n"
    text = str(pytest.raises(SpecError, parse_yaml, two).value)
    assert "input.channels" in text and "conv: Field required" in text
    with pytest.raises(SpecError, match="cannot read"):
        load_specs(tmp_path / "missing.yaml")


def test_constants_reach_the_kernel_exactly():
    from specgen.literals import c_float, to_float32

    for value in (0.2, -1.0, 1e-30, 0.044715, 1 / 3, 6.0, 3.4e38, -0.0):
        text = c_float(value)
        assert text.endswith("f") and to_float32(float(text[:-1])) == to_float32(value)
    with pytest.raises(ValueError):
        c_float(float("inf"))
    with pytest.raises(ValueError):
        c_float(1e39)  # overflows float32


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_specs())
def test_random_valid_specs_validate_and_round_trip(data):
    try:
        spec = validate(data)
    except SpecError as err:  # the strategy can draw an empty pooled output: a clean rejection
        assert "spans" in str(err)
        return
    again = validate(spec.canonical())
    assert again.shape_hash == spec.shape_hash
    assert all(n >= 1 for n in spec.output_shape(1))


def _nested(inner):
    """Lists and mappings of `inner` (the recursion of JUNK)."""
    return st.one_of(st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3))


JUNK = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 5) | st.floats(allow_nan=True) | st.text(max_size=6),
    _nested,
    max_leaves=12,
)


@settings(max_examples=300, deadline=None)
@given(
    st.fixed_dictionaries(
        {},
        optional={
            "name": JUNK | st.just("ok"),
            "input": JUNK | st.just({"channels": 2, "size": [4, 4]}),
            "conv": JUNK | st.just({"out_channels": 2, "kernel": 3}),
            "epilogue": st.lists(JUNK | st.sampled_from(["relu", {"sum": {"dims": [1]}}, {"avg_pool": 9}]), max_size=3),
            "precision": JUNK,
            "tile": JUNK,
        },
    )
)
def test_bad_input_is_rejected_with_a_message_never_a_crash(data):
    try:
        spec = validate(data)
    except SpecError as err:
        assert err.problems and all(isinstance(p, str) and p for p in err.problems)
        return
    assert isinstance(spec, LayerSpec) and not math.isnan(len(spec.shape_hash))


# ---- limits on work (each with its number in the message) --------------------------------------

def _layer(size, kernel, dilation=1, epilogue=(), channels=2):
    return {"name": "big", "input": {"channels": channels, "size": size},
            "conv": {"out_channels": 2, "kernel": kernel, "dilation": dilation}, "epilogue": list(epilogue)}


@pytest.mark.parametrize(
    "data,expected",
    [
        (_layer([4096], 1001), "1001 taps, more than specgen's limit of 343"),
        (_layer([256, 256], 101), "10201 taps, more than specgen's limit of 343"),
        (_layer([65536], 2, dilation=1024), "spans 1025 input values (dilation 1024 x (kernel 2 - 1) + 1), more than specgen's limit of 1024"),
        (_layer([1 << 20], 1024, dilation=1024), "taps, more than specgen's limit"),
        (_layer([16], 1, epilogue=["relu"] * 65), "epilogue: List should have at most 64 items"),
        (_layer([1 << 16], 1, epilogue=[{"max_pool": {"kernel": 2, "stride": 1}}] * 50),
         "epilogue[12] (max_pool): the pools up to here read 8192 values below each output"),
        (_layer([64, 64], 3, epilogue=[{"avg_pool": {"kernel": 8, "stride": 1}}, {"max_pool": 9}]), "5184 values below each output"),
    ],
)
def test_work_limits_refuse_with_the_numbers(data, expected):
    assert expected in problems(data)


def test_work_limits_leave_common_layers_alone():
    validate(_layer([16, 16, 16], 7))  # 343 taps: the largest common 3-D kernel
    validate(_layer([64, 64], [1, 31]))  # 31 taps along one dim
    validate(_layer([4096], 2, dilation=512))  # WaveNet-style
    validate(_layer([16], 1, epilogue=["relu"] * 64))
    validate(_layer([64, 64], 3, epilogue=[{"avg_pool": {"kernel": 8, "stride": 1}}, {"max_pool": 8}]))  # 64 x 64 = 4096 values


def test_validation_and_canonical_form_are_linear_in_the_epilogue():
    import time

    def seconds(n):
        stages = [{"sum": {"dims": [2], "keepdim": True}}] * n  # every stage a reduction: the slow case
        start = time.perf_counter()
        validate(_layer([64], 1, epilogue=stages)).canonical_json()
        return time.perf_counter() - start

    seconds(8)  # warm up
    small, large = min(seconds(8) for _ in range(3)), min(seconds(64) for _ in range(3))
    assert large < 0.5 and large < 8 * 4 * small, (small, large)  # 8x the stages: well under 64x the time


# ---- hostile YAML: bounded work, bounded messages ------------------------------------------------

def _alias_bomb(levels=9, fanout=9) -> str:
    lines = ["a0: &a0 [" + ", ".join(["x"] * fanout) + "]"]
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * fanout) + "]" for i in range(1, levels)]
    return "\n".join(lines + [f"name: *a{levels - 1}", "input: *a1"]) + "\n"


def test_an_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    import time

    text = _alias_bomb()
    assert len(text) < 600
    start = time.perf_counter()
    err = pytest.raises(SpecError, parse_yaml, text).value
    assert time.perf_counter() - start < 1.0
    assert "expands to more than 50000 values" in str(err) and len(str(err)) < 1000


def test_a_small_alias_expansion_quotes_at_most_200_characters_of_input():
    text = _alias_bomb(levels=3, fanout=9).replace("x", "abcdefghij")  # 729 names: under the node cap
    err = str(pytest.raises(SpecError, parse_yaml, text).value)
    assert "name: Input should be a valid string (got [[[" in err
    quoted = err.split("(got ", 1)[1].split(")\n", 1)[0]
    assert len(quoted) <= 200 and quoted.endswith("...")
    assert len(err) < 2000


def test_yaml_recursion_depth_size_and_odd_keys_are_refused(tmp_path):
    assert "an alias refers to a value that contains it" in str(pytest.raises(SpecError, parse_yaml, "&a [*a]\n").value)
    assert "nested more than 32 deep" in str(pytest.raises(SpecError, parse_yaml, "[" * 40 + "]" * 40).value)
    deep = str(pytest.raises(SpecError, parse_yaml, "[" * 5000).value)  # libyaml stops it first, where present
    assert "nested more than 32 deep" in deep or "exceeded maximum nesting depth" in deep
    assert "found a key that is a list or mapping" in str(pytest.raises(SpecError, parse_yaml, "? [a]\n: 1\n").value)
    big = tmp_path / "big.yaml"
    big.write_text("# " + "x" * (1 << 20) + "\nname: a\n")
    assert "larger than 1048576 bytes" in str(pytest.raises(SpecError, load_specs, big).value)


def test_many_problems_are_counted_not_all_listed():
    err = str(pytest.raises(SpecError, validate, _layer([16], 1, epilogue=[{"relu": {"bad": i}} for i in range(60)])).value)
    assert "... and 40 more" in err and err.count("\n  - ") == 20


def test_a_huge_name_or_expression_is_quoted_short():
    err = str(pytest.raises(SpecError, validate, {**KB90, "name": "n" * 100_000}).value)
    assert len(err) < 1000 and "nnn..." in err
    err = str(pytest.raises(SpecError, validate, with_("epilogue.1", {"expr": "x + " + "y" * 500})).value)
    assert "parameter name 'yyy" in err and len(err) < 1000


def test_a_non_utf8_file_names_the_file_and_the_byte(tmp_path):
    path = tmp_path / "latin1.yaml"
    path.write_bytes("name: caf\u00e9\n".encode("latin-1"))
    err = str(pytest.raises(SpecError, load_specs, path).value)
    assert str(path) in err and "not UTF-8 text: byte 9 is b'\\xe9'" in err


# ---- constants at the edge of float32 ------------------------------------------------------------

@pytest.mark.parametrize("value", [3.4028234e38, -3.4028234663852886e38])
def test_float32_max_is_printed_exactly_not_an_overflow(value):
    from specgen.literals import FLOAT32_MAX, c_float, to_float32

    text = c_float(value)
    assert float(text[:-1]) == pytest.approx(FLOAT32_MAX * math.copysign(1, value), rel=1e-9)
    assert abs(float(text[:-1])) <= FLOAT32_MAX and to_float32(float(text[:-1])) == to_float32(value)
    spec = validate(with_("epilogue.0", {"leaky_relu": {"negative_slope": value}}))
    from specgen.render import render

    assert f"= {text};" in render(spec)


def test_past_float32_max_is_refused_clearly():
    for value in (3.4028235e38, 3.5e38):  # the first rounds to float32's max, but is past it: refused too
        assert "outside float32's range" in problems(with_("epilogue.0", {"leaky_relu": {"negative_slope": value}}))
    assert "is not a finite float32" in problems(with_("epilogue.1", {"expr": "x * 1" + "0" * 400}))
