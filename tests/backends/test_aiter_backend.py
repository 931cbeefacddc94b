"""aiter family on CPU: no AMD GPU is reachable, so what is checked is that the planned calls
bind to aiter's signatures, that the page views and metadata sizes are the ones aiter's code
asks for, and that the variants reproduce the seed submission's calls."""

import importlib.metadata
import importlib.util
import math
import sys
import types

import pytest
import torch

from mla_tune.backends import aiter_backend as ab
from mla_tune.backends import get_backend
from mla_tune.problem.shapes import SM_SCALE, Shape
from tests.backends.signatures import REQUIRED, bind

# ---------------------------------------------------------------------------------------
# ROCm/aiter at commit e4048607a535ace3a2b51ded31b1c8c2d45c0879 (2026-08-22):
# aiter/mla.py::mla_decode_fwd, aiter/ops/attention.py::get_mla_metadata_info_v1 and
# ::get_mla_metadata_v1 (the public wrapper over the compiled op).
AITER_COMMIT = "e4048607a535ace3a2b51ded31b1c8c2d45c0879"
MLA_DECODE_FWD = [
    ("q", REQUIRED), ("kv_buffer", REQUIRED), ("o", REQUIRED), ("qo_indptr", REQUIRED),
    ("kv_indptr", REQUIRED), ("kv_indices", REQUIRED), ("kv_last_page_lens", REQUIRED),
    ("max_seqlen_q", REQUIRED), ("page_size", 1), ("nhead_kv", 1), ("sm_scale", None),
    ("logit_cap", 0.0), ("num_kv_splits", None), ("num_kv_splits_indptr", None),
    ("work_meta_data", None), ("work_indptr", None), ("work_info_set", None),
    ("reduce_indptr", None), ("reduce_final_map", None), ("reduce_partial_map", None),
    ("q_scale", None), ("kv_scale", None), ("intra_batch_mode", False),
    ("return_logits", False), ("return_lse", False), ("g_kv_indptr", None),
    ("cp_world_size", 1), ("cp_rank", 0), ("causal", True),
]
GET_MLA_METADATA_INFO_V1 = [
    ("batch_size", REQUIRED), ("max_seqlen_qo", REQUIRED), ("num_head_qo", REQUIRED),
    ("q_dtype", REQUIRED), ("kv_dtype", REQUIRED), ("is_sparse", REQUIRED),
    ("fast_mode", True), ("num_kv_splits", 32), ("intra_batch_mode", False),
    ("max_split_per_batch", -1),
]
GET_MLA_METADATA_V1 = [
    ("seqlens_qo_indptr", REQUIRED), ("seqlens_kv_indptr", REQUIRED),
    ("kv_last_page_lens", REQUIRED), ("num_heads_per_head_k", REQUIRED),
    ("num_heads_k", REQUIRED), ("is_causal", REQUIRED), ("work_metadata_ptrs", REQUIRED),
    ("work_info_set", REQUIRED), ("work_indptr", REQUIRED), ("reduce_indptr", REQUIRED),
    ("reduce_final_map", REQUIRED), ("reduce_partial_map", REQUIRED), ("page_size", 1),
    ("kv_granularity", 16), ("max_seqlen_qo", -1), ("uni_seqlen_qo", -1), ("fast_mode", True),
    ("topk", -1), ("max_split_per_batch", -1), ("intra_batch_mode", False),
    ("is_cp_round_robin", False), ("mla_version", "MlaVersion.V32.value"),
    ("dtype_q_nope", None), ("dtype_q_rope", None), ("dtype_kv_nope", None),
    ("dtype_kv_rope", None), ("dtype_q", None), ("dtype_kv", None),
]
# ---------------------------------------------------------------------------------------

FP8 = torch.float8_e4m3fn  # aiter dtypes.fp8 on gfx950
BASE = {"mode": "bf16", "page_size": 1, "num_kv_splits": 0, "fast_mode": False,
        "intra_batch_mode": True}


def _cfg(**kw):
    return {**BASE, **kw}


