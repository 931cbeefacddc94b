"""`mla-tune rehash`: results stored under the old (bytes) hash of this checkout's kernel
sources get the code hash and count as current again; prune refuses to run before that, so
it cannot delete them."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from typer.testing import CliRunner

from mla_tune.backends import get_backend, register
from mla_tune.cli.main import app
from mla_tune.db import SourceRow, TrialGroup, TrialResult, TuningStore
from mla_tune.results.rehash import plan
from mla_tune.results.selection import update_winner
from tests.db.conftest import GPU, SHAPE, SHAPE_KEY, STACK
from tests.fixtures.toy_backends import ToyBackend

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
            store.record_trial(TrialGroup(dev, sw, SHAPE_KEY, "triton", old),
                               TrialResult(SHAPE, "bf16", {"i": i}, "ok",
                                           stats={"median_us": 5.0 + i}))
        update_winner(store, dev, sw, SHAPE_KEY, {"triton": old})
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
    from mla_tune.cli import main as cli

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


class GitToyBackend(ToyBackend):
    """The toy family with its source in a git checkout of the test's own."""

    name = "gittoy"
    source = Path()

    def source_files(self) -> list[Path]:
        return [self.source]


def _git(cwd: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=cwd,
                   check=True, capture_output=True)


def test_from_git_renames_results_of_the_same_files_at_an_earlier_revision(
        tmp_path, monkeypatch) -> None:
    import mla_tune.backends as backends

    # Registered for this test only: other tests list every registered family.
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "_instances", dict(backends._instances))
    repo = tmp_path / "repo"
    repo.mkdir()
    src = repo / "kernel.py"
    src.write_text("def f():\n    return 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", "kernel.py")
    _git(repo, "commit", "-qm", "kernel")
    register("gittoy", "tests.results.test_rehash:GitToyBackend")
    monkeypatch.setattr(GitToyBackend, "source", src)
    backend = get_backend("gittoy")
    old = backend.source_hash()
    path = tmp_path / "t.db"
    with TuningStore(str(path)) as store:
        dev, sw = store.device_id(GPU), store.software_id(STACK)
        store.record_trial(TrialGroup(dev, sw, SHAPE_KEY, "gittoy", old),
                           TrialResult(SHAPE, "bf16", {"i": 0}, "ok", stats={"median_us": 5.0}))
        update_winner(store, dev, sw, SHAPE_KEY, {"gittoy": old})
    src.write_text("import os\n\n\ndef f():\n    return 1\n")  # a refactor: new code hash
    new = backend.source_hash()
    assert new != old

    bad = runner.invoke(app, ["rehash", "--db", str(path), "--from-git", "no-such-rev"])
    assert bad.exit_code == 2 and "cannot read revision 'no-such-rev'" in bad.output
    done = runner.invoke(app, ["rehash", "--db", str(path), "--from-git", "HEAD", "--yes"])
    assert done.exit_code == 0, done.output
    assert "renamed 1 trials, 1 winners" in done.output
    with TuningStore(str(path), read_only=True) as ro:
        assert [w.source_hash for w in ro.winners()] == [new]
    again = runner.invoke(app, ["rehash", "--db", str(path), "--from-git", "HEAD"])
    assert again.exit_code == 0 and "nothing to rehash" in again.output


def test_source_hashes_do_not_depend_on_where_the_files_lie(tmp_path) -> None:
    from mla_tune.backends.source_hash import hash_sources

    a, b = tmp_path / "a" / "z", tmp_path / "b"
    a.mkdir(parents=True)
    b.mkdir()
    (a / "k.py").write_text("x = 1\n")
    (b / "glue.py").write_text("y = 2\n")
    (tmp_path / "k.py").write_text("x = 1\n")
    (tmp_path / "zz").mkdir()
    (tmp_path / "zz" / "glue.py").write_text("y = 2\n")
    assert hash_sources([a / "k.py", b / "glue.py"]) == \
        hash_sources([tmp_path / "zz" / "glue.py", tmp_path / "k.py"])


def test_source_renames_a_named_stored_hash_and_refuses_bad_names(tmp_path) -> None:
    path = tmp_path / "t.db"
    old, new = _db(path)
    bad = runner.invoke(app, ["rehash", "--db", str(path), "--source", "nope=123"])
    assert bad.exit_code == 2 and "expected BACKEND=HASH" in bad.output
    both = runner.invoke(app, ["rehash", "--db", str(path), "--source", f"triton={old}",
                               "--from-git", "HEAD"])
    assert both.exit_code == 2 and "not both" in both.output
    miss = runner.invoke(app, ["rehash", "--db", str(path), "--source", "triton=0000"])
    assert miss.exit_code == 0 and "nothing to rehash" in miss.output
    done = runner.invoke(app, ["rehash", "--db", str(path), "--source", f"triton={old}",
                               "--yes"])
    assert done.exit_code == 0 and "renamed 2 trials, 1 winners" in done.output
    with TuningStore(str(path), read_only=True) as ro:
        assert [w.source_hash for w in ro.winners()] == [new]


def test_off_source_winners_are_those_under_neither_name_of_the_checkouts_code() -> None:
    from mla_tune.problem.shapes import Shape
    from mla_tune.results.rehash import OffSource, off_source_winners
    from mla_tune.results.winner import Winner

    shape = Shape.uniform(4, 1024)

    def won(backend: str, source: str) -> Winner:
        return Winner(GPU, STACK, shape, backend, source, {}, 1.0)

    hashes = {"triton": ("bytes-t", "code-t"), "torch": ("t", "t")}
    winners = [won("triton", "code-t"), won("triton", "bytes-t"), won("triton", "older"),
               won("triton", "older"), won("torch", "gone"), won("aiter", "unloadable")]
    # Both names of the checkout's code are usable; a backend not loadable here is not judged.
    assert off_source_winners(winners, hashes) == [
        OffSource("torch", "gone", "t", 1), OffSource("triton", "older", "code-t", 2)]


def test_doctor_names_winners_of_other_kernel_code_and_the_rehash_that_keys_them(
        tmp_path) -> None:
    path = tmp_path / "t.db"
    with TuningStore(str(path)) as store:
        dev, sw = store.device_id(GPU), store.software_id(STACK)
        store.record_trial(TrialGroup(dev, sw, SHAPE_KEY, "triton", "0123456789abcdef"),
                           TrialResult(SHAPE, "bf16", {"i": 0}, "ok",
                                       stats={"median_us": 5.0}))
        update_winner(store, dev, sw, SHAPE_KEY, {"triton": "0123456789abcdef"})
    r = runner.invoke(app, ["doctor", "--device", "cpu", "--db", str(path)])
    assert r.exit_code == 0, r.output
    text = " ".join(r.output.split())  # whatever width the console wrapped it at
    assert "1 stored triton winners are of other kernel code (source 0123456789abcdef;" in text
    assert "rehash --source triton=0123456789abcdef --yes" in text
    r = runner.invoke(app, ["rehash", "--db", str(path), "--source",
                            "triton=0123456789abcdef", "--yes"])
    assert r.exit_code == 0, r.output
    r = runner.invoke(app, ["doctor", "--device", "cpu", "--db", str(path)])
    assert r.exit_code == 0 and "other kernel code" not in r.output, r.output
