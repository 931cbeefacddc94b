"""TMA loads and the programmatic dependent launch (PDL) of the merge: what each compiles to
on sm_90 and gfx950 (CPU, cross-compiled), and that both give the reference's output on a
GPU, including a cache followed by NaN rows that a load past a split's end would pick up.

The compiles run in a child process: Triton kernels must be defined without
TRITON_INTERPRET, whatever other tests in this process do."""

from __future__ import annotations

import json

import pytest

from tests.compiled_child import run_compiled

pytest.importorskip("triton")

_PROBE = r"""
import json
from mla_tune.kernels.triton import mla_decode as md
from mla_tune.kernels.triton.precompile import jit_compile

out = {}
for target in ("cuda:90", "hip:gfx950"):
    for load in ("pointer", "tma", "tma_host"):
        cfg = md.KernelConfig(block_n=32, num_stages=3, kv_load=load)
        split, merge = [jit_compile(fn, target, args, kw) for fn, args, kw in
                        md.kernel_launches(cfg, heads=16, paged=False, merge=True,
                                           target=target)]
        text = split.asm.get("ptx", split.asm.get("amdgcn", ""))
        mtext = merge.asm.get("ptx", merge.asm.get("amdgcn", ""))
        out[f"{target}/{load}"] = {
            "descriptor_writes": text.count("tensormap.replace"),
            "bulk_tensor": text.count("cp.async.bulk.tensor"),
            "cp_async": text.count("cp.async.cg") + text.count("cp.async.ca"),
            "launch_dependents": "griddepcontrol.launch_dependents" in text,
            "merge_pdl": bool(getattr(merge.metadata, "launch_pdl", False)),
            "merge_wait": "griddepcontrol.wait" in mtext,
        }
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def compiled() -> dict[str, dict]:
    proc = run_compiled(["-c", _PROBE], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_tma_variant_loads_tiles_with_bulk_tensor_copies_on_sm90(compiled: dict) -> None:
    tma, ptr = compiled["cuda:90/tma"], compiled["cuda:90/pointer"]
    assert tma["bulk_tensor"] > 0 and tma["cp_async"] == 0, tma
    assert ptr["bulk_tensor"] == 0 and ptr["cp_async"] > 0, ptr


def test_tma_host_takes_its_descriptors_from_the_launch_and_tma_makes_its_own(
        compiled: dict) -> None:
    host, own = compiled["cuda:90/tma_host"], compiled["cuda:90/tma"]
    assert host["descriptor_writes"] == 0 and host["bulk_tensor"] > 0, host
    assert own["descriptor_writes"] > 0 and own["bulk_tensor"] > 0, own


def test_merge_is_a_programmatic_dependent_launch_on_sm90_only(compiled: dict) -> None:
    nv, amd = compiled["cuda:90/pointer"], compiled["hip:gfx950/pointer"]
    assert nv["merge_pdl"] and nv["merge_wait"] and nv["launch_dependents"], nv
    assert not (amd["merge_pdl"] or amd["merge_wait"] or amd["launch_dependents"]), amd


RAGGED = (1000, 37, 300, 5)
"""Partial last tiles in every split layout."""
WHOLE_TILES = (1024, 64, 320, 128)
"""Multiples of 32 and 64 keys: what kv_load='tma_host' needs."""


@pytest.mark.parametrize("kv_lens,cfg_kw", [
    (RAGGED, dict(kv_load="tma", num_splits=3)),
    (RAGGED, dict(kv_load="tma", num_splits=1, block_n=64, num_stages=2)),
    (RAGGED, dict(kv_load="tma", num_splits=4, fast_mode=True)),
    (WHOLE_TILES, dict(kv_load="tma_host", num_splits=3)),
    (WHOLE_TILES, dict(kv_load="tma_host", num_splits=1, block_n=64, num_stages=2)),
    (WHOLE_TILES, dict(kv_load="tma_host", num_splits=4, block_n=32, fast_mode=True)),
    (RAGGED, dict(kv_load="pointer", num_splits=5, pdl=True)),
    (RAGGED, dict(kv_load="pointer", num_splits=5, pdl=False)),
])
def test_gpu_matches_reference_with_nan_rows_after_the_cache(kv_lens: tuple[int, ...],
                                                              cfg_kw: dict) -> None:
    import torch

    if not torch.cuda.is_available() or torch.version.hip:
        pytest.skip("needs an NVIDIA GPU: TMA and PDL are sm_90 features")
    from mla_tune.kernels.triton.mla_decode import KernelConfig, MlaDecodeLauncher
    from mla_tune.problem.reference import mla_decode_reference
    from mla_tune.problem.shapes import Shape, generate_input

    shape = Shape(batch=len(kv_lens), kv_lens=kv_lens)
    q, kv_data, qo, kvp, config = generate_input(shape, seed=3)
    ref = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format="bf16").float()
    dev = torch.device("cuda")
    kv = kv_data["bf16"]
    kv = torch.cat([kv, torch.full((64,) + kv.shape[1:], float("nan"), dtype=kv.dtype)])
    launcher = MlaDecodeLauncher(KernelConfig(**cfg_kw), heads=shape.heads, q_len=1,
                                 kv_lens=list(kv_lens), device=dev)
    launcher.prepare()
    assert launcher.host_desc == (cfg_kw["kv_load"] == "tma_host")
    for _ in range(2):  # the second call reuses the scratch and the counters
        out = launcher(q.to(dev), kv.to(dev), None, None, qo.to(dev), kvp.to(dev))
        err = (out.float().cpu() - ref).abs()
        assert torch.isfinite(out).all()
        assert float(err.max()) < 0.02, float(err.max())


def test_tma_refuses_paged_layouts_and_unaligned_caches() -> None:
    import torch

    from mla_tune.kernels.triton.mla_decode import KernelConfig, MlaDecodeLauncher

    with pytest.raises(ValueError, match="paged layout"):
        MlaDecodeLauncher(KernelConfig(kv_load="tma", page_size=64), heads=16, q_len=1,
                          kv_lens=[128], device="cpu")
    for q_len, kv_lens in ((1, [128, 100]), (2, [128])):
        with pytest.raises(ValueError, match="multiple of block_n=64.*use kv_load='tma'"):
            MlaDecodeLauncher(KernelConfig(kv_load="tma_host"), heads=16, q_len=q_len,
                              kv_lens=kv_lens, device="cpu")
    launcher = MlaDecodeLauncher(KernelConfig(kv_load="tma"), heads=16, q_len=1,
                                 kv_lens=[128], device="cpu")
    kv = torch.zeros(128 * 576 + 1, dtype=torch.bfloat16)[1:].view(128, 1, 576)
    q = torch.zeros(1, 16, 576, dtype=torch.bfloat16)
    ind = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="16-byte aligned"):
        launcher(q, kv, None, None, ind, torch.tensor([0, 128], dtype=torch.int32))


@pytest.mark.parametrize("kv_lens,cfg_kw", [
    (RAGGED, dict(kv_load="tma", num_splits=1, num_stages=3)),
    (RAGGED, dict(kv_load="tma", num_splits=3, num_stages=3, fast_mode=True)),
    (WHOLE_TILES, dict(kv_load="tma_host", num_splits=1, num_stages=3)),
    (WHOLE_TILES, dict(kv_load="tma_host", num_splits=3, num_stages=3, fast_mode=True)),
    (RAGGED, dict(kv_load="pointer", num_splits=2, num_stages=3)),
])
def test_gpu_e4m3_path_matches_reference_with_nan_rows_after_the_cache(
        kv_lens: tuple[int, ...], cfg_kw: dict) -> None:
    # The e4m3 path's relabelled value dims (_dims_interleaved / _dims_natural) on the real
    # sm_90 layouts: wgmma operands from byte permutes, output stored back in natural order.
    import torch

    if not torch.cuda.is_available() or torch.version.hip:
        pytest.skip("needs an NVIDIA GPU: TMA and the e4m3 wgmma are sm_90 features")
    from mla_tune.kernels.triton.mla_decode import KernelConfig, MlaDecodeLauncher
    from mla_tune.problem.reference import mla_decode_reference
    from mla_tune.problem.shapes import Shape, generate_input

    shape = Shape(batch=len(kv_lens), kv_lens=kv_lens, kv_format="fp8")
    q, kv_data, qo, kvp, config = generate_input(shape, seed=3)
    ref = mla_decode_reference(q, kv_data, qo, kvp, config, kv_format="fp8").float()
    dev = torch.device("cuda")
    kv, scale = kv_data["fp8"]
    nan = torch.full((64,) + kv.shape[1:], float("nan")).to(kv.dtype)
    kv = torch.cat([kv, nan])
    cfg = KernelConfig(kv_format="fp8", compute="fp8", block_n=64, **cfg_kw)
    launcher = MlaDecodeLauncher(cfg, heads=shape.heads, q_len=1, kv_lens=list(kv_lens),
                                 device=dev)
    launcher.prepare()
    assert launcher.host_desc == (cfg_kw["kv_load"] == "tma_host")
    for _ in range(2):
        out = launcher(q.to(dev), kv.to(dev), scale.to(dev), None, qo.to(dev), kvp.to(dev))
        err = (out.float().cpu() - ref).abs()
        assert torch.isfinite(out).all()
        # Q and P rounded to e4m3 (the a8w8 rule): the interpreter tests' bound.
        assert float(err.max()) < 0.08, float(err.max())
