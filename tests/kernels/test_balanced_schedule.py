"""The balanced schedules of the Triton family (SCHED_TOKENS over a contiguous cache,
SCHED_PAGED over FlashInfer's paged metadata) against the float32 reference, through the
Triton interpreter in a child process (this file run as a script): ragged batches, few and
many programs (runs crossing sequences, sequences crossing runs, idle programs), both
merges (fused, separate, separate with lazy rescaling), per-sequence setup costs, q_len 1
and 4, all three formats, shuffled page pools whose unused slots hold NaN."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

pytest.importorskip("triton")

# name: (format, lengths, q_len, page size (0: contiguous), launcher options, kernel config)
CASES: dict[str, tuple[str, tuple[int, ...], int, int, dict[str, Any], dict[str, Any]]] = {
    "tokens_bf16_3progs_merge": ("bf16", (37, 300, 5, 130), 1, 0, dict(programs=3),
                                 dict(block_n=32)),
    "tokens_bf16_3progs_fused": ("bf16", (37, 300, 5, 130), 1, 0, dict(programs=3),
                                 dict(block_n=32, fast_mode=True)),
    "tokens_bf16_lazy_separate_merge": ("bf16", (37, 300, 5, 130), 1, 0,
                                        dict(programs=5, merge="separate"),
                                        dict(block_n=32, fast_mode=True)),
    "tokens_bf16_1prog": ("bf16", (37, 300, 5, 130), 1, 0, dict(programs=1),
                          dict(block_n=32)),
    "tokens_bf16_idle_progs_no_seg_cost": ("bf16", (20, 9), 1, 0,
                                           dict(programs=40, seg_cost=0), dict(block_n=16)),
    "tokens_bf16_q4_tma_seg_cost3": ("bf16", (37, 200, 9), 4, 0,
                                     dict(programs=5, seg_cost=3),
                                     dict(block_n=32, kv_load="tma")),
    "tokens_bf16_batch40": ("bf16", tuple(5 + 7 * i for i in range(40)), 1, 0,
                            dict(programs=7), dict(block_n=16, fast_mode=True)),
    "tokens_fp8_fp8_tma": ("fp8", (60, 250, 17), 1, 0, dict(programs=4),
                           dict(compute="fp8", block_n=64, kv_load="tma")),
    "tokens_fp8_fp16_fused_q4": ("fp8", (60, 150), 4, 0, dict(programs=3),
                                 dict(compute="fp16", block_n=32, fast_mode=True)),
    "tokens_mxfp4": ("mxfp4", (70, 200, 12), 1, 0, dict(programs=4), dict(block_n=32)),
    # A sequence of NaN keys (NAN_SEQUENCE) between sequences shorter than a tile and runs
    # crossing them: no tile of a contiguous cache may read another sequence's rows.
    "tokens_fp8_fp8_tma_nan_neighbour": ("fp8", (37, 300, 20, 129), 1, 0, dict(programs=3),
                                         dict(compute="fp8", block_n=64, kv_load="tma")),
    "tokens_bf16_q4_tma_nan_neighbour": ("bf16", (20, 300, 37, 129), 4, 0, dict(programs=5),
                                         dict(block_n=32, kv_load="tma")),
    "paged_bf16_p1": ("bf16", (37, 300, 5, 130), 1, 1, dict(programs=4), dict(block_n=32)),
    "paged_bf16_p64_fused": ("bf16", (37, 300, 5, 130), 1, 64, dict(programs=4),
                             dict(block_n=32, fast_mode=True)),
    "paged_bf16_p16_q4_fused": ("bf16", (40, 180, 19), 4, 16, dict(programs=5),
                                dict(block_n=32, fast_mode=True, kv_load="tma")),
    # TMA tiles from the pool: partial last tiles mid-page (37, 300) and at a page's
    # start (70, 129), runs crossing sequences, causal rows.
    "paged_bf16_p64_q4_tma": ("bf16", (37, 300, 70, 129), 4, 64, dict(programs=5),
                              dict(block_n=32, kv_load="tma")),
    # bf16 at 64 keys keeps pointer loads from a pool (pool_tma), partial tiles included.
    "paged_bf16_p64_b64_tma": ("bf16", (37, 300, 64, 129), 1, 64, dict(programs=5),
                               dict(block_n=64, kv_load="tma", num_stages=2)),
    # fp8 64-key tiles filling a page: whole tiles through the pool's rows, partial ones
    # (37, 300, 129) through the box that stops at the sequence's end; 64: none.
    "paged_fp8_fp8_p64_b64_tma": ("fp8", (37, 300, 64, 129), 1, 64, dict(programs=5),
                                  dict(compute="fp8", block_n=64, kv_load="tma")),
    # Causal rows with 64-key tiles: runs of 3 units put the 1-key last block of 129 and
    # the 2-key last block of 66 alone in a program, whose first row block ends before
    # them (hi < lo): no tile may be read there, and the other row blocks read them.
    "paged_fp8_fp8_p64_b64_q4_tma": ("fp8", (300, 129, 66, 37), 4, 64,
                                     dict(programs=5, seg_cost=1),
                                     dict(compute="fp8", block_n=64, kv_load="tma")),
    "paged_bf16_p64_b64_q4": ("bf16", (300, 129, 66, 37), 4, 64,
                              dict(programs=5, seg_cost=1),
                              dict(block_n=64, kv_load="tma", num_stages=2)),
    "paged_fp8_fp8_p32_tma_fused": ("fp8", (37, 300, 70, 129), 1, 32, dict(programs=3),
                                    dict(compute="fp8", block_n=32, kv_load="tma",
                                         fast_mode=True)),
    "paged_fp8_fp8_p64_q4": ("fp8", (60, 250, 17), 4, 64, dict(programs=3),
                             dict(compute="fp8", block_n=64, kv_load="tma_host")),
    "paged_fp8_bf16_p16": ("fp8", (60, 150, 33), 1, 16, dict(programs=4),
                           dict(compute="bf16", block_n=32)),
    "paged_mxfp4_p16_q4": ("mxfp4", (70, 120, 12), 4, 16, dict(programs=3),
                           dict(block_n=32)),
    # One page index per tile (page_rows='tile'): partial tiles mid-page and at a page's
    # start, runs crossing sequences, causal rows whose row block ends before its run
    # (hi < lo: not even the first tile's index may be read), pages of exactly a tile.
    "paged_bf16_p64_tiles": ("bf16", (37, 300, 64, 129), 1, 64, dict(programs=5),
                             dict(block_n=32, page_rows="tile")),
    "paged_fp8_fp8_p64_b64_q4_tiles": ("fp8", (300, 129, 66, 37), 4, 64,
                                       dict(programs=5, seg_cost=1),
                                       dict(compute="fp8", block_n=64, page_rows="tile")),
    "paged_fp8_bf16_p16_tiles_fused": ("fp8", (60, 150, 33), 1, 16, dict(programs=4),
                                       dict(compute="bf16", block_n=16, fast_mode=True,
                                            page_rows="tile")),
    "paged_mxfp4_p32_q4_tiles": ("mxfp4", (70, 120, 12), 4, 32, dict(programs=3),
                                 dict(block_n=32, page_rows="tile")),
    # Chunks (bucket_runs='chunks'): each program one chunk of one sequence; sequences of
    # one chunk and of several, idle programs past the last chunk, fewer programs asked
    # for than sequences (the launcher gives each sequence one), both merges.
    "tokens_bf16_chunks_merge": ("bf16", (37, 300, 5, 130), 1, 0, dict(programs=6),
                                 dict(block_n=32, bucket_runs="chunks")),
    "tokens_bf16_chunks_fewer_programs": ("bf16", (37, 300, 5, 130), 1, 0, dict(programs=2),
                                          dict(block_n=32, bucket_runs="chunks")),
    "tokens_bf16_chunks_idle_progs": ("bf16", (20, 9), 1, 0, dict(programs=40),
                                      dict(block_n=16, bucket_runs="chunks")),
    "tokens_fp8_fp8_tma_chunks_fused_q4": ("fp8", (60, 250, 17), 4, 0, dict(programs=6),
                                           dict(compute="fp8", block_n=64, kv_load="tma",
                                                fast_mode=True, bucket_runs="chunks")),
    "tokens_fp8_fp8_tma_nan_neighbour_chunks": ("fp8", (37, 300, 20, 129), 1, 0,
                                                dict(programs=7),
                                                dict(compute="fp8", block_n=64,
                                                     kv_load="tma", bucket_runs="chunks")),
    "paged_bf16_p64_q4_tiles_chunks": ("bf16", (37, 300, 64, 129), 4, 64, dict(programs=7),
                                       dict(block_n=32, page_rows="tile",
                                            bucket_runs="chunks")),
    "paged_mxfp4_p16_chunks_lazy_separate": ("mxfp4", (70, 120, 12), 1, 16,
                                             dict(programs=5, merge="separate"),
                                             dict(block_n=32, fast_mode=True,
                                                  bucket_runs="chunks")),
}
NAN_SEQUENCE = {"tokens_fp8_fp8_tma_nan_neighbour": 1, "tokens_bf16_q4_tma_nan_neighbour": 1,
                "tokens_fp8_fp8_tma_nan_neighbour_chunks": 1}
"""Cases whose sequence of this index holds NaN keys; the others' outputs are checked."""
BOUND = {"bf16": 0.02, "mxfp4": 0.02}
"""Max abs error per format; fp8 cases by compute path (e4m3 Q and P: 0.08)."""