def _call_kwargs(plan, shape):
    """Build both calls' kwargs with CPU stand-ins for the device tensors."""
    buffers = {s.name: torch.empty(s.shape, dtype=s.dtype) for s in plan.metadata_buffers}
    q = torch.empty(shape.total_q, shape.heads, 576, dtype=plan.q_dtype)
    kv = torch.empty(shape.total_kv, 1, 576, dtype=plan.kv_dtype).view(plan.kv_view_shape)
    o = torch.empty(plan.out_shape, dtype=torch.bfloat16)
    fp8_q, fp8_kv = plan.q_dtype != torch.bfloat16, plan.kv_dtype != torch.bfloat16
    scale = torch.ones(1)
    decode = ab.decode_call_kwargs(plan, q, kv, o, plan.indices, buffers,
                                   scale if fp8_q else None, scale if fp8_kv else None)
    meta = ab.metadata_call_kwargs(plan, plan.indices, buffers) if plan.persistent else None
    return decode, meta


def test_commit_matches_the_backend():
    assert ab.AITER_COMMIT == AITER_COMMIT


def test_registered_with_its_declared_space():
    backend = get_backend("aiter")
    assert isinstance(backend, ab.AiterBackend)
    assert backend.declared_space(torch.device("cuda")).names == [
        "mode", "page_size", "num_kv_splits", "fast_mode", "intra_batch_mode"]


def test_unavailable_here_with_a_reason():
    av = ab.AiterBackend().available(torch.device("cuda"))
    assert not av and "ROCm" in av.reason


def test_missing_library_reason_names_the_pip_extra(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "aiter" else real(name, *a))
    av = ab.AiterBackend().available(torch.device("cuda"))
    assert not av and "pip install 'mla-tune[rocm]'" in av.reason


def test_old_aiter_is_refused(monkeypatch):
    """The PyPI wheel's mla_decode_fwd lacks page_size, nhead_kv and intra_batch_mode."""
    monkeypatch.setattr(torch.version, "hip", "6.4")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())

    def old_mla_decode_fwd(q, kv_buffer, o, qo_indptr, kv_indptr, kv_indices,
                           kv_last_page_lens, max_seqlen_q, sm_scale=None, logit_cap=0.0,
                           num_kv_splits=None):
        """Stand-in with an old aiter's parameters."""

    aiter = types.ModuleType("aiter")
    aiter.get_mla_metadata_info_v1 = aiter.get_mla_metadata_v1 = object()
    mla = types.ModuleType("aiter.mla")
    mla.mla_decode_fwd = old_mla_decode_fwd
    monkeypatch.setitem(sys.modules, "aiter", aiter)
    monkeypatch.setitem(sys.modules, "aiter.mla", mla)
    av = ab.AiterBackend().available(torch.device("cuda"))
    assert not av and "too old" in av.reason and "intra_batch_mode" in av.reason


def test_versions_reads_the_distribution(monkeypatch):
    def version(dist):
        if dist == "amd-aiter":
            raise importlib.metadata.PackageNotFoundError(dist)
        return "0.1.99"

    monkeypatch.setattr(importlib.metadata, "version", version)
    assert ab.AiterBackend().versions() == {"aiter": "0.1.99"}


def test_feasible_points_follow_format_layout_and_mode():
    backend = ab.AiterBackend()
    dev = torch.device("cuda")
    bf16 = backend.candidates(Shape.uniform(4, 1024), dev)
    assert {c["mode"] for c in bf16} == {"bf16", "bf16_persistent"}
    np_points = [c for c in bf16 if c["mode"] == "bf16"]
    assert len(np_points) == 5 * 4  # page sizes x splits; metadata knobs pinned
    assert all(c["num_kv_splits"] > 0 for c in bf16 if c["mode"] == "bf16_persistent")
    fp8 = backend.candidates(Shape.uniform(4, 1024, kv_format="fp8"), dev)
    assert {c["mode"] for c in fp8} == {"a16w8", "a8w8"} and len(fp8) == 2 * 5 * 3 * 2 * 2
    ragged = backend.candidates(Shape(2, (97, 64), kv_format="fp8"), dev)
    assert {c["page_size"] for c in ragged} == {1}
    assert backend.supports(Shape.uniform(4, 1024, kv_format="mxfp4"))


