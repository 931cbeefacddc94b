"""Every compiled variant of the Triton family's default space builds for NVIDIA sm_90 and
AMD gfx950 through Triton's cross-compilation (no GPU needed), and the precheck reports any
that spill registers or overflow shared memory instead of letting them reach a GPU.

The compiles run in child processes (`python -m mla_tune.tuning.triton_variants`, two workers, and
spawned pools): Triton kernels must be defined without TRITON_INTERPRET, whatever other tests
do. The report cache is shared by concurrent sweeps and workers, so it is tested under
concurrency too."""

from __future__ import annotations

import ast
import json
import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from tests.compiled_child import run_compiled

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    proc = run_compiled(["-m", "mla_tune.tuning.triton_variants"], timeout=900)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows, proc.stderr[-3000:]
    return rows


def test_default_space_is_compact() -> None:
    from mla_tune.tuning.triton_variants import default_variants

    # 64 today. 16-row blocks: 12 bf16 (pointer loads and two kinds of TMA descriptors),
    # 4 MXFP4, 36 fp8 (4 compute paths, 2 conversion modes of three, TMA loads on the
    # unconverted one). 32-row blocks, 64-key tiles only: 6 bf16, 2 MXFP4, 4 fp8 (pointer
    # loads; the fp8 path and staged fp8qk).
    assert 0 < len(default_variants()) <= 64


def test_balanced_schedules_are_compiled_as_the_bucket_runners_run_them() -> None:
    """The static check's balanced kernels are the ones a BalancedLauncher builds: its
    config ('tma_host' as 'tma'; from a page pool TMA where mla_decode.pool_tma says so,
    else pointer loads, a page index per tile where paged_tiles says so), page-table flag
    and batch bound; 192 of them today (36 + 36 + 32 fp8, 12 + 8 + 6 bf16, 6 + 6 + 6
    MXFP4 over a contiguous cache, a page pool, and a pool read a page index per tile,
    with runs along the stream, and 44 with chunked runs, one per format, compute path,
    row block, schedule, page form, load kind and conversion: the merge launch leaves the
    split kernel as it is)."""
    from mla_tune.kernels.triton import mla_decode as md
    from mla_tune.kernels.triton.static_check import _launch_form, compiled_key
    from mla_tune.tuning.triton_variants import balanced_variants

    variants = balanced_variants()
    assert 0 < len(variants) <= 192
    assert {s for _, s in variants} == {md.SCHED_TOKENS, md.SCHED_PAGED}
    assert {c.page_rows for c, s in variants if s == md.SCHED_PAGED} == {"key", "tile"}
    chunked = [(c, s) for c, s in variants if c.bucket_runs == "chunks"]
    assert {(c.kv_format, s, _launch_form(c, s)[0].kv_load, _launch_form(c, s)[1])
            for c, s in chunked} == {
        (c.kv_format, s, _launch_form(c, s)[0].kv_load, _launch_form(c, s)[1])
        for c, s in variants}  # every format, schedule, load kind and page form
    for cfg in (md.KernelConfig("bf16", "bf16", block_n=64, kv_load="tma_host"),
                md.KernelConfig("bf16", "bf16", block_n=32, num_stages=3, kv_load="tma"),
                md.KernelConfig("fp8", "fp8", block_n=64, num_stages=3, kv_load="tma"),
                md.KernelConfig("mxfp4", "bf16", block_n=64),
                md.KernelConfig("fp8", "fp8", block_n=64, page_rows="tile"),
                md.KernelConfig("bf16", "bf16", block_n=32, page_rows="tile",
                                bucket_runs="chunks")):
        for sched, page in ((md.SCHED_TOKENS, 1), (md.SCHED_PAGED, 16), (md.SCHED_PAGED, 64)):
            runner = md.BalancedLauncher(cfg, heads=16, q_len=1, batch=8, device="cpu",
                                         sched=sched, page_size=page)
            form = _launch_form(replace(cfg, page_size=page), sched)
            assert (form[0], form[1], form[2]) == (runner.cfg, runner.paged_flag,
                                                    runner.batch_p2)
            assert runner.cfg.tma() == (cfg.tma() and (sched == md.SCHED_TOKENS or (
                page >= cfg.block_n and (cfg.block_n < 64 or cfg.kv_format == "fp8"))))
            tiles = cfg.page_rows == "tile" and sched == md.SCHED_PAGED and \
                page >= cfg.block_n and not runner.cfg.tma()
            assert runner.paged_flag == (md.PAGE_TILES if tiles else md.PAGE_INDEX
                                         if sched == md.SCHED_PAGED else False)
            assert runner.chunks == (cfg.bucket_runs == "chunks")
        # Per-sequence splits keep their old cache keys; the schedules get their own.
        keys = {compiled_key(cfg, sched=s) for s in (md.SCHED_SPLITS, md.SCHED_TOKENS,
                                                       md.SCHED_PAGED)}
        assert len(keys) == 3 and compiled_key(cfg) == compiled_key(cfg, sched=md.SCHED_SPLITS)


