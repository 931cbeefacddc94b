import pytest
import torch

from mla_tune.problem.shapes import KVFormat, Shape, ShapeError, generate_input, parse_shape


@pytest.mark.parametrize("text", ["256x", "0x8192", "-4x1024", "4x1024x9", "x", "", "4 by 8"])
def test_parse_shape_rejects_bad_notation(text):
    with pytest.raises(ShapeError):
        parse_shape(text)


def test_parse_shape_and_key_are_stable():
    s = parse_shape("256x8192", kv_format="fp8", heads=32, q_len=4)
    assert (s.batch, s.kv_len, s.heads, s.q_len, s.kv_format) == (256, 8192, 32, 4, KVFormat.FP8)
    assert s.key == "b256-q4-kv8192-h32-fp8-p1"
    assert parse_shape(" 256X8192 ", kv_format="fp8", heads=32, q_len=4).key == s.key


def test_labels_tell_page_sizes_apart():
    assert parse_shape("256x8192", kv_format="fp8").label() == "256x8192 fp8 h16 q1"
    paged = Shape(2, (100, 300), kv_format=KVFormat.FP8, page_size=64)
    assert paged.label() == "2x~200r fp8 h16 q1 p64"
    assert paged.label() != Shape(2, (100, 300), kv_format=KVFormat.FP8).label()


def test_ragged_key_depends_on_lengths_and_round_trips():
    a = Shape(3, (5, 9, 7))
    b = Shape(3, (5, 9, 8))
    assert a.is_ragged and a.key != b.key
    assert Shape.from_json(a.to_json()) == a
    assert Shape.from_json(parse_shape("4x64").to_json()).key == "b4-q1-kv64-h16-bf16-p1"


@pytest.mark.parametrize("kw", [dict(q_len=5), dict(q_len=0), dict(heads=0), dict(page_size=3)])
def test_shape_validation(kw):
    with pytest.raises(ShapeError):
        Shape.uniform(2, 64, **kw)


def test_kv_shorter_than_q_len_is_refused():
    with pytest.raises(ShapeError):
        Shape(2, (8, 2), q_len=4)


def test_kv_format_parse_error_names_choices():
    with pytest.raises(ValueError, match="bf16, fp8, mxfp4"):
        KVFormat.parse("int4")


def test_generate_input_matches_task_layout():
    shape = Shape(2, (5, 11), q_len=2, heads=16)
    q, kv_data, qo, kvp, cfg = generate_input(shape, seed=1)
    assert q.shape == (4, 16, 576) and q.dtype == torch.bfloat16
    assert kv_data["bf16"].shape == (16, 1, 576)
    fp8, scale = kv_data["fp8"]
    assert fp8.shape == (16, 1, 576) and scale.shape == (1,) and scale.dtype == torch.float32
    fp4, sc = kv_data["mxfp4"]
    assert fp4.shape == (16, 1, 288) and sc.shape == (256, 24)
    assert qo.tolist() == [0, 2, 4] and kvp.tolist() == [0, 5, 16]
    assert qo.dtype == kvp.dtype == torch.int32
    assert cfg["batch_size"] == 2 and cfg["q_seq_len"] == 2 and cfg["kv_seq_len"] == 11
    q2 = generate_input(shape, seed=1)[0]
    assert torch.equal(q, q2)
    assert not torch.equal(q, generate_input(shape, seed=2)[0])
