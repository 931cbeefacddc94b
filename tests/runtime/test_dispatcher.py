"""The dispatcher on CPU, against tuning DBs built by the real sweep (torch family)."""

import json
import logging
import math
import sqlite3
import threading
from contextlib import closing
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import mla_tune.backends as backends
import mla_tune.db as mla_db
import mla_tune.runtime.dispatcher as dispatch
import mla_tune.runtime.routing as routing
from mla_tune.backends import get_backend, register
from mla_tune.backends.base import Availability, Backend
from mla_tune.backends.torch_family import TorchFamily
from mla_tune.backends.triton_family import TritonFamily
from mla_tune.cli.main import app
from mla_tune.db import TrialGroup, TrialResult, TuningStore
from mla_tune.machine.fingerprint import (
    DeviceFingerprint,
    SoftwareFingerprint,
    current_device,
    current_software,
)
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import Shape, generate_input
from mla_tune.problem.verify import Tolerance, check, tolerance_for
from mla_tune.results.selection import update_winner
from mla_tune.results.winner import Winner
from mla_tune.results.winners_file import (
    export_winners,
    import_winners,
    write_winners_json,
)
from mla_tune.runtime.dispatcher import Dispatcher, occupancy_splits
from mla_tune.runtime.routing_rules import model_knobs
from mla_tune.tuning.space import ParamSpace, load_backend_space
from tests.fixtures.sweep_db import swept_db

runner = CliRunner()
GATE = Tolerance(rtol=2e-2, atol=2e-2, max_mismatch_frac=1e-3)
TUNED = [Shape.uniform(2, 64), Shape.uniform(4, 256), Shape.uniform(4, 256, kv_format="fp8")]
H200 = DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132, 150 << 30)


@pytest.fixture(scope="module")
def tuned_db(tmp_path_factory):
    """A real tuning DB: the torch family swept on CPU over TUNED."""
    path = tmp_path_factory.mktemp("dispatch") / "tuning.db"
    swept_db(path, TUNED).close()
    return path


@pytest.fixture()
def disp(tuned_db):
    """Pinned to bf16: which format is fastest depends on CPU timings."""
    return Dispatcher.from_db(str(tuned_db), "cpu", kv_format="bf16")


def assert_matches_reference(out, data, kv_format="bf16"):
    result = check(out, mla_decode_reference(*data, kv_format=kv_format), GATE)
    assert result.ok, result.reason


def stored_winner(db, shape):
    with TuningStore(str(db)) as store:
        (w,) = store.winners(shape_key=shape.key)
    return w


def test_exact_hit_runs_the_stored_winner(disp, tuned_db):
    shape = TUNED[1]
    d = disp.decide(shape)
    w = stored_winner(tuned_db, shape)
    assert (d.reason, d.backend, d.config, d.tuned_us) == ("exact", "torch", w.config,
                                                           w.median_us)
    data = generate_input(shape)
    assert_matches_reference(disp.run(data), data)
    assert_matches_reference(disp(*data), data)
    assert list(disp._routes) == [(4, 1, 256, 16)]


def test_nearest_shape_fallback_logs_once_per_key(disp, tuned_db, caplog):
    caplog.set_level(logging.INFO, logger="mla_tune.runtime.dispatcher")
    for shape, near in ((Shape.uniform(4, 512), TUNED[1]), (Shape.uniform(2, 128), TUNED[0])):
        d = disp.decide(shape)
        assert d.reason == "nearest" and d.tuned_shape == near
        assert d.config == stored_winner(tuned_db, near).config
        assert "never verified at this shape" in d.detail
    data = generate_input(Shape.uniform(4, 512))
    for _ in range(3):
        assert_matches_reference(disp.run(data), data)
    assert sum("[nearest]" in r.message for r in caplog.records) == 1


def test_heuristic_fallback_for_untuned_heads(disp, caplog):
    shape = Shape.uniform(2, 64, heads=32)
    d = disp.decide(shape)
    assert d.reason == "heuristic" and d.backend == "torch"
    data = generate_input(shape)
    for _ in range(2):
        assert_matches_reference(disp.run(data), data)
    assert sum("[heuristic]" in r.message for r in caplog.records) == 1


class BrokenBackend(Backend):
    """Declares a space like a real family but cannot build anything."""

    name = "broken"

    def available(self, device):
        return Availability(True)

    def declared_space(self, device):
        return ParamSpace.from_mapping({"num_splits": [1, 2]})

    def build(self, shape, config, device):
        raise RuntimeError("broken variant does not compile")

    def source_files(self):
        return [Path(__file__)]


def test_variant_that_fails_to_build_falls_through_to_torch(disp, monkeypatch, caplog):
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))  # undone after
    monkeypatch.setattr(backends, "_instances", dict(backends._instances))
    register("broken", "tests.runtime.test_dispatcher:BrokenBackend")
    monkeypatch.setattr(routing, "HEURISTIC_BACKENDS", ("broken",))
    shape = Shape.uniform(3, 64, heads=32)
    assert [d.reason for d in disp.decisions(shape)] == ["heuristic", "fallback"]
    data = generate_input(shape)
    assert_matches_reference(disp.run(data), data)
    assert any("does not compile" in r.message for r in caplog.records)
    assert any("[fallback]" in r.message for r in caplog.records)


def test_occupancy_model_matches_seed_split_model():
    def seed(batch, kv, cu=256, overhead=84.1, max_splits=16):  # seed 000's formula
        best_score, best = -1.0, 1
        for i in range(1, max_splits + 1):
            total = batch * i
            waves = (total + cu - 1) // cu
            score = total / (waves * cu) * kv / (kv + overhead * i)
            if score > best_score:
                best_score, best = score, i
        return best

    for batch in (4, 32, 64, 256):
        for kv in (1024, 8192):
            assert occupancy_splits(batch, 16, kv, 256, min_split_tokens=0) == seed(batch, kv)
    assert occupancy_splits(256, 16, 8192, 132) == 1
    assert occupancy_splits(4, 16, 8192, 132) > 8
    assert occupancy_splits(4, 16, 40, 132) == 1