def _bound(fmt: str, cfg: dict[str, Any]) -> float:
    """The max abs error a case of `fmt` with kernel config `cfg` may show (BOUND)."""
    return BOUND.get(fmt) or (0.08 if cfg.get("compute") == "fp8" else 0.02)


@pytest.fixture(scope="module")
def results() -> dict[str, dict]:
    from tests.compiled_child import interpreted_rows

    return interpreted_rows(__file__, timeout=900)


@pytest.mark.parametrize("name", list(CASES))
def test_balanced_schedule_matches_reference(results: dict[str, dict], name: str) -> None:
    fmt, _, _, page, _, cfg = CASES[name]
    r = results[name]
    assert r["finite"], r  # paged: NaN in every unused slot of the pool is never read
    assert r["err"] <= _bound(fmt, cfg), r
    if page:  # TMA tiles where a tile lies inside a page (64 keys: fp8), else pointers
        tma = cfg.get("kv_load", "pointer") != "pointer" and fmt != "mxfp4" and \
            page >= cfg["block_n"] and (cfg["block_n"] < 64 or fmt == "fp8")
        assert r["tma"] == (1 if tma else 0), r
        tiles = not tma and cfg.get("page_rows") == "tile" and page >= cfg["block_n"]
        assert r["paged"] == (3 if tiles else 2), r  # PAGE_TILES or PAGE_INDEX
    assert r["chunks"] == (cfg.get("bucket_runs") == "chunks"), r


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="the compiled kernels need a CUDA GPU (the interpreter cases above "
                           "run everywhere)")
