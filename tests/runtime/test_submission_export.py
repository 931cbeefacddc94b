"""`mla-tune export --submission`: the one-file submission runs where mla-tune cannot be
imported, routes (uniform and ragged calls) and checks inputs like the dispatcher, and is the
same bytes for the same DB. The tests run on any machine: a module-loaded file runs on the
GPU where there is one (the interpreter test hides it)."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from typer.testing import CliRunner

import mla_tune.runtime.dispatcher as dispatch
from mla_tune.backends import get_backend
from mla_tune.cli.main import app
from mla_tune.db import TrialGroup, TrialResult, TuningStore
from mla_tune.machine.fingerprint import DeviceFingerprint, current_device, current_software
from mla_tune.problem import shapes as problem
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import KVFormat, Shape, generate_input
from mla_tune.results.selection import update_winner
from mla_tune.runtime import bucket_rules, buckets, input_checks, routing_rules
from mla_tune.runtime.buckets import Bucket, router_for
from mla_tune.runtime.submission_export import SOURCES, inline_source

ROOT = Path(__file__).resolve().parents[2]
runner = CliRunner()
H200 = DeviceFingerprint("nvidia", "NVIDIA H200", "sm_90", 132, 150109880320)
TRITON_CFG = {"block_m": 16, "block_n": 32, "compute": "bf16", "fast_mode": False,
              "fp8_convert": "staged", "kv_load": "pointer", "num_splits": 2,
              "num_stages": 2, "num_warps": 4, "page_size": 1}

CHILD = r"""
import importlib.util, json, sys
sys.path[:] = json.loads(sys.argv[1])
if importlib.util.find_spec("mla_tune") is not None or importlib.util.find_spec("kernels"):
    sys.exit(3)
import torch
import submission
cases = torch.load(sys.argv[2], weights_only=False, map_location=submission._router.device)
outs = []
for data in cases:
    first = submission.custom_kernel(data).clone().cpu()
    again = submission.custom_kernel(data).clone().cpu()  # the cached route (or bucket)
    outs.append((first, again))
torch.save(outs, sys.argv[3])
"""


def _full(config: dict) -> dict:
    """A stored config as both routers hold it: the knobs it predates (TRITON_CFG has no
    pdl or seg_cost) spelled out with their defaults."""
    from mla_tune.kernels.triton.launch import KNOB_DEFAULTS

    return {**KNOB_DEFAULTS, **config}


def _db(path: Path, winners: list[tuple[DeviceFingerprint, Shape, dict, float]]) -> str:
    """A tuning DB holding these Triton winners (measured 'ok' trials, current sources)."""
    source = get_backend("triton").source_hash()
    with TuningStore(str(path)) as store:
        sw = store.software_id(current_software())
        for device, shape, config, us in winners:
            dev = store.device_id(device)
            store.record_trial(TrialGroup(dev, sw, shape.key, "triton", source),
                               TrialResult(shape.to_json(), shape.kv_format.value, config, "ok",
                                           stats={"median_us": us}))
            update_winner(store, dev, sw, shape.key, {"triton": source})
    return str(path)


def _export(db: str, out: Path, *extra: str) -> Path:
    r = runner.invoke(app, ["export", "--db", db, "--submission", str(out), *extra])
    assert r.exit_code == 0, r.output
    return out


def _run_isolated(sub: Path, cases: list, tmp: Path, env: dict[str, str]) -> tuple[list, str]:
    """Run the submission's custom_kernel on `cases` in a Python whose path holds the
    submission's folder and the interpreter's own libraries, not the project."""
    (tmp / "submission.py").write_bytes(sub.read_bytes())
    torch.save(cases, tmp / "cases.pt")
    path = [str(tmp)] + [p for p in sys.path if p and Path(p).resolve() != ROOT
                         and Path(p).is_dir() and not (Path(p) / "mla_tune").exists()]
    child = tmp / "child.py"
    child.write_text(CHILD)
    base = {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "TRITON_INTERPRET", "MLA_TUNE_TRACE")}
    r = subprocess.run([sys.executable, "-I", "-S", str(child), json.dumps(path),
                        str(tmp / "cases.pt"), str(tmp / "outs.pt")], cwd=tmp,
                       env={**base, **env}, capture_output=True, text=True, timeout=600)
    assert r.returncode != 3, "mla_tune was importable in the isolated Python"
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(tmp / "outs.pt", weights_only=False), r.stderr


def _ragged(batch_lens: tuple[int, ...], q_len: int, heads: int = 16, seed: int = 3,
            device: str | torch.device = "cpu") -> tuple:
    return generate_input(Shape(len(batch_lens), batch_lens, q_len=q_len, heads=heads),
                          seed=seed, device=device)


def _local() -> tuple[str, dict[str, str]]:
    """Where a submission loaded in this process runs (the GPU if there is one) and the
    environment its Triton kernels need there (the interpreter on a CPU)."""
    if torch.cuda.is_available():
        return "cuda", {}
    return "cpu", {"TRITON_INTERPRET": "1"}


def _load(sub: Path, monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """Import an exported file as a module (its dataclasses look it up in sys.modules)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(sub.stem, sub)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, sub.stem, mod)
    spec.loader.exec_module(mod)
    return mod