@pytest.mark.parametrize("shape,config", [
    (Shape.uniform(32, 1024), _cfg()),
    (Shape.uniform(32, 1024), _cfg(num_kv_splits=16, page_size=16)),
    (Shape.uniform(256, 8192, kv_format="fp8"),
     _cfg(mode="a16w8", page_size=2, num_kv_splits=32)),
    (Shape(3, (64, 1024, 320), q_len=4, heads=32, kv_format="fp8"),
     _cfg(mode="a8w8", page_size=64, num_kv_splits=8, fast_mode=True, intra_batch_mode=False)),
    (Shape.uniform(8, 2048, heads=128), _cfg(mode="bf16_persistent", num_kv_splits=16)),
])
def test_calls_bind_to_aiter_signatures(shape, config):
    plan = ab.plan_aiter_call(shape, config, ab.MI355X, FP8)
    decode, meta = _call_kwargs(plan, shape)
    args = bind(MLA_DECODE_FWD, **decode).arguments
    assert args["kv_buffer"].shape == plan.kv_view_shape
    assert args["page_size"] == config["page_size"] and args["nhead_kv"] == 1
    assert args["max_seqlen_q"] == shape.q_len and args["sm_scale"] == SM_SCALE
    assert args["causal"] is True
    if plan.persistent:
        assert all(args[n] is not None for n in ab.METADATA_BUFFERS)
        bind(GET_MLA_METADATA_INFO_V1, **plan.metadata_info_kwargs)
        margs = bind(GET_MLA_METADATA_V1, **meta).arguments
        assert margs["seqlens_kv_indptr"] is plan.indices["kv_indptr"]
        assert margs["work_metadata_ptrs"].dtype == torch.uint64
        assert margs["page_size"] == config["page_size"]
    else:
        assert meta is None and not any(n in args for n in ab.METADATA_BUFFERS)
        assert args["num_kv_splits"] == (config["num_kv_splits"] or None)