@pytest.mark.parametrize("name", list(CASES))
def test_balanced_schedule_compiled_on_the_gpu(name: str) -> None:
    """The same cases through the compiled kernels and their C launchers, as a server runs
    them: TMA boxes, pipelining and the fused merge's atomics exist only there."""
    fmt, lens, q_len, page, options, cfg = CASES[name]
    r, _ = _run_case(name, fmt, lens, q_len, page, options, cfg, seed=3, device="cuda")
    assert r["finite"], r
    assert r["err"] <= _bound(fmt, cfg), r


@pytest.mark.parametrize("row", ["second_call_other_lengths", "chunks_second_call"])
def test_a_launcher_serves_other_lengths_of_its_batch(results: dict[str, dict],
                                                      row: str) -> None:
    r = results[row]
    assert r["err"] <= 0.02 and r["finite"], r


def test_merge_mode_follows_the_partials_per_sequence() -> None:
    """Fused (with the config's fast_mode) while a sequence has few partials on average,
    the second-launch merge beyond (FUSED_MAX_PARTIALS); an explicit mode wins."""
    from mla_tune.kernels.triton.mla_decode import (
        FUSED_MAX_PARTIALS,
        BalancedLauncher,
        KernelConfig,
    )

    def mode(fast: bool, programs: int, batch: int, merge: str | None = None) -> str:
        return BalancedLauncher(KernelConfig(fast_mode=fast), heads=16, q_len=1, batch=batch,
                                device="cpu", sched=1, programs=programs, merge=merge).merge

    assert mode(True, 3 * 8, 8) == "fused"  # (24 + 8) / 8 = 4 partials per sequence
    assert mode(True, FUSED_MAX_PARTIALS * 8, 8) == "separate"
    assert mode(False, 3, 8) == "separate"
    assert mode(True, 64, 2, merge="fused") == "fused"
    launcher = BalancedLauncher(KernelConfig(fast_mode=True), heads=16, q_len=1, batch=8,
                                device="cpu", sched=1, programs=8)
    launcher.set_programs(64)  # a runtime change of the program count re-decides
    assert launcher.merge == "separate" and launcher.fast == 2


def test_bad_schedule_arguments_are_refused() -> None:
    from mla_tune.kernels.triton.mla_decode import BalancedLauncher, KernelConfig

    with pytest.raises(ValueError, match="sched must be"):
        BalancedLauncher(KernelConfig(), heads=16, q_len=1, batch=2, device="cpu", sched=0)
    with pytest.raises(ValueError, match="power of two"):
        BalancedLauncher(KernelConfig(), heads=16, q_len=1, batch=2, device="cpu", sched=2,
                         page_size=24)
    with pytest.raises(ValueError, match="merge must be"):
        BalancedLauncher(KernelConfig(), heads=16, q_len=1, batch=2, device="cpu", sched=1,
                         merge="tree")


# -- the interpreter child ---------------------------------------------------------------