def test_kernels_do_not_import_the_tuner() -> None:
    """kernels/ is imported by the backends, so it must not import mla_tune back."""
    for path in (ROOT / "kernels").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            assert not [n for n in names if n.split(".")[0] == "mla_tune"], (path, names)


def test_every_variant_compiles_for_both_targets(reports: list[dict]) -> None:
    from mla_tune.tuning.triton_variants import default_variants

    from mla_tune.tuning.triton_variants import balanced_variants

    failed = [(r["config"], r["schedule"], r["report"]["error"]) for r in reports
              if not r["report"]["ok"]]
    assert not failed, failed[:3]
    assert len(reports) == 2 * (len(default_variants()) + len(balanced_variants()))
    assert {r["report"]["target"] for r in reports} == {"cuda:90", "hip:gfx950"}
    assert {r["schedule"] for r in reports} == {"splits", "tokens", "paged"}


def test_resources_are_recorded_and_problems_reported(reports: list[dict]) -> None:
    from mla_tune.kernels.triton.static_check import SHARED_LIMIT, CompileReport

    for row in reports:
        rep = CompileReport(**row["report"])
        assert rep.registers > 0 and rep.shared > 0, row
        if rep.spills or rep.shared > SHARED_LIMIT[rep.target]:
            assert rep.problem(), row  # the sweep will skip it before using the GPU
        else:
            assert rep.problem() is None, row


BOTH = ("cuda:90", "hip:gfx950")


@pytest.mark.parametrize("variant, targets", [
    (("bf16", "bf16", 16, 32, 3, "staged", "pointer"), BOTH),
    (("bf16", "bf16", 16, 32, 3, "staged", "tma"), BOTH),
    # bf16 4x1024's fastest TMA variant on the H200; gfx950 spills its 64-key tiles (7).
    (("bf16", "bf16", 16, 64, 2, "staged", "tma_host"), ("cuda:90",)),
    # fp8's fastest at long sequences.
    (("fp8", "fp8", 16, 64, 3, "staged", "tma"), BOTH),
    # fp8's fastest path at long sequences, at 255 registers on sm_90: one more spills.
    (("fp8", "fp8qk", 16, 64, 3, "operand", "pointer"), BOTH),
    # MXFP4's fastest at long sequences on the H200 once its tile is decoded in parts
    # (decoded whole: 8 B of spills). gfx950 spills it (9) and takes other variants.
    (("mxfp4", "bf16", 16, 64, 2, "staged", "pointer"), ("cuda:90",)),
    # 32-row blocks: bf16's and MXFP4's fastest at most shapes of 32 or more rows per
    # sequence on the H200 (bench/results/coverage_and_fallbacks.md); gfx950 spills them.
    (("bf16", "bf16", 32, 64, 2, "staged", "tma"), ("cuda:90",)),
    (("mxfp4", "bf16", 32, 64, 2, "staged", "pointer"), ("cuda:90",)),
])
def test_measured_best_variants_are_clean(reports: list[dict], variant: tuple,
                                          targets: tuple[str, ...]) -> None:
    """The variants the H200 measurements favour must not be pruned on the targets named."""
    from mla_tune.kernels.triton.static_check import CompileReport

    good = {r["report"]["target"]: CompileReport(**r["report"]) for r in reports
            if r["schedule"] == "splits" and (r["config"]["kv_format"], r["config"]["compute"], r["config"]["block_m"],
                r["config"]["block_n"], r["config"]["num_stages"], r["config"]["fp8_convert"],
                r["config"]["kv_load"]) == variant}
    assert set(good) == set(BOTH), good  # compiled for both targets all the same
    assert all(good[t].problem() is None for t in targets), good


# --- the report cache under concurrency --------------------------------------------------

def _tiny():
    """The cheapest default-space variant to compile (bf16, 32-token tiles)."""
    from mla_tune.kernels.triton.mla_decode import KernelConfig

    return KernelConfig(kv_format="bf16", compute="bf16", block_n=32, num_stages=2)


def _check_tiny(_: int) -> tuple[str | None, list[dict]]:
    """In a pool worker: `check` then `compile_variant` of the tiny variant, both targets."""
    from mla_tune.kernels.triton import static_check as sc

    problem = sc.check(_tiny(), list(sc.TARGETS))
    return problem, [asdict(sc.compile_variant(_tiny(), t)) for t in sc.TARGETS]


def _resources(rep: dict) -> tuple:
    return rep["target"], rep["ok"], rep["registers"], rep["spills"], rep["shared"]


