"""The H200 results shipped with mla-tune: package data, found from any directory, only read
through the `shipped` alias."""

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import make_url
from typer.testing import CliRunner

import mla_tune
from mla_tune.backends import source_hash_pairs
from mla_tune.cli.main import app
from mla_tune.db import DBError, TuningStore, resolve_url, shipped_db_url
from mla_tune.results.rehash import off_source_winners
from mla_tune.results.winner import Winner
from mla_tune.results.winners_file import load_winners_json

SHIPPED = Path(mla_tune.__file__).resolve().parent / "shipped" / "tuning.db"


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_shipped_db_is_the_package_file_wherever_we_run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    assert make_url(shipped_db_url()).database == str(SHIPPED)
    assert resolve_url("shipped").database == str(SHIPPED)
    monkeypatch.setenv("MLA_TUNE_DB", "shipped")
    assert resolve_url().database == str(SHIPPED)
    # A file named "shipped" in the working directory is reached as ./shipped.
    assert resolve_url("./shipped").database == "shipped"


def test_shipped_db_holds_h200_winners_and_is_read_without_a_trace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _digest(SHIPPED)
    listing = sorted(p.name for p in SHIPPED.parent.iterdir())
    with TuningStore("shipped", read_only=True) as store:
        winners = store.winners()
    assert winners and {w.device.name for w in winners} == {"NVIDIA H200"}
    assert _digest(SHIPPED) == before
    assert sorted(p.name for p in SHIPPED.parent.iterdir()) == listing
    assert list(tmp_path.iterdir()) == []


def test_writes_through_the_alias_are_refused_before_touching_the_file(monkeypatch):
    before = _digest(SHIPPED)
    with pytest.raises(DBError, match=f"give the file's path: --db {SHIPPED}"):
        TuningStore("shipped")
    monkeypatch.setenv("MLA_TUNE_DB", "shipped")
    with pytest.raises(DBError, match="only read"):
        TuningStore()
    assert _digest(SHIPPED) == before


def test_sweep_into_the_shipped_alias_exits_2_and_report_reads_it(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    before = _digest(SHIPPED)
    runner = CliRunner()
    r = runner.invoke(app, ["sweep", "--db", "shipped", "--shape", "2x32", "-f", "bf16",
                            "--backend", "torch", "--device", "cpu"])
    assert r.exit_code == 2 and "only read" in r.output, r.output
    rep = runner.invoke(app, ["report", "--db", "shipped", "--format", "json"])
    assert rep.exit_code == 0, rep.output
    assert '"NVIDIA H200"' in rep.stdout
    assert _digest(SHIPPED) == before and list(tmp_path.iterdir()) == []


def test_an_installed_copy_finds_its_own_shipped_db(tmp_path):
    """Run from another directory with the package found by path only: the URL comes from
    the package, not from the working directory or the checkout."""
    code = ("from mla_tune.db import shipped_db_url, TuningStore; "
            "s = TuningStore(shipped_db_url(), read_only=True); print(len(s.winners()))")
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True,
                       text=True, timeout=120,
                       env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(SHIPPED.parents[2])})
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) > 0


def _key(w: Winner) -> tuple[str, str, str, str, str]:
    return (w.shape.key, w.software.hash, w.backend, w.source_hash,
            json.dumps(w.config, sort_keys=True))


def test_shipped_winners_are_keyed_to_the_current_kernel_sources():
    """The dispatcher ignores a winner whose family's code changed since it was tuned, so a
    kernel edit that keeps every stored variant's code must re-key the shipped results
    (`mla-tune rehash`), and one that changes it must re-sweep or prune them: otherwise H200
    users silently lose those tuned routes."""
    hashes = source_hash_pairs()
    assert {"triton", "torch", "cuda_mma"} <= hashes.keys()
    with TuningStore("shipped", read_only=True) as store:
        stale = off_source_winners(store.winners(), hashes)
    assert not stale, (f"shipped winners under retired sources {stale}; "
                       "re-key (mla-tune rehash) or re-sweep them")


def test_shipped_winners_file_is_the_shipped_db_exported():
    """`submission.custom_kernel` routes by winners.json, the dispatcher by the DB: both must
    hold the same winners (`mla-tune export --db shipped --out mla_tune/shipped/winners.json`)."""
    with TuningStore("shipped", read_only=True) as store:
        in_db = {_key(w) for w in store.winners()}
    in_file = {_key(w) for w in load_winners_json(SHIPPED.with_name("winners.json"))}
    assert in_db and in_file == in_db, (
        f"{len(in_file - in_db)} winners only in winners.json, {len(in_db - in_file)} only in "
        "the DB: export the shipped DB to mla_tune/shipped/winners.json")