def _record_winner(store, device, software, shape, source_hash=None, config=None,
                   median_us=10.0):
    torch_family = get_backend("torch")
    source = source_hash or torch_family.source_hash()
    config = config or {"num_splits": 4, "chunk_size": 0, "compute_dtype": "float32"}
    dev_id, sw_id = store.device_id(device), store.software_id(software)
    store.record_trial(TrialGroup(dev_id, sw_id, shape.key, "torch", source),
                       TrialResult(shape.to_json(), shape.kv_format.value, config, "ok",
                                   stats={"median_us": median_us}))
    assert update_winner(store, dev_id, sw_id, shape.key, {"torch": source}) is not None


def test_foreign_device_and_stale_sources_are_ignored(tmp_path, caplog):
    db = tmp_path / "foreign.db"
    shape = Shape.uniform(4, 256)
    with TuningStore(str(db)) as store:
        _record_winner(store, H200, current_software(), shape)
        _record_winner(store, current_device("cpu"), current_software(), shape,
                       source_hash="00000000deadbeef")
    d = Dispatcher.from_db(str(db), "cpu")
    assert d.loaded == 0
    assert d.ignored == {"tuned on another device": 1, "kernel sources changed since tuning": 1}
    # The winner of other kernel code on this device is said once; the other device's not.
    said = [r.message for r in caplog.records if "other kernel code" in r.message]
    assert len(said) == 1 and "ignoring 1 winner(s)" in said[0]
    assert d.decide(shape).reason == "heuristic"
    data = generate_input(shape)
    assert_matches_reference(d.run(data), data)


def test_other_library_versions_warn_once_or_are_ignored_when_strict(tmp_path, caplog):
    db = tmp_path / "stack.db"
    old = dict(current_software().as_dict(), torch="1.0.0")
    with TuningStore(str(db)) as store:
        for shape in (Shape.uniform(4, 256), Shape.uniform(2, 64)):
            _record_winner(store, current_device("cpu"),
                           SoftwareFingerprint(tuple(old.items())), shape)
    d = Dispatcher.from_db(str(db), "cpu")
    assert d.loaded == 2
    assert d.decide(Shape.uniform(4, 256)).reason == "exact"
    assert sum("other versions" in r.message for r in caplog.records) == 1
    strict = Dispatcher.from_db(str(db), "cpu", strict=True)
    assert strict.loaded == 0
    assert strict.ignored == {"tuned under other library versions (strict)": 2}


def test_libraries_of_other_backends_do_not_count_as_a_different_stack(tmp_path, caplog):
    db = tmp_path / "fi.db"
    tuned_with_flashinfer = dict(current_software().as_dict(), flashinfer="0.7.4")
    with TuningStore(str(db)) as store:
        _record_winner(store, current_device("cpu"),
                       SoftwareFingerprint(tuple(tuned_with_flashinfer.items())),
                       Shape.uniform(4, 256))
    strict = Dispatcher.from_db(str(db), "cpu", strict=True)
    assert strict.loaded == 1 and strict.decide(Shape.uniform(4, 256)).reason == "exact"
    assert not any("other versions" in r.message for r in caplog.records)


def test_exact_stack_beats_other_stack_for_the_same_shape(tmp_path):
    db = tmp_path / "two.db"
    shape = Shape.uniform(4, 256)
    other = dict(current_software().as_dict(), triton="0.1")
    with TuningStore(str(db)) as store:
        _record_winner(store, current_device("cpu"), SoftwareFingerprint(tuple(other.items())),
                       shape, config={"num_splits": 1, "chunk_size": 0,
                                      "compute_dtype": "float32"})
        _record_winner(store, current_device("cpu"), current_software(), shape)
    assert Dispatcher.from_db(str(db), "cpu").decide(shape).config["num_splits"] == 4


@pytest.mark.parametrize("content", [b"this is not a database at all",
                                     b"SQLite format 3\x00" + b"\xff" * 3000])
def test_corrupt_db_is_a_warning_and_left_untouched(tmp_path, caplog, content):
    db = tmp_path / "bad.db"
    db.write_bytes(content)
    d = Dispatcher.from_db(str(db), "cpu")
    assert d.loaded == 0 and any("unusable" in r.message for r in caplog.records)
    data = generate_input(Shape.uniform(2, 64))
    assert_matches_reference(d.run(data), data)
    assert db.read_bytes() == content