def test_cache_entries_are_replaced_atomically(tmp_path: Path) -> None:
    """Readers racing writers of one entry always read a whole report, never a partial
    file (which used to escape `precheck` and store the candidate as failed)."""
    from mla_tune.kernels.triton.static_check import CompileReport, _read_cache, _write_cache

    path = tmp_path / "static" / "entry.json"
    reports = [CompileReport("cuda:90", True, 100 + i, 0, 1000 * i, seconds=0.5)
               for i in range(2)]
    _write_cache(path, reports[0])
    done = threading.Event()
    bad: list[object] = []

    def write(rep: CompileReport) -> None:
        for _ in range(300):
            _write_cache(path, rep)

    def read() -> None:
        while not done.is_set():
            got = _read_cache(path, "cuda:90")
            if got not in reports:
                bad.append(got)

    readers = [threading.Thread(target=read) for _ in range(4)]
    writers = [threading.Thread(target=write, args=(r,)) for r in reports]
    for t in readers + writers:
        t.start()
    for t in writers:
        t.join()
    done.set()
    for t in readers:
        t.join()
    assert not bad, bad[:3]
    assert [p.name for p in path.parent.iterdir()] == ["entry.json"]  # no temp files left


@pytest.mark.parametrize("text", ["", '{"target": "cuda:90", "ok": tr', "[1, 2]",
                                  '{"target": "cuda:90", "bogus": 1}',
                                  '{"target": "hip:gfx950", "ok": true}', "\udcff"])
def test_unreadable_cache_entries_are_misses(tmp_path: Path, text: str) -> None:
    from mla_tune.kernels.triton.static_check import _read_cache

    path = tmp_path / "e.json"
    path.write_text(text, errors="surrogateescape")
    assert _read_cache(path, "cuda:90") is None
    assert _read_cache(tmp_path / "missing.json", "cuda:90") is None


def test_concurrent_checks_of_one_variant_agree_and_corrupt_entries_are_rewritten(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Several processes check the same variant at once on a fresh cache: all succeed with
    the same resources. A corrupt entry is then recompiled and rewritten, not an error."""
    from mla_tune.kernels.triton import static_check as sc

    monkeypatch.setenv("MLA_TUNE_CACHE", str(tmp_path))  # read by the spawned workers
    ctx = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(4, mp_context=ctx) as ex:
        results = list(ex.map(_check_tiny, range(8)))
        assert all(problem is None for problem, _ in results), results
        seen = {tuple(_resources(r) for r in reps) for _, reps in results}
        assert len(seen) == 1, seen
        ((cuda, hip),) = seen
        assert cuda[:2] == ("cuda:90", True) and hip[:2] == ("hip:gfx950", True)

        path = sc._cache_path(sc.compiled_key(_tiny()), "cuda:90")
        assert sc._read_cache(path, "cuda:90") is not None
        assert sorted(p.suffix for p in sc.cache_dir().iterdir()) == [".json", ".json"]
        path.write_text(path.read_text()[:20])  # what a torn write used to leave
        stamp = sc._read_cache(sc._cache_path(sc.compiled_key(_tiny()), "hip:gfx950"),
                               "hip:gfx950")
        problem, reps = ex.submit(_check_tiny, 0).result()
    assert problem is None and [_resources(r) for r in reps] == [cuda, hip]
    rewritten = sc._read_cache(path, "cuda:90")
    assert rewritten is not None and _resources(asdict(rewritten)) == cuda
    assert sc._read_cache(sc._cache_path(sc.compiled_key(_tiny()), "hip:gfx950"),
                          "hip:gfx950") == stamp  # the intact entry was reused as it was


SPILL_SITES = r"""
import json
from mla_tune.kernels.triton import mla_decode as md, static_check as sc
from mla_tune.kernels.triton.launch import variant_config
cfg = variant_config("fp8", 1, {"compute": "fp8", "block_m": 16, "block_n": 64, "num_warps": 4,
                                "num_stages": 3, "num_splits": 2, "page_size": 1,
                                "fast_mode": True, "kv_load": "pointer"})
cvt = variant_config("fp8", 1, {"compute": "bf16", "block_m": 16, "block_n": 64, "num_warps": 4,
                                "num_stages": 3, "num_splits": 2, "page_size": 1,
                                "fast_mode": True, "kv_load": "pointer"})
for name, c, sched in (("split", cfg, md.SCHED_SPLITS), ("tokens", cfg, md.SCHED_TOKENS),
                       ("converted", cvt, md.SCHED_SPLITS)):
    k = sc.compile_split(c, "cuda:90", 16, sched)
    print(json.dumps({"name": name, "bytes": sc.usage(k, "cuda:90")[1],
                      "sites": sc.spill_sites(k.asm["cubin"])}))
"""


def test_spill_sites_tell_tile_loop_spills_from_per_sequence_ones() -> None:
    """The fp8 path's split kernel is clean; its balanced schedule spills, outside the
    tile loop only; fp8 converted to bf16 spills inside it (bench/results/static_check.md)."""
    proc = run_compiled(["-c", SPILL_SITES], timeout=600)
    rows = {r["name"]: r for r in map(json.loads, (x for x in proc.stdout.splitlines()
                                                   if x.startswith("{")))}
    assert set(rows) == {"split", "tokens", "converted"}, proc.stderr[-3000:]
    assert rows["split"]["bytes"] == 0 and rows["split"]["sites"] == [0, 0]
    total, hot = rows["tokens"]["sites"]
    assert rows["tokens"]["bytes"] > 0 and total > 0 and hot == 0
    total, hot = rows["converted"]["sites"]
    assert 0 < hot <= total