def _pool(vals: Any, aux: Any, fmt: str, lens: tuple[int, ...], page: int, seed: int
          ) -> tuple[Any, Any, Any, Any]:
    """The contiguous cache copied into pages at shuffled pool positions, every unused
    slot NaN (bf16/fp8) so a tile read past a sequence's end would show; (values, aux,
    page indices, page indptr)."""
    g = torch.Generator().manual_seed(seed)
    n_pages = [-(-L // page) for L in lens]
    total = sum(n_pages) + 2
    perm = torch.randperm(total, generator=g).tolist()
    width = vals.shape[-1]
    if fmt == "mxfp4":
        flat = torch.zeros((total * page, width), dtype=vals.dtype)
        sc = torch.full((total * page, 24), 127, dtype=torch.uint8)
    else:
        flat = torch.full((total * page, width), float("nan")).to(vals.dtype)
        sc = None
    idx, indptr, start, k = [], [0], 0, 0
    for L, n in zip(lens, n_pages):
        for j in range(n):
            p = perm[k]
            k += 1
            idx.append(p)
            r0, r1 = start + j * page, start + min(L, (j + 1) * page)
            flat[p * page: p * page + r1 - r0] = vals[r0:r1].reshape(r1 - r0, width)
            if sc is not None:
                sc[p * page: p * page + r1 - r0, :aux.shape[1]] = aux[r0:r1]
        start += L
        indptr.append(len(idx))
    out_aux = aux if fmt == "fp8" else sc
    return (flat.view(total, page, width), out_aux, torch.tensor(idx, dtype=torch.int32),
            torch.tensor(indptr, dtype=torch.int32))


def _run_case(name: str, fmt: str, lens: tuple[int, ...], q_len: int, page: int,
              options: dict[str, Any], cfg: dict[str, Any], seed: int, launcher: Any = None,
              device: str = "cpu") -> tuple[dict, Any]:
    from mla_tune.kernels.triton.mla_decode import (
        SCHED_PAGED,
        SCHED_TOKENS,
        BalancedLauncher,
        KernelConfig,
    )
    from mla_tune.problem.reference import mla_decode_reference
    from mla_tune.problem.shapes import Shape, generate_input

    q, kv_data, qo, kvp, config = generate_input(Shape(len(lens), lens, q_len=q_len),
                                                 seed=seed)
    ref = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format=fmt)
    e = kv_data[fmt]
    vals, aux = (e, None) if fmt == "bf16" else e
    keep = torch.ones(ref.shape[0], dtype=torch.bool)
    if name in NAN_SEQUENCE:
        b = NAN_SEQUENCE[name]
        vals = vals.clone()
        nan_rows = slice(int(kvp[b]), int(kvp[b + 1]))
        if fmt == "bf16":
            vals[nan_rows] = float("nan")
        else:
            vals.view(torch.uint8)[nan_rows] = 0x7F  # e4m3fn NaN
        keep[int(qo[b]):int(qo[b + 1])] = False
    if launcher is None:
        launcher = BalancedLauncher(KernelConfig(kv_format=fmt, **cfg), heads=16, q_len=q_len,
                                    batch=len(lens), device=device,
                                    sched=SCHED_PAGED if page else SCHED_TOKENS,
                                    page_size=max(page, 1), **options)
        if device != "cpu":
            launcher.prepare()

    def dev(t: Any) -> Any:
        return None if t is None else t.to(device)

    scale = dev(aux) if fmt == "fp8" else None
    if page:
        pool, paux, idx, ptr = _pool(vals, aux, fmt, lens, page, seed)
        out = launcher(dev(q), dev(pool), scale, dev(paux) if fmt == "mxfp4" else None,
                       dev(qo), dev(torch.tensor(lens, dtype=torch.int32)), dev(ptr), dev(idx))
    else:
        out = launcher(dev(q), dev(vals), scale, dev(aux) if fmt == "mxfp4" else None,
                       dev(qo), dev(kvp))
    out, ref = out.float().cpu()[keep], ref[keep]
    return ({"name": name, "err": float((out - ref).abs().max()),
             "finite": bool(torch.isfinite(out).all()), "tma": launcher.constexprs["TMA"],
             "paged": int(launcher.paged_flag), "chunks": bool(launcher.chunks)},
            launcher)


def _child() -> None:
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    for name, (fmt, lens, q_len, page, options, cfg) in CASES.items():
        row, launcher = _run_case(name, fmt, lens, q_len, page, options, cfg, seed=3)
        print(json.dumps(row), flush=True)
        again = {"paged_bf16_p64_fused": "second_call_other_lengths",
                 "tokens_bf16_chunks_merge": "chunks_second_call"}.get(name)
        if again:
            # The same launcher (buffers sized for its batch) on the next lengths.
            row, _ = _run_case(again, fmt, (200, 11, 64, 301), q_len, page, options, cfg,
                               seed=4, launcher=launcher)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    _child()
