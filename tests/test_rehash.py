"""`mla-tune rehash`: results stored under the old (bytes) hash of this checkout's kernel
sources get the code hash and count as current again; prune refuses to run before that, so
it cannot delete them."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from mla_tune.backends import get_backend
from mla_tune.cli import app
from mla_tune.db import SourceRow, TuningStore
from mla_tune.rehash import plan
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK

runner = CliRunner()


def test_plan_renames_only_a_backends_checkout_code_under_its_bytes_hash() -> None:
    rows = [SourceRow("triton", "bytes-t", 4, 9, 1), SourceRow("triton", "older", 2, 3, 0),
            SourceRow("torch", "same", 1, 5, 0), SourceRow("aiter", "bytes-a", 1, 6, 0)]
    hashes = {"triton": ("bytes-t", "code-t"), "torch": ("same", "same")}
    # torch's files hash alike both ways (nothing to do); aiter is not loadable here.
    assert [(r.backend, r.old, r.new, r.trials) for r in plan(rows, hashes)] == [
        ("triton", "bytes-t", "code-t", 4)]


def _db(path) -> tuple[str, str]:
    """Two triton trials and their winner stored under the bytes hash of the checkout's
    triton sources, as a sweep before the code hash stored them."""
    triton = get_backend("triton")
    old, new = triton.source_bytes_hash(), triton.source_hash()
    with TuningStore(str(path)) as store:
        dev, sw = store.device_id(GPU), store.software_id(STACK)
        for i in range(2):
            store.record_trial(device_id=dev, software_id=sw, shape_key=SHAPE_KEY,
                               shape_json=SHAPE, kv_format="bf16", backend="triton",
                               source_hash=old, config={"i": i}, status="ok",
                               stats={"median_us": 5.0 + i})
        store.update_winner(dev, sw, SHAPE_KEY, {"triton": old})
    return old, new


def _current_winners(path) -> list:
    r = runner.invoke(app, ["report", "--db", str(path), "--format", "json"])
    assert r.exit_code == 0, r.output
    return [(row["shape_key"], row["median_us"]) for row in json.loads(r.output)
            if not row.get("superseded")]


def test_cli_renames_stored_results_and_prune_waits_for_it(tmp_path) -> None:
    path = tmp_path / "t.db"
    old, new = _db(path)
    assert old != new

    refused = runner.invoke(app, ["prune", "--db", str(path), "--yes"])
    assert refused.exit_code != 0 and "mla-tune rehash" in refused.output
    doctor = runner.invoke(app, ["doctor", "--db", str(path), "--device", "cpu"])
    assert "2 stored trials are of this checkout's kernel code" in doctor.output

    dry = runner.invoke(app, ["rehash", "--db", str(path)])
    assert dry.exit_code == 0 and "nothing renamed" in dry.output
    with TuningStore(str(path), read_only=True) as ro:
        assert {t.source_hash for t in ro.trials()} == {old}

    done = runner.invoke(app, ["rehash", "--db", str(path), "--yes"])
    assert done.exit_code == 0, done.output
    assert "renamed 2 trials, 1 winners" in done.output
    with TuningStore(str(path), read_only=True) as ro:
        assert {t.source_hash for t in ro.trials()} == {new}
        assert [w.source_hash for w in ro.winners()] == [new]
    assert _current_winners(path) == [(SHAPE_KEY, 5.0)]  # the report still has the winner

    again = runner.invoke(app, ["rehash", "--db", str(path), "--yes"])
    assert again.exit_code == 0 and "nothing to rehash" in again.output
    assert runner.invoke(app, ["prune", "--db", str(path), "--yes"]).exit_code == 0
    doctor = runner.invoke(app, ["doctor", "--db", str(path), "--device", "cpu"])
    assert "rehash" not in doctor.output


def test_cli_refuses_a_missing_db_and_creates_nothing(tmp_path) -> None:
    path = tmp_path / "absent.db"
    r = runner.invoke(app, ["rehash", "--db", str(path), "--yes"])
    assert r.exit_code != 0 and "no tuning DB" in r.output
    assert not path.exists()


def test_messages_stay_whole_at_any_width_and_path_length(tmp_path, monkeypatch) -> None:
    from mla_tune import cli

    deep = tmp_path.joinpath(*["a-long-directory-name"] * 8)
    deep.mkdir(parents=True)
    path = deep / "t.db"
    _db(path)
    for console in (cli.console, cli.out):
        monkeypatch.setattr(console, "_width", 30)
    refused = runner.invoke(app, ["prune", "--db", str(path), "--yes"])
    assert refused.exit_code != 0
    assert "run `mla-tune rehash --yes` first" in refused.output
    assert str(path) in refused.output