def test_missing_db_is_a_warning_and_not_created(tmp_path, caplog, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    monkeypatch.setattr(mla_db, "shipped_db_url", lambda: f"sqlite:///{tmp_path}/gone.db")
    for where in (str(tmp_path / "nowhere.db"), None):
        d = Dispatcher.from_db(where, "cpu")
        assert d.loaded == 0
    assert not list(tmp_path.iterdir())
    assert sum("no tuning DB file" in r.message for r in caplog.records) == 2


def test_forced_override(tuned_db, monkeypatch):
    # float32 products: the bf16-compute variants fail the bf16 gate on the ragged probe
    # batch, and when one of them wins the fp8 shape (CPU timing decides) its verification
    # facts say so, and the dispatcher rightly refuses to force it here.
    monkeypatch.setenv("MLA_TUNE_FORCE", "torch:num_splits=4, compute_dtype=Float32")
    d = Dispatcher.from_db(str(tuned_db), "cpu", kv_format="bf16")
    shape = TUNED[0]
    forced = d.decide(shape)
    assert forced.reason == "forced"
    assert forced.config == {"num_splits": 4, "chunk_size": 0, "compute_dtype": "float32"}
    data = generate_input(shape)
    assert_matches_reference(d.run(data), data)
    # Not feasible for 40 keys (4 splits of 10): routed as usual, by a nearest tuned winner
    # or, when the CPU sweep picked 4 splits for every tuned shape, by the heuristic (the
    # timing decides; "nearest" alone made this test fail on a loaded machine).
    assert d.decide(Shape.uniform(2, 40)).reason in ("nearest", "heuristic")


@pytest.mark.parametrize("spec, message", [("nope:x=1", "unknown backend"),
                                           ("torch:num_splits=3", "not one of"),
                                           ("torch:bogus=1", "unknown parameter"),
                                           ("torch:num_splits", "key=value")])
def test_bad_force_is_refused(monkeypatch, spec, message):
    monkeypatch.setenv("MLA_TUNE_FORCE", spec)
    with pytest.raises(ValueError, match=message):
        Dispatcher(device="cpu")


def test_trace_prints_each_decision_once_per_key(tuned_db, monkeypatch, capfd):
    monkeypatch.setenv("MLA_TUNE_TRACE", "1")
    d = Dispatcher.from_db(str(tuned_db), "cpu", kv_format="bf16")
    capfd.readouterr()
    a, b = generate_input(TUNED[0]), generate_input(Shape.uniform(2, 96))
    for data in (a, a, b, b, a):
        d.run(data)
    lines = [x for x in capfd.readouterr().err.splitlines() if x.startswith("mla-tune route:")]
    assert len(lines) == 2
    assert "[exact]" in lines[0] and TUNED[0].key in lines[0] and "[nearest]" in lines[1]


def _mutations():
    def q_dtype(d):
        return (d[0].float(),) + d[1:]

    def q_heads(d):
        return (d[0][:, :8].contiguous(),) + d[1:]

    def q_strided(d):
        return (d[0].transpose(0, 1).contiguous().transpose(0, 1),) + d[1:]

    def q_device(d):
        return (d[0].to("meta"),) + d[1:]

    def kv_rows(d):
        return (d[0], dict(d[1], bf16=d[1]["bf16"][:-64]), *d[2:])

    def qo_len(d):
        return (d[0], d[1], d[2][:-1], *d[3:])

    def kvp_dtype(d):
        return (*d[:3], d[3].long(), d[4])

    def cfg_missing(d):
        return (*d[:4], {k: v for k, v in d[4].items() if k != "batch_size"})

    def not_a_tuple(d):
        return list(d[:4])

    return [(q_dtype, "q has dtype"), (q_heads, "q has shape"),
            (q_strided, "q must be contiguous"), (q_device, "q is on meta"),
            (kv_rows, r"kv_data\['bf16'\] has shape"),
            (qo_len, "qo_indptr has 2 elements; expected 3"),
            (kvp_dtype, "kv_indptr has dtype"), (cfg_missing, r"config\['batch_size'\]"),
            (not_a_tuple, "data must be")]


@pytest.mark.parametrize("warm", [False, True], ids=["first-call", "cached"])
@pytest.mark.parametrize("mutate, message", _mutations(), ids=lambda x: getattr(x, "__name__", ""))
def test_bad_inputs_raise_value_error_naming_the_argument(mutate, message, warm):
    d = Dispatcher(device="cpu", kv_format="bf16")
    data = generate_input(Shape.uniform(2, 64))
    if warm:
        d.run(data)
    with pytest.raises(ValueError, match=message):
        d.run(mutate(data))


def test_unchecked_dispatcher_still_validates_each_first_call():
    d = Dispatcher(device="cpu", kv_format="bf16", check_inputs=False)
    data = generate_input(Shape.uniform(2, 64))
    with pytest.raises(ValueError, match="kv_indptr has dtype"):
        d.run((*data[:3], data[3].long(), data[4]))
    assert_matches_reference(d.run(data), data)
    assert_matches_reference(d.run(data), data)


def test_config_is_checked_on_a_shape_first_call():
    data = generate_input(Shape.uniform(2, 64))
    with pytest.raises(ValueError, match=r"config\['qk_head_dim'\] is 128"):
        Dispatcher(device="cpu").run((*data[:4], dict(data[4], qk_head_dim=128)))


@pytest.mark.parametrize("fmt, mutate, message", [
    ("fp8", lambda e: (e[0], e[1].double()), r"kv_data\['fp8'\]\[1\] has dtype"),
    ("fp8", lambda e: (e[0].view(torch.uint8), e[1]), r"kv_data\['fp8'\]\[0\] has dtype"),
    ("mxfp4", lambda e: (e[0], e[1][:, :8]), r"kv_data\['mxfp4'\]\[1\] has shape"),
    ("mxfp4", lambda e: e[0], "must be a \\(values, scale\\) pair"),
])
def test_bad_quantized_caches_are_refused(fmt, mutate, message):
    d = Dispatcher(device="cpu", kv_format=fmt)
    data = generate_input(Shape.uniform(2, 64))
    assert_matches_reference(d.run(data), data, fmt)
    bad = (data[0], dict(data[1], **{fmt: mutate(data[1][fmt])}), *data[2:])
    with pytest.raises(ValueError, match=message):
        d.run(bad)


def test_format_policy_fastest_tuned_pinned_and_missing(tuned_db):
    d = Dispatcher.from_db(str(tuned_db), "cpu")
    shape = TUNED[1]
    times = {f: stored_winner(tuned_db, shape.with_format(f)).median_us for f in ("bf16", "fp8")}
    fastest = min(times, key=times.get)
    # mxfp4 has no tuned data, so it ranks after both tuned formats; an exact winner
    # (bf16 at 2x64) beats an estimate from a nearest shape (fp8 at 4x256).
    assert d.choose_format(shape, ["bf16", "fp8", "mxfp4"]).value == fastest
    assert d.choose_format(shape, ["mxfp4", "fp8"]).value == "fp8"
    assert d.choose_format(Shape.uniform(2, 64), ["mxfp4", "fp8", "bf16"]).value == "bf16"
    assert d.choose_format(Shape.uniform(2, 64), ["mxfp4", "fp8"]).value == "fp8"
    assert d.choose_format(Shape.uniform(2, 64, heads=32), ["mxfp4", "fp8"]).value == "fp8"
    data = generate_input(shape)
    assert_matches_reference(d.run(data), data, fastest)
    other = "fp8" if fastest == "bf16" else "bf16"
    only_other = (data[0], {other: data[1][other]}, *data[2:])
    assert_matches_reference(d.run(only_other), only_other, other)
    pinned = Dispatcher.from_db(str(tuned_db), "cpu", kv_format="mxfp4")
    assert_matches_reference(pinned.run(data), data, "mxfp4")
    with pytest.raises(ValueError, match="lacks 'mxfp4'"):
        pinned.run(only_other)


def test_ragged_calls_use_nearest_uniform_variant_in_one_bucket_runner(disp):
    from mla_tune.runtime.buckets import router_for

    shape = Shape(2, (40, 64))
    data = generate_input(shape)
    assert data[4]["kv_seq_len"] == 64
    d = disp.decide(shape)
    assert d.reason == "nearest" and d.tuned_shape == TUNED[0]
    assert_matches_reference(disp.run(data, kv_lens=[40, 64]), data)
    assert_matches_reference(disp(*data, kv_lens=(40, 64)), data)
    assert router_for(disp).builds == 1
    uniform = generate_input(TUNED[0])
    assert_matches_reference(disp.run(uniform, kv_lens=[64, 64]), uniform)
    with pytest.raises(ValueError, match="kv_lens has 3 lengths"):
        disp.run(data, kv_lens=[40, 64, 1])
    with pytest.raises(ValueError, match="exceeds config kv_seq_len"):
        disp.run(data, kv_lens=[40, 65])


def test_routing_is_deterministic_and_building_is_once_per_key(tuned_db, monkeypatch):
    shapes = [Shape.uniform(b, kv, heads=h) for b in (1, 3, 8) for kv in (32, 200, 900)
              for h in (16, 32)]
    a, b = Dispatcher.from_db(str(tuned_db), "cpu"), Dispatcher.from_db(str(tuned_db), "cpu")
    assert [a.decisions(s) for s in shapes] == [b.decisions(s) for s in shapes]

    builds = []
    real_build = TorchFamily.build

    def counting_build(self, *args):
        builds.append(args[0].key)
        return real_build(self, *args)

    monkeypatch.setattr(TorchFamily, "build", counting_build)
    data = generate_input(Shape.uniform(3, 200))
    outs = []
    threads = [threading.Thread(target=lambda: outs.append(a.run(data))) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(outs) == 6 and builds == [Shape.uniform(3, 200).key]


def test_route_command_says_what_runs_and_why(tuned_db, tmp_path):
    r = runner.invoke(app, ["route", "--shape", "4x256", "--kv-format", "bf16", "--db",
                            str(tuned_db), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    w = stored_winner(tuned_db, TUNED[1])
    assert "3 tuned shape(s)" in r.stdout and "why: exact" in r.stdout
    assert f"num_splits={w.config['num_splits']}" in r.stdout
    r = runner.invoke(app, ["route", "--shape", "3x100", "--heads", "32", "--db",
                            str(tuned_db), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    assert r.stdout.count("why: heuristic") == 3 and "runs bf16" in r.stdout
    empty = tmp_path / "none.json"
    r = runner.invoke(app, ["route", "--shape", "2x64", "--winners", str(empty),
                            "--device", "cpu"])
    assert r.exit_code == 0 and "0 tuned shape(s)" in r.stdout and not empty.exists()
    r = runner.invoke(app, ["route", "--shape", "2x", "--db", str(tuned_db)])
    assert r.exit_code == 2 and "bad shape" in r.output


def test_winners_stored_under_the_bytes_hash_of_the_installed_sources_are_used(tmp_path):
    # Winners files written before sources were hashed by their code carry the bytes hash
    # of the same files: they still route, while any other hash is stale.
    db = tmp_path / "bytes.db"
    shape = Shape.uniform(4, 256)
    with TuningStore(str(db)) as store:
        _record_winner(store, current_device("cpu"), current_software(), shape,
                       source_hash=get_backend("torch").source_bytes_hash())
    d = Dispatcher.from_db(str(db), "cpu")
    assert d.loaded == 1 and d.ignored == {}
    assert d.decide(shape).reason == "exact"


def test_default_db_layers_the_local_db_over_the_shipped_winners(tmp_path, monkeypatch):
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    cpu, sw = current_device("cpu"), current_software()
    a, b = Shape.uniform(4, 256), Shape.uniform(2, 64)
    shipped = tmp_path / "pkg" / "shipped.db"
    shipped.parent.mkdir()
    with TuningStore(str(shipped)) as store:
        _record_winner(store, cpu, sw, a, median_us=20.0)
        _record_winner(store, cpu, sw, b, median_us=5.0)
    monkeypatch.setattr(mla_db, "shipped_db_url", lambda: f"sqlite:///{shipped}")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    only_shipped = Dispatcher.from_db(None, "cpu")  # no ./tuning.db here: nothing created
    assert only_shipped.loaded == 2 and not list(work.iterdir())
    assert only_shipped.decide(a).tuned_us == 20.0
    with TuningStore(str(work / "tuning.db")) as store:  # the user's own, faster at `a`
        _record_winner(store, cpu, sw, a, median_us=8.0,
                       config={"num_splits": 1, "chunk_size": 0, "compute_dtype": "float32"})
        _record_winner(store, cpu, sw, b, median_us=9.0,
                       config={"num_splits": 1, "chunk_size": 0, "compute_dtype": "float32"})
    layered = Dispatcher.from_db(None, "cpu")
    assert layered.loaded == 2 and "shipped.db" in layered.origin
    assert (layered.decide(a).tuned_us, layered.decide(a).config["num_splits"]) == (8.0, 1)
    assert (layered.decide(b).tuned_us, layered.decide(b).config["num_splits"]) == (5.0, 4)
    monkeypatch.setenv("MLA_TUNE_DB", str(work / "tuning.db"))  # named: that DB alone
    assert Dispatcher.from_db(None, "cpu").decide(b).tuned_us == 9.0


def test_default_db_finds_the_shipped_results_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.delenv("MLA_TUNE_DB", raising=False)
    monkeypatch.chdir(tmp_path)
    d = Dispatcher.from_db(None, "cpu")
    assert d.ignored.get("tuned on another device", 0) > 0  # the H200 winners, read
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("column, value", [
    ("config_json", "{"), ("config_json", "null"), ("config_json", "[" * 5000 + "]" * 5000),
    ("config_json", '{"num_splits": ' + "9" * 5001 + "}"), ("shape_json", "{}"),
    ("median_us", "fast"),
])
def test_one_undecodable_winner_row_is_skipped_not_the_table(tmp_path, caplog, column, value):
    db = tmp_path / "one_bad.db"
    good, bad = Shape.uniform(4, 256), Shape.uniform(2, 64)
    with TuningStore(str(db)) as store:
        for shape in (good, bad):
            _record_winner(store, current_device("cpu"), current_software(), shape)
    with closing(sqlite3.connect(db)) as con, con:
        con.execute(f"UPDATE mt_winners SET {column} = ? WHERE shape_key = ?",
                    (value, bad.key))
    d = Dispatcher.from_db(str(db), "cpu")
    assert d.loaded == 1 and d.decide(good).reason == "exact"
    assert d.decide(bad).reason != "exact"
    assert any("skipping" in r.message and bad.key in r.message for r in caplog.records)


def _verdict_db(path, winners, checked):
    """A DB as a sweep leaves it: torch winners `winners` {shape: config}, and at each of
    `checked` the project's bf16 gate's real verdict on every bf16-compute candidate (all
    wrong there, so those shapes have no winner)."""
    cpu = torch.device("cpu")
    torch_family = get_backend("torch")
    source = torch_family.source_hash()
    with TuningStore(str(path)) as store:
        dev, sw = store.device_id(current_device("cpu")), store.software_id(current_software())
        for shape, configs in [(s, [c]) for s, c in winners.items()] + [
                (s, [c for c in torch_family.candidates(s, cpu)
                     if c["compute_dtype"] == "bfloat16"]) for s in checked]:
            data = generate_input(shape)
            ref = mla_decode_reference(*data, kv_format="bf16")
            for config in configs:
                verdict = check(torch_family.build(shape, config, cpu)(data), ref,
                                tolerance_for("bf16"))
                store.record_trial(TrialGroup(dev, sw, shape.key, "torch", source),
                                   TrialResult(shape.to_json(), "bf16", config,
                                               "ok" if verdict.ok else "wrong",
                                               stats={"median_us": 10.0} if verdict.ok else None))
            update_winner(store, dev, sw, shape.key, {"torch": source})


BF16_COMPUTE = {"num_splits": 1, "chunk_size": 0, "compute_dtype": "bfloat16"}
CALLS_STORED_WRONG = [Shape.uniform(16, 32), Shape.uniform(9, 40), Shape.uniform(6, 64)]


@pytest.fixture(scope="module")
def verdicts(tmp_path_factory):
    root = tmp_path_factory.mktemp("verdicts")
    _verdict_db(root / "v.db", {Shape.uniform(4, 256): BF16_COMPUTE,
                                Shape.uniform(8, 128): BF16_COMPUTE}, CALLS_STORED_WRONG)
    with TuningStore(str(root / "v.db")) as store:
        export_winners(store, root / "v.json")
        wrong = {t.shape_key for t in store.trials(status="wrong")}
    assert wrong == {s.key for s in CALLS_STORED_WRONG}  # the gate fails there, for real
    return root / "v.db", root / "v.json"


@pytest.mark.parametrize("source", ["db", "json"])
def test_nearest_fallback_never_runs_a_variant_stored_wrong_for_the_shape(verdicts, source,
                                                                          caplog):
    db, path = verdicts
    d = (Dispatcher.from_db(str(db), "cpu", kv_format="bf16") if source == "db"
         else Dispatcher.from_json(path, "cpu", kv_format="bf16"))
    assert d.loaded == 2 and d.decide(Shape.uniform(4, 256)).config == BF16_COMPUTE
    for shape in CALLS_STORED_WRONG + [Shape.uniform(12, 48)]:  # last: wrong in its family
        chain = d.decisions(shape)
        assert all(x.config["compute_dtype"] != "bfloat16" for x in chain), shape.label()
        data = generate_input(shape)
        result = check(d.run(data), mla_decode_reference(*data), tolerance_for("bf16"))
        assert result.ok, (shape.label(), result.reason)
    # Wrong elsewhere in its family: suspect, so the heuristic routes unchecked shapes.
    far = d.decide(Shape.uniform(4, 512))
    assert far.reason == "heuristic" and far.config["compute_dtype"] != "bfloat16"


def test_a_winners_file_of_version_1_still_loads_without_verification_facts(verdicts,
                                                                             tmp_path):
    _, path = verdicts
    doc = json.loads(path.read_text())
    assert doc["version"] == 2 and any(w["verified_wrong"] for w in doc["winners"])
    doc["version"] = 1
    for w in doc["winners"]:
        del w["verified_ok"], w["verified_wrong"]
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(doc))
    d = Dispatcher.from_json(old, "cpu", kv_format="bf16")
    assert d.loaded == 2 and d.decide(CALLS_STORED_WRONG[0]).reason == "nearest"


def test_a_huge_config_batch_fails_fast_before_anything_is_built(monkeypatch):
    d = Dispatcher(device="cpu", kv_format="bf16")
    data = generate_input(Shape.uniform(4, 64))
    monkeypatch.setattr(Shape, "uniform", None)  # building a Shape from it would fail
    with pytest.raises(ValueError, match=r"q has shape \(4, 16, 576\); config batch_size "
                       "100000000"):
        d.run((*data[:4], dict(data[4], batch_size=10**8)))


@pytest.mark.parametrize("check_inputs", [True, False])
@pytest.mark.parametrize("field, value, message", [
    ("v_head_dim", 128, r"config\['v_head_dim'\] is 128"),
    ("sm_scale", 0.5, r"config\['sm_scale'\] is 0.5"),
    ("sm_scale", None, "config lacks 'sm_scale'"),
    ("num_kv_heads", None, "config lacks 'num_kv_heads'"),
])
def test_every_checking_call_refuses_what_a_first_call_refuses(field, value, message,
                                                              check_inputs):
    data = generate_input(Shape.uniform(2, 64))
    bad = dict(data[4])
    if value is None:
        del bad[field]
    else:
        bad[field] = value
    fresh = Dispatcher(device="cpu", kv_format="bf16", check_inputs=check_inputs)
    with pytest.raises(ValueError, match=message):
        fresh.run((*data[:4], bad))
    warm = Dispatcher(device="cpu", kv_format="bf16", check_inputs=check_inputs)
    warm.run(data)
    if check_inputs:
        with pytest.raises(ValueError, match=message):
            warm.run((*data[:4], bad))
    same = dict(data[4], sm_scale=data[4]["sm_scale"] * (1 + 1e-12))  # the task's, rounded
    assert_matches_reference(warm.run((*data[:4], same)), data)


def test_an_imported_winners_file_keeps_where_its_configs_were_stored_wrong(verdicts,
                                                                            tmp_path):
    _, path = verdicts
    with TuningStore(str(tmp_path / "imported.db")) as store:
        import_winners(store, path)
        assert {t.shape_key for t in store.trials(status="wrong")} == {
            s.key for s in CALLS_STORED_WRONG}
    d = Dispatcher.from_db(str(tmp_path / "imported.db"), "cpu", kv_format="bf16")
    assert all(x.config != BF16_COMPUTE for s in CALLS_STORED_WRONG for x in d.decisions(s))


# --- the row model: transfer across q_len/heads families, and the heuristic -----------------

class TritonStandIn(TritonFamily):
    """The Triton family's H200 space and feasibility, routed on CPU: its build runs the
    torch family's float32 kernel (correct for every shape, so the dispatcher's calls are
    checked against the reference), and its precheck prunes bf16's 3 stages of 64-key
    tiles as the sm_90 static check does (shared memory over the limit)."""

    def available(self, device):
        return Availability(True)

    def declared_space(self, device):
        return super().declared_space(torch.device("cuda"))  # the GPU's space, its defaults

    def precheck(self, shape, config, device):
        if shape.kv_format.value == "bf16" and (config["block_n"], config["num_stages"]) \
                == (64, 3):
            return "cuda:90: shared memory 262168 B over 232448"
        return None

    def compile_key(self, shape, config, device):
        return None

    def build(self, shape, config, device):
        return TorchFamily().build(shape, {"num_splits": 1, "chunk_size": 0,
                                           "compute_dtype": "float32"}, device)

    def source_files(self):
        return [Path(__file__)]


SWEPT_Q1H16 = {"block_m": 16, "block_n": 32, "compute": "bf16", "fast_mode": True,
               "fp8_convert": "staged", "kv_load": "tma_host", "num_splits": 4,
               "num_stages": 3, "num_warps": 4, "page_size": 1, "pdl": True, "seg_cost": 1,
               "page_rows": "key", "bucket_runs": "stream"}


@pytest.fixture()
def standin(monkeypatch):
    """The stand-in registered as "triton" (undone after the test)."""
    monkeypatch.setattr(backends, "_REGISTRY", dict(backends._REGISTRY))
    monkeypatch.setattr(backends, "_instances", dict(backends._instances))
    register("triton", "tests.runtime.test_dispatcher:TritonStandIn")
    return get_backend("triton")


def _triton_winner(shape, config, median_us, ok=(), wrong=()):
    return Winner(current_device("cpu"), current_software(), shape, "triton",
                  get_backend("triton").source_hash(), dict(config), median_us,
                  tuple(ok), tuple(wrong))


def _as_h200(d):
    """The dispatcher's row model counting the H200's 132 SMs instead of this CPU's
    cores (the table is loaded already; only the model's unit count changes)."""
    d.fingerprint = replace(d.fingerprint, sm_count=132)
    return d


Q4H32 = Shape.uniform(2, 256, q_len=4, heads=32)  # 128 rows per sequence


def test_a_family_without_winners_runs_a_transferred_variant_with_its_rows_re_derived(
        standin, monkeypatch, caplog, capfd):
    monkeypatch.setenv("MLA_TUNE_TRACE", "1")
    caplog.set_level(logging.INFO, logger="mla_tune.runtime.dispatcher")
    near, far = Shape.uniform(2, 256), Shape.uniform(16, 1024)
    d = _as_h200(Dispatcher([_triton_winner(near, SWEPT_Q1H16, 12.0),
                             _triton_winner(far, dict(SWEPT_Q1H16, num_splits=1), 30.0)],
                            "cpu", kv_format="bf16"))
    chain = d.decisions(Q4H32)
    moved = [x for x in chain if x.reason == "transfer"]
    assert chain[:len(moved)] == moved and len(moved) == 3
    first = moved[0]
    assert first.tuned_shape == near and first.backend == "triton"
    # 128 rows in 4 blocks of 32 (8 warps, 64-key tiles); host descriptors need q_len 1,
    # so TMA loads; everything else as tuned.
    assert {k: first.config[k] for k in ("block_m", "num_warps", "block_n", "kv_load")} == \
        {"block_m": 32, "num_warps": 8, "block_n": 64, "kv_load": "tma"}
    assert {k: first.config[k] for k in ("compute", "fast_mode", "num_stages")} == \
        {"compute": "bf16", "fast_mode": True, "num_stages": 3}
    _, want = model_knobs(2, 128, 256, 132, {16, 32}, (SWEPT_Q1H16, 2, 16, 256))
    feasible = {c["num_splits"] for c in standin.candidates(Q4H32, d.device)
                if c["block_m"] == 32 and c["num_splits"]}
    assert first.config["num_splits"] == min(
        feasible, key=lambda n: abs(math.log2(n) - math.log2(want)))
    assert "transfer" in first.describe() and "128 rows in blocks of 32" in first.detail
    assert all(standin.feasible(Q4H32, x.config) for x in chain if x.backend == "triton")
    # The first transferred variant fails its precheck; the next one runs, announced once.
    data = generate_input(Q4H32)
    capfd.readouterr()
    for _ in range(3):
        assert_matches_reference(d.run(data), data)
    ran = [r.message for r in caplog.records if "[transfer]" in r.message]
    assert len(ran) == 1 and '"num_stages":3' not in ran[0] and '"block_m":32' in ran[0]
    assert any("precheck" in r.message for r in caplog.records)
    trace = [x for x in capfd.readouterr().err.splitlines() if x.startswith("mla-tune route")]
    assert trace == [f"mla-tune route: {ran[0].removeprefix('mla-tune: ')}"]


class RowPlanner(TorchFamily):
    """A library that plans its own rows (as FlashInfer and aiter do), on CPU: the torch
    family's kernel and space under another name."""

    name = "rowplanner"
    plans_own_rows = True

    def declared_space(self, device):
        return TorchFamily().declared_space(device)

    def source_files(self):
        return [Path(__file__)]


def test_a_library_planning_its_own_rows_serves_another_family_as_tuned(standin, monkeypatch):
    """The nearest tuned shape of another q_len/heads family was won by a library whose
    knobs say nothing about rows: the call takes that config as tuned, and it runs."""
    register("rowplanner", "tests.runtime.test_dispatcher:RowPlanner")
    lib_cfg = {"num_splits": 4, "chunk_size": 0, "compute_dtype": "float32"}
    near, far = Shape.uniform(2, 256, q_len=4, heads=16), Shape.uniform(16, 1024)
    lib = get_backend("rowplanner")
    d = _as_h200(Dispatcher([
        Winner(current_device("cpu"), current_software(), near, "rowplanner",
               lib.source_hash(), dict(lib_cfg), 9.0),
        _triton_winner(far, SWEPT_Q1H16, 30.0)], "cpu", kv_format="bf16"))
    chain = d.decisions(Q4H32)
    first = chain[0]
    assert (first.reason, first.backend, first.config, first.tuned_shape) == \
        ("transfer", "rowplanner", lib_cfg, near)
    assert "plans its own rows" in first.detail
    assert any(x.backend == "triton" and x.reason == "transfer" for x in chain[1:])
    data = generate_input(Q4H32, seed=1, device="cpu")
    check(d.run(data), mla_decode_reference(*data[:4], data[4], kv_format="bf16"),
          tolerance_for(Q4H32.kv_format))
    # Fewer rows than the library's source (16 against 64): the Triton variant moves.
    q1 = Shape.uniform(2, 256)
    chain = d.decisions(q1)
    assert chain[0].backend == "triton" and all(x.backend != "rowplanner" for x in chain)
    # The same winner under a family that says nothing about its rows does not move.
    monkeypatch.setattr(RowPlanner, "plans_own_rows", False)
    d = _as_h200(Dispatcher([
        Winner(current_device("cpu"), current_software(), near, "rowplanner",
               lib.source_hash(), dict(lib_cfg), 9.0),
        _triton_winner(far, SWEPT_Q1H16, 30.0)], "cpu", kv_format="bf16"))
    assert all(x.backend == "triton" for x in d.decisions(Q4H32) if x.reason == "transfer")


def test_one_library_win_among_row_blocked_wins_around_the_call_does_not_route_it(standin):
    """A library won one neighbour of the call (as noisy small shapes let it), the
    row-blocked family the shapes covering the call: the moved Triton variant comes first,
    the library's config after it. Where the library also won a covering shape's smaller
    neighbours, it comes first."""
    register("rowplanner", "tests.runtime.test_dispatcher:RowPlanner")
    lib = get_backend("rowplanner")
    lib_cfg = {"num_splits": 4, "chunk_size": 0, "compute_dtype": "float32"}
    call = Shape.uniform(2, 256, heads=32)  # 32 rows

    def library(shape):
        return Winner(current_device("cpu"), current_software(), shape, "rowplanner",
                      lib.source_hash(), dict(lib_cfg), 9.0)

    noisy = library(Shape.uniform(2, 256, q_len=2, heads=16))  # 32 rows, the call's twin
    covering = [_triton_winner(s, SWEPT_Q1H16, 20.0) for s in (
        Shape.uniform(2, 256, heads=64), Shape.uniform(2, 256, q_len=4, heads=16),
        Shape.uniform(4, 256, heads=32))]
    chain = _as_h200(Dispatcher([noisy, *covering], "cpu", kv_format="bf16")).decisions(call)
    assert chain[0].backend == "triton" and chain[0].reason == "transfer"
    assert [x.config for x in chain if x.backend == "rowplanner"] == [lib_cfg]
    # The library also won below the call: its wins now outweigh the covering ones.
    below = [library(s) for s in (Shape.uniform(2, 256), Shape.uniform(1, 256, heads=32),
                                  Shape.uniform(2, 128, heads=32))]
    chain = _as_h200(Dispatcher([noisy, *below, *covering], "cpu",
                                kv_format="bf16")).decisions(call)
    assert (chain[0].backend, chain[0].config) == ("rowplanner", lib_cfg)
    assert chain[1].backend == "triton"


def test_a_transfer_never_runs_a_variant_stored_wrong_at_the_call(standin):
    near = Shape.uniform(2, 256)
    table = [_triton_winner(near, SWEPT_Q1H16, 12.0)]
    first = Dispatcher(table, "cpu", kv_format="bf16").decide(Q4H32).config
    # The same config, tuned for MXFP4 elsewhere, was stored wrong at this very call.
    elsewhere = Shape.uniform(4, 512, q_len=2, heads=64, kv_format="mxfp4")
    d = Dispatcher(table + [_triton_winner(elsewhere, first, 20.0, wrong=(Q4H32,))], "cpu",
                   kv_format="bf16")
    chain = d.decisions(Q4H32)
    assert chain[0].reason == "transfer" and first not in [x.config for x in chain]
    assert d.trust("triton", first, Q4H32) is None


def test_the_heuristic_covers_the_rows_with_the_occupancy_models_splits(standin):
    d = _as_h200(Dispatcher([], "cpu", kv_format="bf16"))
    for shape, block_m in ((Q4H32, 32), (Shape.uniform(2, 256), 16),
                           (Shape.uniform(8, 1024, q_len=2, heads=16), 32)):
        h = d.decide(shape)
        rows = shape.q_len * shape.heads
        assert (h.reason, h.backend, h.config["block_m"]) == ("heuristic", "triton", block_m)
        want = occupancy_splits(shape.batch, rows, shape.kv_len, 132, rows_per_block=block_m)
        assert f"{want:.3g} split(s) over 132 " in h.detail
        feasible = {c["num_splits"] for c in standin.candidates(shape, d.device)
                    if c["block_m"] == block_m and c["num_splits"]}
        assert h.config["num_splits"] == min(
            feasible, key=lambda n: abs(math.log2(n) - math.log2(want)))


def test_the_nearest_variant_in_the_family_gets_the_models_split_count_first(standin):
    tuned = Shape.uniform(64, 1024)  # 4 splits: 256 programs, two waves of the H200
    d = _as_h200(Dispatcher([_triton_winner(tuned, SWEPT_Q1H16, 25.0)], "cpu",
                            kv_format="bf16"))
    call = Shape.uniform(4, 1024)  # 16x fewer sequences: the model wants more splits
    chain = [x for x in d.decisions(call) if x.reason == "nearest"]
    _, want = model_knobs(4, 16, 1024, 132, {16}, (SWEPT_Q1H16, 64, 16, 1024), max_splits=32)
    assert want > 4 * 4
    assert chain[0].config == dict(SWEPT_Q1H16, num_splits=32)
    assert chain[0].tuned_shape == tuned and "row model" in chain[0].detail
    # Then the other moved alternatives, then the tuned variant itself, as tuned.
    assert chain[-1].config == SWEPT_Q1H16 and "as tuned" in chain[-1].detail
    assert all("row model" in x.detail for x in chain[:-1])


def test_a_neighbouring_family_at_the_calls_size_beats_its_own_family_far_away(standin):
    # The call's family is tuned 8x away in batch only; a family with twice the heads is
    # tuned at the call's own batch and KV length: its variant moves first.
    far, beside = Shape.uniform(32, 1024), Shape.uniform(4, 1024, heads=32)
    wide = dict(SWEPT_Q1H16, num_splits=8)
    d = _as_h200(Dispatcher([_triton_winner(far, SWEPT_Q1H16, 25.0),
                             _triton_winner(beside, wide, 15.0)], "cpu", kv_format="bf16"))
    chain = d.decisions(Shape.uniform(4, 1024))
    assert chain[0].reason == "transfer" and chain[0].tuned_shape == beside
    assert [x.tuned_shape for x in chain if x.reason == "nearest"][-1] == far
    assert chain[0].config["block_m"] == 16 and "another q_len/heads family" in \
        chain[0].detail


def test_formats_without_a_winner_in_the_family_compare_their_transfer_sources(standin):
    src = Shape.uniform(2, 256)
    d = Dispatcher([_triton_winner(src, SWEPT_Q1H16, 30.0),
                    _triton_winner(src.with_format("fp8"),
                                   dict(SWEPT_Q1H16, compute="fp8", kv_load="pointer"), 10.0)],
                   "cpu")
    assert d.choose_format(Q4H32, ["bf16", "fp8", "mxfp4"]).value == "fp8"
    wide = dict(SWEPT_Q1H16, block_m=32, num_warps=8, block_n=64, kv_load="tma")
    exact = Dispatcher([_triton_winner(Q4H32, wide, 40.0),
                        _triton_winner(src.with_format("fp8"),
                                       dict(SWEPT_Q1H16, compute="fp8", kv_load="pointer"),
                                       10.0)], "cpu")
    assert exact.choose_format(Q4H32, ["bf16", "fp8"]).value == "bf16"  # exact first


def test_route_command_shows_the_transfer(standin, tmp_path):
    path = tmp_path / "w.json"
    write_winners_json([_triton_winner(Shape.uniform(2, 256), SWEPT_Q1H16, 12.0)], path)
    r = runner.invoke(app, ["route", "--shape", "2x256", "--q-len", "4", "--heads", "32",
                            "--kv-format", "bf16", "--winners", str(path), "--device", "cpu"])
    assert r.exit_code == 0, r.output
    first, why = r.stdout.splitlines()[1:3]
    assert first.startswith("2x256 bf16 h32 q4: triton block_m=32 block_n=64")
    assert why.startswith("  why: transfer: ") and "family 2x256 bf16 h16 q1 (" in why
    assert r.stdout.count("(transfer)") == 2 and "(heuristic)" in r.stdout


def test_named_dbs_are_layered_like_the_default_ones(tmp_path):
    cpu, sw = current_device("cpu"), current_software()
    a, b = Shape.uniform(4, 256), Shape.uniform(2, 64)
    for name, shape, us in (("new.db", a, 8.0), ("old.db", a, 20.0), ("old.db", b, 5.0)):
        with TuningStore(str(tmp_path / name)) as store:
            _record_winner(store, cpu, sw, shape, median_us=us)
    d = Dispatcher.from_db([str(tmp_path / "new.db"), str(tmp_path / "old.db")], "cpu")
    assert d.loaded == 2 and d.origin.count("sqlite") == 2
    assert (d.decide(a).tuned_us, d.decide(b).tuned_us) == (8.0, 5.0)
