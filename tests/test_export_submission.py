"""`mla-tune export --submission`: the one-file submission runs where mla-tune cannot be
imported, routes like the dispatcher and is the same bytes for the same DB."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import mla_tune.dispatch as dispatch
from kernels.triton import launch
from mla_tune import routing_rules
from mla_tune.backends import get_backend
from mla_tune.cli import app
from mla_tune.db import TuningStore
from mla_tune.export_submission import SOURCES, inline_source
from mla_tune.fingerprint import DeviceFingerprint, current_device, current_software
from mla_tune.problem import Shape, generate_input
from mla_tune.reference import mla_decode_reference
from mla_tune.space import load_backend_space

ROOT = Path(__file__).resolve().parent.parent
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
cases = torch.load(sys.argv[2], weights_only=False)
import submission
outs = []
for data in cases:
    first = submission.custom_kernel(data).clone()
    again = submission.custom_kernel(data).clone()  # the cached route
    outs.append((first, again))
torch.save(outs, sys.argv[3])
"""


def _db(path: Path, winners: list[tuple[DeviceFingerprint, Shape, dict, float]]) -> str:
    """A tuning DB holding these Triton winners (measured 'ok' trials, current sources)."""
    source = get_backend("triton").source_hash()
    with TuningStore(str(path)) as store:
        sw = store.software_id(current_software())
        for device, shape, config, us in winners:
            dev = store.device_id(device)
            store.record_trial(device_id=dev, software_id=sw, shape_key=shape.key,
                               shape_json=shape.to_json(), kv_format=shape.kv_format.value,
                               backend="triton", source_hash=source, config=config,
                               status="ok", stats={"median_us": us})
            store.update_winner(dev, sw, shape.key, {"triton": source})
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


def _ragged(batch_lens: tuple[int, ...], q_len: int, heads: int = 16) -> tuple:
    data = generate_input(Shape(len(batch_lens), batch_lens, q_len=q_len, heads=heads), seed=3)
    return data


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
    cases = [generate_input(Shape.uniform(2, 64), seed=4),      # exact
             _ragged((64, 40, 33), q_len=1)]                      # nearest (ragged)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    outs, err = _run_isolated(sub, cases, run_dir, {"TRITON_INTERPRET": "1",
                                                    "MLA_TUNE_TRACE": "1"})
    _check(cases, outs)
    routes = [line for line in err.splitlines() if line.startswith("mla-tune route:")]
    assert len(routes) == 2 and "-> exact" in routes[0] and "-> nearest" in routes[1], err


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


def test_routing_rules_are_stdlib_only_and_the_dispatchers() -> None:
    tree = ast.parse(Path(routing_rules.__file__).read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}, imported
    assert dispatch.occupancy_splits is routing_rules.occupancy_splits
    for s in (Shape.uniform(4, 1024, q_len=2, heads=32), Shape((3), (5, 9, 7), q_len=1)):
        assert routing_rules.shape_key(s.batch, s.kv_lens, s.q_len, s.heads,
                                       s.kv_format.value, s.page_size) == s.key
    # The inlined sources keep no in-project import.
    for p in SOURCES:
        assert "import mla_tune" not in inline_source(p)
        assert "from mla_tune" not in inline_source(p)
        assert "from kernels" not in inline_source(p)


@pytest.mark.parametrize("shape", [Shape.uniform(4, 1024), Shape.uniform(2, 64, q_len=4),
                                   Shape((2), (64, 40)), Shape.uniform(8, 96, heads=128),
                                   Shape.uniform(2, 256, kv_format="fp8"),
                                   Shape.uniform(2, 256, kv_format="mxfp4", q_len=2)])
def test_launch_feasibility_matches_the_triton_family(shape: Shape) -> None:
    family = get_backend("triton")
    grid = list(load_backend_space("triton", "cuda").grid())
    ours = [launch.variant_feasible(shape.kv_format.value, shape.kv_lens, shape.q_len,
                                    shape.heads, shape.page_size, c) for c in grid]
    assert ours == [family.feasible(shape, c) for c in grid]
    from mla_tune.backends.triton_family import kernel_config
    for c in grid[:: max(1, len(grid) // 40)]:
        assert launch.variant_config(shape.kv_format.value, shape.page_size, c) == \
            kernel_config(shape, c)


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
    import importlib.util

    db = _db(tmp_path / "t.db", [(H200, Shape.uniform(4, 1024), TRITON_CFG, 20.0)])
    sub = _export(db, tmp_path / "checked_submission.py")
    spec = importlib.util.spec_from_file_location("checked_submission", sub)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "checked_submission", mod)  # its dataclasses look it up
    spec.loader.exec_module(mod)
    q, kv, qo, kvp, cfg = generate_input(Shape.uniform(2, 64), seed=5)
    bad = [((q.float(), kv, qo, kvp, cfg), "q has dtype"),
           ((q, kv, qo, kvp.to(torch.int64), cfg), "kv_indptr has dtype"),
           ((q, kv, qo, torch.tensor([0, 64, 200], dtype=torch.int32), cfg), "kv_indptr must"),
           ((q, {"fp16": kv["bf16"]}, qo, kvp, cfg), "kv_data holds none"),
           ((q, kv, qo, kvp, {**cfg, "num_heads": 32}), "q has shape"),
           ((q, kv, qo, kvp), "data must be the tuple")]
    for data, message in bad:
        with pytest.raises(ValueError, match=message):
            mod.custom_kernel(data)
    assert not mod._routes  # nothing was cached for a refused call
    out = mod.custom_kernel((q, kv, qo, kvp, cfg))
    torch.testing.assert_close(out.float(), mla_decode_reference(q, kv, qo, kvp, cfg),
                               atol=2e-2, rtol=2e-2)


def test_file_never_routes_to_a_variant_stored_wrong(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Config A won 2x64 and was stored wrong at 2x128; config B won 2x256. At 2x128 (A's
    tie in distance, and the smaller shape) and at 4x128 (A suspect in that family) the
    file's nearest route is B, as the dispatcher's is."""
    import importlib.util

    cpu = current_device("cpu")
    cfg_b = {**TRITON_CFG, "num_splits": 1}
    path = tmp_path / "t.db"
    db = _db(path, [(cpu, Shape.uniform(2, 64), TRITON_CFG, 5.0),
                    (cpu, Shape.uniform(2, 256), cfg_b, 9.0)])
    wrong = Shape.uniform(2, 128)
    with TuningStore(db) as store:
        store.record_trial(device_id=store.device_id(cpu),
                           software_id=store.software_id(current_software()),
                           shape_key=wrong.key, shape_json=wrong.to_json(), kv_format="bf16",
                           backend="triton", source_hash=get_backend("triton").source_hash(),
                           config=TRITON_CFG, status="wrong", error="mismatch")
    sub = _export(db, tmp_path / "trust_submission.py")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the router may pick Triton on this CPU
    spec = importlib.util.spec_from_file_location("trust_submission", sub)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "trust_submission", mod)
    spec.loader.exec_module(mod)
    for batch in (2, 4):
        first = mod._router.decisions("bf16", batch, (128,) * batch, 1, 16)[0]
        assert first[:2] == ("nearest", cfg_b), first
    exact = mod._router.decisions("bf16", 2, (64, 64), 1, 16)[0]
    assert exact[:2] == ("exact", TRITON_CFG)
    heur = mod._router.decisions("bf16", 2, (128, 128), 1, 16)
    assert all(c != TRITON_CFG for _, c, _ in heur)