def _check(cases: list, outs: list, fmt: str = "bf16", atol: float = 2e-2) -> None:
    for data, (first, again) in zip(cases, outs):
        q, kv, qo, kvp, cfg = data
        ref = mla_decode_reference(q, kv, qo, kvp, cfg, fmt)
        assert first.dtype == torch.bfloat16 and first.shape == ref.shape
        torch.testing.assert_close(first.float(), ref, atol=atol, rtol=2e-2)
        assert torch.equal(first, again)


def test_file_runs_without_mla_tune_on_the_torch_path(tmp_path: Path) -> None:
    db = _db(tmp_path / "h200.db", [(H200, Shape.uniform(4, 1024), TRITON_CFG, 20.0)])
    sub = _export(db, tmp_path / "sub.py", "--suite", "tiny", "--leaderboard", "lb-x",
                  "--gpu", "H200")
    text = sub.read_text()
    assert text.startswith("#!POPCORN leaderboard lb-x\n#!POPCORN gpu H200\n")
    assert "b4-q1-kv1024-h16-bf16-p1" in text and "NVIDIA H200" in text
    cases = [generate_input(Shape.uniform(2, 64), seed=1),
             _ragged((40, 64, 17), q_len=2),
             generate_input(Shape.uniform(1, 48, q_len=4, heads=32), seed=2)]
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outs, _ = _run_isolated(sub, cases, run_dir, {})
    _check(cases, outs)


def test_file_runs_its_triton_kernels_under_the_interpreter(tmp_path: Path) -> None:
    cpu = current_device("cpu")
    db = _db(tmp_path / "cpu.db", [(cpu, Shape.uniform(2, 64), TRITON_CFG, 5.0)])
    sub = _export(db, tmp_path / "sub.py")
    cases = [generate_input(Shape.uniform(2, 64), seed=4),  # exact
             _ragged((128, 100, 90), q_len=1),                # bucket 3x(64,128]: nearest
             _ragged((120, 96, 104), q_len=1, seed=5)]        # the same bucket's runner
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outs, err = _run_isolated(sub, cases, run_dir, {"TRITON_INTERPRET": "1",
                                                    "MLA_TUNE_TRACE": "1",
                                                    "CUDA_VISIBLE_DEVICES": "",
                                                    "HIP_VISIBLE_DEVICES": ""})
    _check(cases, outs)
    routes = [line for line in err.splitlines() if line.startswith("mla-tune route:")]
    assert len(routes) == 2, err  # the third call found its bucket's runner: no new route
    assert "2x64 bf16 h16 q1 -> exact" in routes[0], err
    assert "3x(64,128] bf16 h16 q1 -> nearest" in routes[1] and "'num_splits': 2" in routes[1]


