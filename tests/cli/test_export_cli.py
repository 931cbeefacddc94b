"""`mla-tune export` / `mla-tune import`: the winners table travels between DBs unchanged."""

import json

import pytest
from typer.testing import CliRunner

from mla_tune.cli.main import app
from mla_tune.db import TuningStore
from tests.fixtures.sweep_db import SHAPES, swept_db

runner = CliRunner()


@pytest.fixture(scope="module")
def db(tmp_path_factory):
    return swept_db(tmp_path_factory.mktemp("export") / "t.db").url.removeprefix("sqlite:///")


def _ok(args):
    r = runner.invoke(app, args)
    assert r.exit_code == 0, r.output
    return r


def test_export_import_export_is_identical(db, tmp_path):
    first, second, other = tmp_path / "w1.json", tmp_path / "w2.json", tmp_path / "other.db"
    _ok(["export", "--db", db, "--out", str(first)])
    doc = json.loads(first.read_text())
    assert (doc["format"], doc["version"]) == ("mla-tune-winners", 2)
    assert sorted(w["shape_key"] for w in doc["winners"]) == sorted(s.key for s in SHAPES)
    (device,) = TuningStore(db).devices()
    for w in doc["winners"]:
        assert w["device"] == device.fingerprint.to_json()
        assert {"python", "torch"} <= set(w["software"])
    r = _ok(["import", str(first), "--db", str(other)])
    assert "2 now win their shape" in r.output
    _ok(["export", "--db", str(other), "--out", str(second)])
    # Everything comes back but where a config was verified ok at other shapes: an import
    # stores timed trials (and wrong facts), and those checks carry no time. So a winner's
    # config comes back verified at the shapes whose winner it is (its own, and another's
    # when timing made the same config win both).
    for w in doc["winners"]:
        wins = [v["shape"] for v in doc["winners"]
                if (v["backend"], v["config"]) == (w["backend"], w["config"])]
        w["verified_ok"] = [s for s in w["verified_ok"] if s in wins]
    assert json.loads(second.read_text()) == doc
    assert all(w["shape"] in w["verified_ok"] for w in doc["winners"])
    imported = {w.shape_key: (w.backend, w.config, w.median_us)
                for w in TuningStore(str(other)).winners()}
    assert imported == {w.shape_key: (w.backend, w.config, w.median_us)
                        for w in TuningStore(db).winners()}
    # An imported winner carries its median only: the report still works, without a CI.
    rows = json.loads(_ok(["report", "--db", str(other), "--format", "json"]).stdout)
    assert {r["ci95_us"] for r in rows} == {None} and len(rows) == len(SHAPES)


def test_export_one_device_by_hash_prefix(db, tmp_path):
    (device,) = TuningStore(db).devices()
    out = tmp_path / "one.json"
    _ok(["export", "--db", db, "--out", str(out), "--device", device.hash[:6]])
    assert len(json.loads(out.read_text())["winners"]) == len(SHAPES)
    r = runner.invoke(app, ["export", "--db", db, "--out", str(out), "--device", "ffff"])
    assert r.exit_code == 2 and "no device with hash 'ffff'" in r.output


def test_bad_input_is_refused_before_any_db_is_touched(db, tmp_path):
    target = tmp_path / "never.db"
    bad = tmp_path / "bad.json"
    bad.write_text('{"format": "mla-tune-winners", "version": 99, "winners": []}')
    for path in (bad, tmp_path / "missing.json"):
        r = runner.invoke(app, ["import", str(path), "--db", str(target)])
        assert r.exit_code == 2 and "cannot import" in r.output
    assert not target.exists()
    r = runner.invoke(app, ["export", "--db", db, "--out", str(tmp_path)])
    assert r.exit_code == 2 and "file path" in r.output
