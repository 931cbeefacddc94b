"""Probe batches: ragged lengths that cut every tile size, derived from the tuned shape."""

from mla_tune.problem.probes import probe_lengths, probe_shapes
from mla_tune.problem.shapes import KVFormat, Shape


def test_probe_lengths_cut_every_tile_size_within_the_shapes_longest():
    lens = probe_lengths(8192, 1, 4)
    assert lens == (8155, 129, 20)
    assert all(n % t for n in lens for t in (16, 32, 64, 128))
    assert sum(lens) % 16 == 0  # integer arguments keep the shape's divisibility
    assert probe_lengths(100, 1, 2) == (63, 100, 13)
    assert probe_lengths(8, 4, 2) == (4, 8, 8)  # clipped to the longest and to q_len


def test_a_batch_that_is_a_multiple_of_16_gets_16_probe_sequences():
    lens = probe_lengths(1024, 4, 32)
    assert len(lens) == 16 and set(lens[:-1]) == {987, 129, 13} and sum(lens) % 16 == 0
    assert 13 <= lens[-1] <= 28


def test_a_probe_keeps_everything_but_the_lengths():
    shape = Shape.uniform(4, 8192, q_len=4, heads=32, kv_format=KVFormat.MXFP4, page_size=64)
    (probe,) = probe_shapes(shape)
    assert probe.kv_lens == (8155, 129, 20) and probe.batch == 3
    assert (probe.q_len, probe.heads, probe.kv_format, probe.page_size) == (4, 32,
                                                                            KVFormat.MXFP4, 64)


def test_a_q_len_1_shape_is_also_probed_at_q_len_4():
    probes = probe_shapes(Shape.uniform(2, 128))
    assert [(p.q_len, p.kv_lens) for p in probes] == [(1, (91, 128, 21)), (4, (91, 128, 21))]


def test_no_probe_when_it_would_be_the_shape_itself():
    assert probe_shapes(Shape(3, (1, 1, 1))) == ()
