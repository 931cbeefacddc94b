"""The Gluon Hopper family (kernels/gluon, mla_tune/backends/gluon_family.py): its launch
rules, every compiled point of its default space cross-compiled for sm_90a here (no GPU),
the static check's verdicts, and, on an sm_90 GPU, its outputs against the reference."""

from __future__ import annotations

import itertools

import pytest
import torch

from mla_tune import backends as registry
from mla_tune.backends.gluon_family import GluonFamily
from mla_tune.kernels.gluon.compile import check, compile_variant
from mla_tune.kernels.gluon.launch import (SMEM_LIMIT, auto_splits, smem_bytes, variant_feasible,
                                          ws_maxnreg)
from mla_tune.problem.shapes import KVFormat, Shape, generate_input
from mla_tune.tuning.space import load_backend_space

SPACE = load_backend_space("gluon")


def _compiled_points() -> list[tuple[str, int, int, int, int, int]]:
    """(format, rows, warps, stages, bufs, ws) of every point some 8192-key shape runs."""
    pts = set()
    for fmt, cfg in itertools.product(("bf16", "fp8", "mxfp4"), SPACE.grid()):
        if variant_feasible(fmt, (8192,) * 4, 1, 128, 1, cfg):
            pts.add((fmt, cfg["rows"], cfg["warps"], cfg["stages"], cfg["bufs"], cfg["ws"]))
    return sorted(pts)


def test_feasible_points_keep_shared_memory_and_shape_rules() -> None:
    cfg = {"rows": 16, "warps": 8, "stages": 3, "bufs": 2, "splits": 1}
    assert variant_feasible("mxfp4", (8192,), 1, 16, 1, cfg)
    assert not variant_feasible("mxfp4", (8192,), 1, 16, 64, cfg)  # no page table
    assert not variant_feasible("fp8", (8192,), 1, 16, 1, cfg)  # 241 KB of shared memory
    assert not variant_feasible("bf16", (8192,), 1, 16, 1, cfg)  # bf16 has no decode buffers
    assert not variant_feasible("mxfp4", (8192,), 1, 16, 1, dict(cfg, rows=32))  # 16 rows
    assert not variant_feasible("mxfp4", (64,), 1, 16, 1, dict(cfg, splits=2))
    assert variant_feasible("mxfp4", (8192,), 1, 16, 1, dict(cfg, warps=4, ws=4))
    assert variant_feasible("mxfp4", (8192,), 1, 16, 1, dict(cfg, warps=4, ws=8))
    assert not variant_feasible("mxfp4", (8192,), 1, 16, 1, dict(cfg, warps=4, ws=2))
    assert not variant_feasible("mxfp4", (8192,), 1, 16, 1, dict(cfg, ws=4))  # 4 MMA warps
    assert not variant_feasible("bf16", (8192,), 1, 16, 1, dict(cfg, bufs=1, ws=4))
    assert not variant_feasible("fp8", (8192,), 1, 16, 1, dict(cfg, warps=4, bufs=1, ws=4))
    assert not variant_feasible("mxfp4", (8192,), 1, 16, 1, dict(cfg, warps=4, bufs=1, ws=4))
    assert (ws_maxnreg(4), ws_maxnreg(8)) == (168, 128)
    assert smem_bytes("fp8", 16, 3, 2) > SMEM_LIMIT


def test_auto_splits_fill_the_sms_within_the_tiles() -> None:
    assert auto_splits(4, 1, 8192, 132) == 33
    assert auto_splits(256, 1, 8192, 132) == 1
    assert auto_splits(4, 1, 100, 132) == 2  # two 64-key tiles


@pytest.mark.parametrize("point", _compiled_points(), ids=lambda p: "-".join(map(str, p)))
def test_every_point_compiles_for_sm90a(point: tuple[str, int, int, int, int, int]) -> None:
    fmt, rows, warps, stages, bufs, ws = point
    k = compile_variant(fmt, rows, warps, stages, bufs, ws)
    ptx = k.asm["ptx"]
    assert "wgmma.mma_async" in ptx and "cp.async.bulk.tensor" in ptx
    # The launch rules' shared-memory figure is the kernel's, barriers and scratch aside.
    assert 0 <= k.metadata.shared - smem_bytes(fmt, rows, stages, bufs) < 1024
    assert k.metadata.shared <= SMEM_LIMIT


def test_static_check_passes_eight_warps_and_names_four_warp_spills() -> None:
    cfg = {"rows": 16, "warps": 8, "stages": 3, "bufs": 2}
    assert check("mxfp4", cfg) is None
    verdict = check("fp8", dict(cfg, rows=32, warps=4, bufs=1))
    assert verdict is not None and "spill" in verdict


def test_the_family_says_why_it_cannot_run_without_a_hopper_gpu() -> None:
    b = GluonFamily()
    avail = b.available(torch.device("cpu"))
    assert not avail and "sm_90" in avail.reason
    assert b.supports(Shape(4, (1024,) * 4, page_size=64)) is not None


def test_opt_in_registration_reaches_the_family(monkeypatch: pytest.MonkeyPatch) -> None:
    assert "gluon" not in registry.backend_names()  # opt-in: see the README
    monkeypatch.setattr(registry, "_REGISTRY", dict(registry._REGISTRY))
    monkeypatch.setattr(registry, "_instances", dict(registry._instances))
    registry.register("gluon", "mla_tune.backends.gluon_family:GluonFamily")
    b = registry.get_backend("gluon")
    assert isinstance(b, GluonFamily) and b.declared_space(torch.device("cuda")).grid()


def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not _hopper(), reason="needs an sm_90 GPU (Gluon has no interpreter)")
@pytest.mark.parametrize("fmt,ws", [("bf16", 0), ("fp8", 0), ("mxfp4", 0), ("mxfp4", 4),
                                    ("mxfp4", 8)])
@pytest.mark.parametrize("q_len,heads,rows,splits", [(1, 16, 16, 1), (1, 16, 16, 3),
                                                     (4, 16, 32, 3), (1, 128, 32, 2)])
def test_outputs_match_the_reference_on_ragged_batches(fmt: str, ws: int, q_len: int,
                                                       heads: int, rows: int,
                                                       splits: int) -> None:
    from mla_tune.problem.reference import mla_decode_reference
    from mla_tune.problem.verify import check as gate
    from mla_tune.problem.verify import tolerance_for

    # Partial tiles, short sequences, splits with one tile or none.
    lens = (5, 64, 65, 700, 1500, max(1, q_len), 129)
    shape = Shape(len(lens), lens, q_len, heads, KVFormat(fmt))
    data = generate_input(shape, seed=1, device="cuda")
    cfg = {"rows": rows, "warps": 4 if ws else 8,
           "stages": 3 if rows == 16 and fmt != "bf16" else 2,
           "bufs": 2 if fmt == "mxfp4" else 1, "splits": splits, "ws": ws}
    run = GluonFamily().build(shape, cfg, torch.device("cuda"))
    res = gate(run(data), mla_decode_reference(*data, kv_format=KVFormat(fmt)),
               tolerance_for(fmt))
    assert res.ok, res