def test_same_db_same_bytes_and_no_mla_tune_in_it(tmp_path: Path) -> None:
    db = _db(tmp_path / "t.db", [(H200, Shape.uniform(4, 1024), TRITON_CFG, 20.0),
                                 (H200, Shape.uniform(32, 8192), TRITON_CFG, 90.0)])
    a = _export(db, tmp_path / "a.py", "--suite", "leaderboard-v2").read_bytes()
    b = _export(db, tmp_path / "b.py", "--suite", "leaderboard-v2").read_bytes()
    assert a == b
    tree = ast.parse(a.decode())
    roots = {alias.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for alias in n.names}
    roots |= {(n.module or "").split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom)}
    assert roots <= set(sys.stdlib_module_names) | {"torch", "triton", "__future__"}, roots
    assert b"import mla_tune" not in a and b"from mla_tune" not in a
    assert b"32x8192 h16 q1: runs bf16; bf16 exact 90.0 us" in a


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    out = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    return out | {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}


def test_shared_rules_are_the_dispatchers_and_import_nothing_the_file_lacks() -> None:
    stdlib = set(sys.stdlib_module_names) | {"__future__"}
    for mod in (routing_rules, bucket_rules):
        assert {n.split(".")[0] for n in _imports(Path(mod.__file__))} <= stdlib, mod
    checks = _imports(Path(input_checks.__file__))
    assert {n.split(".")[0] for n in checks} <= stdlib | {"torch", "mla_tune"}
    assert {n for n in checks if n.startswith("mla_tune")} == {"mla_tune.runtime.routing_rules"}
    # One source: the dispatcher and its bucket router run these very functions.
    assert dispatch.occupancy_splits is routing_rules.occupancy_splits
    assert dispatch._check_tensor is input_checks.check_tensor
    assert dispatch._config_values is input_checks.check_config
    assert buckets.bucket_config is bucket_rules.bucket_config
    assert buckets.BucketEdges().kv == bucket_rules.DEFAULT_KV_EDGES
    assert input_checks.TASK_SM_SCALE == problem.SM_SCALE
    assert input_checks.TASK_FIXED_FIELDS == {
        "num_kv_heads": 1, "qk_head_dim": problem.QK_HEAD_DIM,
        "kv_lora_rank": problem.KV_LORA_RANK, "qk_rope_head_dim": problem.QK_ROPE_HEAD_DIM,
        "v_head_dim": problem.V_HEAD_DIM}
    for s in (Shape.uniform(4, 1024, q_len=2, heads=32), Shape((3), (5, 9, 7), q_len=1)):
        assert routing_rules.shape_key(s.batch, s.kv_lens, s.q_len, s.heads,
                                       s.kv_format.value, s.page_size) == s.key
    # The inlined sources keep no in-project import, at any depth.
    for p in SOURCES:
        tree = ast.parse(inline_source(p))
        names = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        names |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert not {n for n in names if n.split(".")[0] in ("mla_tune", "kernels")}, p


