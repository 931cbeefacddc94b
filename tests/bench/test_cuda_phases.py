"""bench/cuda_phases.py stamps phase boundaries into a copy of a CUDA family's kernel: every
anchor must still be in the kernel once, and the patched copy must compile with a stamp at
each phase of the variants it profiles (the tile-loop and cluster phases included)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import cuda_phases
from mla_tune.backends.compiled_toolchain import compile_variant, find_compiler


@pytest.mark.parametrize("name", sorted(cuda_phases.FAMILIES))
def test_every_anchor_places_one_stamp(name: str) -> None:
    family = cuda_phases.FAMILIES[name]
    text = cuda_phases.patched_source(family, family.source.read_text())
    stamps = re.findall(r"MT_PROBE\((\d+)\);", text)
    assert len(stamps) == len(family.anchors)
    assert sorted({int(s) for s in stamps}) == sorted(family.phase_names())
    assert "__device__ unsigned long long mt_probes" in text


@pytest.mark.skipif(find_compiler("cuda") is None, reason="nvcc not installed (pip install "
                                                         "nvidia-cuda-nvcc provides it)")
@pytest.mark.parametrize("name, defines", [
    ("cuda_mma", dict(KV_FORMAT=0, BN=64, MT=1, LOAD=0, QK=1, CLUSTER=16, CLUSTER_BF16=1)),
    ("cuda_mma", dict(KV_FORMAT=2, BN=64, MT=1, LOAD=1, QK=0, CLUSTER=0, CLUSTER_BF16=0)),
    ("cuda_wgmma", dict(KV_FORMAT=1, QK_BATCH=3)),
    ("cuda_wgmma", dict(KV_FORMAT=2, QK_BATCH=2)),
])
def test_the_patched_kernel_compiles_with_its_stamps(tmp_path, name, defines) -> None:
    family = cuda_phases.FAMILIES[name]
    path = cuda_phases.write_family(family, tmp_path)
    assert path.stem == f"{name}_phases"
    report = compile_variant("cuda", [tmp_path / family.source.name,
                                      tmp_path / "mla_common.cuh"],
                             "sm_90a", ["-O3", "-std=c++17"], defines, use_cache=False)
    assert report.ok, report.error[-2000:]
    image = Path(report.image).read_bytes()
    assert b"mt_probes" in image and b"mla_split" in image
