"""Tuning a serving bucket on a representative ragged batch: the seeded length
distribution, the CLI and suite forms, and the dispatcher routing other calls of the bucket
to the stored winner (CPU: the torch family)."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import (
    RaggedLengths,
    Shape,
    ShapeError,
    generate_input,
    parse_ragged_shape,
)
from mla_tune.problem.suites import UnknownSuiteError, suite_shapes
from mla_tune.runtime.buckets import bucket_of, router_for
from mla_tune.runtime.dispatcher import Dispatcher


def test_the_same_distribution_and_seed_draw_the_same_lengths() -> None:
    d = RaggedLengths.parse(" uniform: 300 - 8000 ")
    a, b = d.draw(128), RaggedLengths.parse("uniform:300-8000").draw(128)
    assert a == b and len(a) == 128 and min(a) >= 300 and max(a) <= 8000
    assert len(set(a)) > 100  # really spread, not one length
    assert RaggedLengths.parse("uniform:300-8000", seed=1).draw(128) != a
    assert max(d.draw(64, cap=1000)) <= 1000


@pytest.mark.parametrize("text", ["normal:3", "uniform:0-10", "uniform:10-5", "uniform:5"])
def test_bad_distributions_say_what_is_expected(text: str) -> None:
    with pytest.raises(ShapeError, match="uniform:LOW-HIGH|LOW <= HIGH"):
        RaggedLengths.parse(text)


def test_a_ragged_shape_from_batch_or_batch_by_cap() -> None:
    dist = RaggedLengths.parse("uniform:20-90")
    s = parse_ragged_shape("6", dist, kv_format="fp8", page_size=16)
    assert s.is_ragged and s.batch == 6 and s.page_size == 16 and s.kv_lens == dist.draw(6)
    capped = parse_ragged_shape("6x40", dist)
    assert max(capped.kv_lens) <= 40
    with pytest.raises(ShapeError, match="below the distribution's lowest"):
        parse_ragged_shape("6x10", dist)


def test_the_serving_suite_holds_ragged_paged_buckets() -> None:
    shapes = suite_shapes("serving")
    assert shapes and all(s.is_ragged for s in shapes)
    assert {s.page_size for s in shapes} == {1, 64} and {s.batch for s in shapes} == {32, 128}
    assert all(300 <= min(s.kv_lens) and max(s.kv_lens) <= 8000 for s in shapes)


def test_a_bad_suite_entry_names_the_suite(monkeypatch) -> None:
    import mla_tune.problem.suites as suites

    monkeypatch.setattr(suites, "_suites", lambda: {"x": {"shapes": [
        {"batch": 4, "ragged": "uniform:9-3"}]}})
    with pytest.raises(UnknownSuiteError, match="suite 'x': bad entry"):
        suites.suite_shapes("x")


def test_cli_refuses_a_bad_ragged_request_with_exit_2(tmp_path) -> None:
    db = tmp_path / "t.db"
    r = CliRunner().invoke(app, ["sweep", "--shape", "4", "--ragged", "gauss:1", "--db", str(db)])
    assert r.exit_code == 2 and "uniform:LOW-HIGH" in r.output
    r = CliRunner().invoke(app, ["sweep", "--ragged", "uniform:1-9", "--db", str(db)])
    assert r.exit_code == 2 and "--ragged needs --shape" in r.output
    assert not db.exists()


def test_a_swept_bucket_winner_routes_other_calls_of_its_bucket(tmp_path) -> None:
    db = tmp_path / "t.db"
    r = CliRunner().invoke(app, [
        "sweep", "--shape", "3", "--ragged", "uniform:140-250", "-f", "bf16", "-b", "torch",
        "--db", str(db), "--device", "cpu", "--no-baseline", "--runoff", "0",
        "--time-budget", "0.02"])
    assert r.exit_code == 0, r.output
    tuned = parse_ragged_shape("3", RaggedLengths.parse("uniform:140-250"))
    d = Dispatcher.from_db(str(db), device="cpu", kv_format="bf16")
    assert d._table[tuned.key].winner.shape == tuned
    other = Shape(3, (150, 170, 240))  # same bucket (mean in (128, 256]), other lengths
    assert other != tuned and bucket_of(other) == bucket_of(tuned)
    first = router_for(d).decisions(bucket_of(other), paged=False)[0]
    assert first.reason == "exact" and first.tuned_shape == tuned
    data = generate_input(other, seed=3)
    ref = mla_decode_reference(*data, kv_format="bf16")
    assert float((d.run(data).float() - ref).abs().max()) < 2e-2