def test_file_routes_ragged_calls_by_the_dispatchers_buckets(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Winners at 2x64, 2x256 and on a ragged batch 3x(700, 900, 1000): for each bucket, the
    file's tuned bucket routes (the bucket's ragged winner, then the nearest uniform winners,
    each made length-independent) are the dispatcher's bucket router's, in order."""
    dev, env = _local()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("MLA_TUNE_KV_BUCKETS", raising=False)
    here = current_device(dev)
    cfg_b = {**TRITON_CFG, "num_splits": 1}
    cfg_r = {**TRITON_CFG, "num_splits": 1, "fast_mode": True}
    db = _db(tmp_path / "t.db", [(here, Shape.uniform(2, 64), TRITON_CFG, 5.0),
                                 (here, Shape.uniform(2, 256), cfg_b, 9.0),
                                 (here, Shape(3, (700, 900, 1000)), cfg_r, 30.0)])
    sub = _export(db, tmp_path / "bucket_submission.py")
    mod = _load(sub, monkeypatch)
    router = router_for(dispatch.Dispatcher.from_db(db, device=dev))
    seen = set()
    for batch, lo, hi in ((3, 512, 1024), (3, 64, 128), (2, 32, 64), (4, 128, 256),
                          (8, 2048, 4096)):
        want = [(d.reason, d.config) for d in router.decisions(
            Bucket(batch, lo, hi, 1, 16, KVFormat.BF16), paged=False)
            if d.backend == "triton" and d.reason in ("exact", "nearest")]
        got = [(r, c) for r, c, _ in mod._router.bucket_decisions("bf16", batch, lo, hi, 1, 16)
               if r in ("exact", "nearest")]
        assert got == want, (batch, lo, hi)
        seen.update(r for r, _ in got)
    assert seen == {"exact", "nearest"}  # both kinds of tuned bucket route were compared
    assert inline_source(Path(bucket_rules.__file__)).strip("\n") in sub.read_text()


def test_file_routes_untuned_uniform_calls_by_the_dispatchers_row_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Winners of two q_len/heads families: for calls of a tuned family at another size, of
    an untuned family (moved across families) and with nothing tuned in their format, the
    file's routes (nearest, transfer, heuristic; configs and order) are the dispatcher's."""
    dev, env = _local()
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    here = current_device(dev)
    db = _db(tmp_path / "t.db", [
        (here, Shape.uniform(2, 64), TRITON_CFG, 5.0),
        (here, Shape.uniform(8, 512, heads=32), {**TRITON_CFG, "num_splits": 1}, 9.0),
        (here, Shape.uniform(4, 256, q_len=2), {**TRITON_CFG, "fast_mode": True}, 7.0)])
    sub = _export(db, tmp_path / "row_model_submission.py")
    mod = _load(sub, monkeypatch)
    d = dispatch.Dispatcher.from_db(db, device=dev)
    seen = set()
    for batch, kv, q_len, heads, fmt in ((2, 128, 1, 16, "bf16"), (16, 1024, 1, 16, "bf16"),
                                         (2, 64, 4, 16, "bf16"), (4, 512, 1, 64, "bf16"),
                                         (3, 96, 2, 32, "bf16"), (2, 64, 1, 16, "fp8")):
        shape = Shape.uniform(batch, kv, q_len=q_len, heads=heads, kv_format=fmt)
        want = [(x.reason, x.config) for x in d.decisions(shape) if x.backend == "triton"]
        got = [(r, c) for r, c, _ in mod._router.decisions(fmt, batch, (kv,) * batch, q_len,
                                                            heads) if c is not None]
        assert got == want, shape.label()
        seen.update(r for r, _ in got)
    assert {"nearest", "transfer", "heuristic"} <= seen  # every kind of route was compared


def test_cli_refuses_bad_arguments(tmp_path: Path) -> None:
    db = _db(tmp_path / "t.db", [(H200, Shape.uniform(4, 1024), TRITON_CFG, 20.0)])
    for args in (["--submission", str(tmp_path / "s.py"), "--out", str(tmp_path / "w.json")],
                 ["--submission", str(tmp_path / "s.py"), "--leaderboard", "bad name"],
                 ["--out", str(tmp_path / "w.json"), "--suite", "tiny"],
                 ["--submission", str(tmp_path / "nodir" / "s.py")]):
        r = runner.invoke(app, ["export", "--db", db, *args])
        assert r.exit_code == 2, (args, r.output)
    assert not (tmp_path / "s.py").exists()


