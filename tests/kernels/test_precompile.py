"""Compiling ahead without a GPU lands in Triton's cache under the key a launch looks up,
so a GPU worker loads the kernel instead of compiling it again."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("triton")


def _entries(cache) -> set[str]:
    """Triton cache groups holding a kernel binary (a launch also caches its launcher stub,
    a compiled C module, in the same folder: not a kernel compile)."""
    if not cache.exists():
        return set()
    return {d.name for d in cache.iterdir()
            if any(f.suffix in (".cubin", ".hsaco") for f in d.iterdir())}


def test_target_names_follow_device_arch() -> None:
    from mla_tune.kernels.triton.precompile import target_for_arch

    assert target_for_arch("sm_90") == "cuda:90"
    assert target_for_arch("gfx950") == "hip:gfx950"
    assert target_for_arch("sm_75") is None
    assert target_for_arch("x86_64") is None


def test_compile_ahead_fills_the_cache_once(tmp_path, monkeypatch) -> None:
    """Split and merge kernels are compiled into $TRITON_CACHE_DIR; a second compile ahead
    (a resumed sweep, another worker) is a cache hit that compiles nothing."""
    from mla_tune.kernels.triton import mla_decode as md
    from mla_tune.kernels.triton import static_check as sc

    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("MLA_TUNE_CACHE", str(tmp_path / "mla"))
    cfg = md.KernelConfig(kv_format="bf16", compute="bf16", block_n=32, num_stages=2)
    assert sc.compile_ahead(cfg, "cuda:90", heads=16) is None
    first = _entries(cache)
    assert len(first) == 2  # one cache group per kernel: split and merge
    t0 = time.perf_counter()
    assert sc.compile_ahead(cfg, "cuda:90", heads=32) is None  # same specialization
    assert time.perf_counter() - t0 < 1.0
    assert _entries(cache) == first
    # A different specialization (heads not a multiple of 16) is a different kernel.
    sc.compile_ahead(cfg, "cuda:90", heads=8)
    assert len(_entries(cache)) == 4


def test_a_launcher_finds_the_kernels_compiled_ahead(tmp_path, monkeypatch) -> None:
    """On a GPU: after compile-ahead for this device's target, building the variant adds
    nothing to Triton's cache (it loaded the compiled kernels)."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU: the launch-side cache lookup runs on a device")
    from triton.runtime import driver

    from mla_tune.kernels.triton import mla_decode as md
    from mla_tune.kernels.triton import static_check as sc

    t = driver.active.get_current_target()
    target = f"{t.backend}:{t.arch}"
    if target not in sc.TARGETS:
        pytest.skip(f"no compile-ahead target for {target}")
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setenv("MLA_TUNE_CACHE", str(tmp_path / "mla"))
    cfg = md.KernelConfig(kv_format="fp8", compute="fp16", block_n=32, num_stages=2,
                          num_splits=4)
    assert sc.compile_ahead(cfg, target, heads=16) is None
    before = _entries(cache)
    launcher = md.MlaDecodeLauncher(cfg, heads=16, q_len=1, kv_lens=[300, 77], device="cuda")
    assert launcher.separate_merge
    launcher.prepare()
    assert _entries(cache) == before