@pytest.mark.parametrize("page_size", [1, 2, 16, 64])
def test_page_views_and_indices(page_size):
    shape = Shape(3, (64, 1024, 320))
    plan = ab.plan_aiter_call(shape, _cfg(page_size=page_size), ab.MI355X, FP8)
    pages = [n // page_size for n in shape.kv_lens]
    assert plan.kv_view_shape == (sum(pages), page_size, 1, 576)
    idx = plan.indices
    assert idx["kv_indptr"].tolist() == [0, pages[0], pages[0] + pages[1], sum(pages)]
    assert idx["kv_indices"].tolist() == list(range(sum(pages)))
    assert idx["kv_last_page_lens"].tolist() == [page_size] * 3
    assert idx["qo_indptr"].tolist() == [0, 1, 2, 3]
    kv = torch.arange(shape.total_kv * 576, dtype=torch.float32).view(-1, 1, 576)
    view = kv.view(plan.kv_view_shape)
    seq1 = view[idx["kv_indices"][idx["kv_indptr"][1]:idx["kv_indptr"][2]].long()]
    assert torch.equal(seq1.reshape(-1, 1, 576), kv[64:64 + 1024])


def test_seed_a16w8_call_is_reproduced():
    """The seed's persistent bf16-Q + fp8-KV call (seeds/000_fe73ea07be91a9ef.txt), batch 64 x
    kv 8192, page size 2, 32 splits, fast_mode off, intra-batch mode."""
    shape = Shape.uniform(64, 8192, kv_format="fp8")
    plan = ab.plan_aiter_call(shape, _cfg(mode="a16w8", page_size=2, num_kv_splits=32),
                              ab.MI355X, FP8)
    assert plan.kv_view_shape == (64 * 8192 // 2, 2, 1, 576)
    assert plan.indices["kv_indptr"].tolist() == [i * 4096 for i in range(65)]
    assert plan.indices["kv_last_page_lens"].tolist() == [2] * 64
    assert plan.metadata_info_kwargs == {
        "batch_size": 64, "max_seqlen_qo": 1, "num_head_qo": 16, "q_dtype": torch.bfloat16,
        "kv_dtype": FP8, "is_sparse": False, "fast_mode": False, "num_kv_splits": 32,
        "intra_batch_mode": True, "max_split_per_batch": 32}
    assert plan.metadata_kwargs == {
        "num_heads_per_head_k": 16, "num_heads_k": 1, "is_causal": True, "page_size": 2,
        "kv_granularity": 16, "max_seqlen_qo": 1, "uni_seqlen_qo": 1, "fast_mode": False,
        "max_split_per_batch": 32, "intra_batch_mode": True, "dtype_q": torch.bfloat16,
        "dtype_kv": FP8}
    assert plan.decode_kwargs == {
        "max_seqlen_q": 1, "page_size": 2, "nhead_kv": 1, "sm_scale": SM_SCALE,
        "num_kv_splits": 32, "intra_batch_mode": True, "causal": True}
    decode, _ = _call_kwargs(plan, shape)
    assert decode["q_scale"] is None and decode["kv_scale"] is not None


def test_seed_bf16_call_is_reproduced():
    """The seed's non-persistent bf16 call: page size 1, token-level indptr, no metadata."""
    shape = Shape.uniform(32, 1024)
    plan = ab.plan_aiter_call(shape, _cfg(), ab.MI355X, FP8)
    assert not plan.persistent and plan.metadata_buffers == ()
    assert plan.kv_view_shape == (32 * 1024, 1, 1, 576)
    assert plan.indices["kv_indptr"].tolist() == [i * 1024 for i in range(33)]
    assert plan.decode_kwargs["intra_batch_mode"] is False
    assert plan.decode_kwargs["num_kv_splits"] is None


def _specs(plan):
    return {s.name: (s.shape, s.dtype) for s in plan.metadata_buffers}


# metadata_buffer_specs was also checked once against aiter's own get_mla_metadata_info_v1
# (its source at AITER_COMMIT executed on a CPU with get_gfx/get_cu_num stubbed): equal for all
# 5760 combinations of target {MI355X, MI300X} x persistent mode x heads {16,32,48,64,128} x
# q_len 1-4 x batch {1,4,32,256} x fast_mode x splits {8,16,32} x intra_batch_mode.


def test_metadata_sizes_intra_batch_mode():
    """get_mla_metadata_info_v1 at AITER_COMMIT, gfx950, 256 CUs: with 16 heads and q_len 1
    one q tile (ceil(16/128)) per sequence; intra-batch mode sizes work and partials as
    tiles x splits."""
    shape = Shape.uniform(64, 8192, kv_format="fp8")
    plan = ab.plan_aiter_call(shape, _cfg(mode="a16w8", page_size=2, num_kv_splits=32),
                              ab.MI355X, FP8)
    assert _specs(plan) == {
        "work_meta_data": ((2,), torch.uint64),
        "work_indptr": ((257,), torch.int32),
        "work_info_set": ((64 * 32, 8), torch.int32),
        "reduce_indptr": ((65,), torch.int32),
        "reduce_final_map": ((64, 2), torch.int32),
        "reduce_partial_map": ((64 * 32,), torch.int32),
    }


def test_metadata_sizes_fast_and_default_modes():
    # gfx950 fp8/fp8 with 32 heads and q_len 4: ceil(128/128) = 1 tile per sequence.
    shape = Shape.uniform(8, 1024, q_len=4, heads=32, kv_format="fp8")
    fast = ab.plan_aiter_call(shape, _cfg(mode="a8w8", num_kv_splits=8, fast_mode=True,
                                          intra_batch_mode=False), ab.MI355X, FP8)
    # max_work = (8 + 256 - 1) * 1; partials = max(min(263, 510) * 1, 8 + min(256, 64)).
    assert _specs(fast)["work_info_set"] == ((263, 8), torch.int32)
    assert _specs(fast)["reduce_partial_map"] == ((263,), torch.int32)
    # MI300X (gfx942, 304 CUs), bf16 with 32 heads, q_len 1: ceil(32/16) = 2 tiles; default
    # (not fast) mode sizes everything as tiles x CUs.
    shape = Shape.uniform(8, 1024, heads=32)
    slow = ab.plan_aiter_call(shape, _cfg(mode="bf16_persistent", num_kv_splits=16,
                                          intra_batch_mode=False), ab.MI300X, FP8)
    tiles = 8 * math.ceil(32 / 16)
    assert _specs(slow)["work_indptr"] == ((305,), torch.int32)
    assert _specs(slow)["work_info_set"] == ((tiles * 304, 8), torch.int32)
    assert _specs(slow)["reduce_final_map"] == ((tiles, 2), torch.int32)
    assert _specs(slow)["reduce_partial_map"] == ((tiles * 304,), torch.int32)


def test_a8w8_uses_fp8_query_and_granule_32_for_64_heads():
    shape = Shape.uniform(4, 1024, heads=64, kv_format="fp8")
    plan = ab.plan_aiter_call(shape, _cfg(mode="a8w8", num_kv_splits=16), ab.MI355X, FP8)
    assert plan.q_dtype == plan.kv_dtype == FP8
    assert plan.metadata_kwargs["kv_granularity"] == 32
    decode, _ = _call_kwargs(plan, shape)
    assert decode["q"].dtype == FP8 and decode["q_scale"] is not None


def test_persistent_mode_needs_explicit_splits():
    with pytest.raises(ValueError, match="num_kv_splits"):
        ab.plan_aiter_call(Shape.uniform(4, 1024), _cfg(mode="bf16_persistent"), ab.MI355X, FP8)