def test_first_call_checks_name_the_bad_argument(tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    db = _db(tmp_path / "t.db", [(H200, Shape.uniform(4, 1024), TRITON_CFG, 20.0)])
    mod = _load(_export(db, tmp_path / "checked_submission.py"), monkeypatch)
    dev = mod._router.device
    q, kv, qo, kvp, cfg = generate_input(Shape.uniform(2, 64), seed=5, device=dev)
    ragged = _ragged((64, 40), q_len=1, device=dev)
    elsewhere = q.cpu() if dev.type != "cpu" else q.to("meta")
    bad = [((q.float(), kv, qo, kvp, cfg), "q has dtype"),
           ((q, kv, qo, kvp.to(torch.int64), cfg), "kv_indptr has dtype"),
           ((q, kv, qo, torch.tensor([0, 64, 200], dtype=torch.int32, device=dev), cfg),
            "kv_indptr must"),
           ((q, {"fp16": kv["bf16"]}, qo, kvp, cfg), "kv_data holds none"),
           ((q, kv, qo, kvp, {**cfg, "num_heads": 32}), "q has shape"),
           ((q, kv, qo, kvp, {**cfg, "sm_scale": 0.5}), "sm_scale"),
           ((q, kv, qo, kvp, {k: v for k, v in cfg.items() if k != "v_head_dim"}),
            "lacks 'v_head_dim'"),
           ((elsewhere, kv, qo, kvp, cfg), "q is on"),
           ((q, kv, qo, kvp), "data must be the tuple"),
           ((*ragged[:3], torch.tensor([0, 64, 100], dtype=torch.int32, device=dev),
             ragged[4]), "kv_indptr must")]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            mod.custom_kernel(data)
    assert not mod._routes and not mod._router.buckets  # nothing cached for a refused call
    out = mod.custom_kernel((q, kv, qo, kvp, cfg))
    ref = mla_decode_reference(q, kv, qo, kvp, cfg)
    torch.testing.assert_close(out.float().cpu(), ref.cpu(), atol=2e-2, rtol=2e-2)


def test_file_never_routes_to_a_variant_stored_wrong(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Config A won 2x64 and was stored wrong at 2x128; config B won 2x256. At 2x128 (A's
    tie in distance, and the smaller shape) and at 4x128 (A suspect in that family) the
    file's nearest route is B, as the dispatcher's is."""
    dev, env = _local()
    here = current_device(dev)
    cfg_b = {**TRITON_CFG, "num_splits": 1}
    path = tmp_path / "t.db"
    db = _db(path, [(here, Shape.uniform(2, 64), TRITON_CFG, 5.0),
                    (here, Shape.uniform(2, 256), cfg_b, 9.0)])
    wrong = Shape.uniform(2, 128)
    with TuningStore(db) as store:
        group = TrialGroup(store.device_id(here), store.software_id(current_software()),
                           wrong.key, "triton", get_backend("triton").source_hash())
        store.record_trial(group, TrialResult(wrong.to_json(), "bf16", TRITON_CFG, "wrong",
                                              error="mismatch"))
    for k, v in env.items():  # the router may pick Triton on this machine
        monkeypatch.setenv(k, v)
    mod = _load(_export(db, tmp_path / "trust_submission.py"), monkeypatch)
    for batch in (2, 4):
        first = mod._router.decisions("bf16", batch, (128,) * batch, 1, 16)[0]
        assert first[:2] == ("nearest", _full(cfg_b)), first
    exact = mod._router.decisions("bf16", 2, (64, 64), 1, 16)[0]
    assert exact[:2] == ("exact", _full(TRITON_CFG))
    heur = mod._router.decisions("bf16", 2, (128, 128), 1, 16)
    assert all(c != _full(TRITON_CFG) for _, c, _ in heur)


def test_a_shape_won_by_another_family_carries_its_fastest_triton_trial(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """2x256's winner is the torch family's (its code cannot travel in the file): the file
    routes that shape to its fastest Triton trial, exactly, and its header says so."""
    dev, env = _local()
    here = current_device(dev)
    shape = Shape.uniform(2, 256)
    cfg_slow = {**TRITON_CFG, "num_splits": 1}
    db = _db(tmp_path / "t.db", [(here, shape, cfg_slow, 12.0), (here, shape, TRITON_CFG, 9.0)])
    with TuningStore(db) as store:
        d, sw = store.device_id(here), store.software_id(current_software())
        torch_source = get_backend("torch").source_hash()
        store.record_trial(TrialGroup(d, sw, shape.key, "torch", torch_source),
                           TrialResult(shape.to_json(), "bf16", {"num_splits": 1,
                                       "chunk_size": 0, "compute_dtype": "float32"}, "ok",
                                       stats={"median_us": 3.0}))
        update_winner(store, d, sw, shape.key,
                      {"triton": get_backend("triton").source_hash(), "torch": torch_source})
        assert [w.backend for w in store.winners()] == ["torch"]
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    sub = _export(db, tmp_path / "stand_in_submission.py")
    text = sub.read_text()
    assert "1 torch winners (only Triton kernels travel in the file)" in text
    assert "1 shapes won by such a family carry their fastest Triton trial instead" in text
    mod = _load(sub, monkeypatch)
    first = mod._router.decisions("bf16", 2, (256, 256), 1, 16)[0]
    assert first[:2] == ("exact", _full(TRITON_CFG)), first
