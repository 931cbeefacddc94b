"""The H200 results shipped with mla-tune: package data, found from any directory, only read
through the `shipped` alias."""

import hashlib
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy import make_url
from typer.testing import CliRunner

import mla_tune
from mla_tune.cli.main import app
from mla_tune.db import DBError, TuningStore, resolve_url, shipped_db_url

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
