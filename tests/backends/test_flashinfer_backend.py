"""FlashInfer family: CPU checks of the plan against FlashInfer's recorded API, and GPU
checks of its output against the float32 reference (those run only on the device)."""

import enum
import importlib.metadata
import importlib.util
import sys
import types

import pytest
import torch

from mla_tune.backends import flashinfer_backend as fib
from mla_tune.backends import get_backend
from mla_tune.problem.reference import mla_decode_reference
from mla_tune.problem.shapes import KVFormat, Shape, generate_input
from mla_tune.problem.verify import Tolerance, check, tolerance_for
from tests.backends.signatures import KEYWORD_ONLY, REQUIRED, bind

# ---------------------------------------------------------------------------------------
# FlashInfer 0.7.4 (flashinfer-python wheel, git commit 77039051b0be921788dc2784ec41423b558878ec),
# read with inspect.signature from flashinfer/mla/_batch_mla/{_wrapper,_contracts}.py.
FLASHINFER_VERSION = "0.7.4"
WRAPPER_INIT = [("self", REQUIRED), ("float_workspace_buffer", REQUIRED),
                ("use_cuda_graph", False), ("qo_indptr", None), ("kv_indptr", None),
                ("kv_indices", None), ("kv_len_arr", None), ("backend", "auto")]
WRAPPER_PLAN = [
    ("self", REQUIRED), ("qo_indptr", None), ("kv_indptr", None), ("kv_indices", None),
    ("kv_len_arr", None), ("num_heads", None), ("head_dim_ckv", None), ("head_dim_kpe", None),
    ("page_size", None), ("causal", None), ("sm_scale", None), ("q_data_type", None),
    ("kv_data_type", None), ("use_profiler", False), KEYWORD_ONLY,
    ("metadata", None), ("cum_seq_lens_q", None), ("block_tables", None), ("seq_lens", None),
    ("max_q_len", None), ("query_layout", None), ("kv_cache_layout", None),
    ("lse_mode", "none"), ("output_dtype", None), ("output_scale", "none"),
    ("scale_mode", "default"), ("skip_softmax", False), ("enable_pdl", None),
    ("use_sinks", False),
]
WRAPPER_RUN = [
    ("self", REQUIRED), ("q_nope", None), ("q_pe", None), ("ckv_cache", None),
    ("kpe_cache", None), ("out", None), ("lse", None), ("return_lse", False),
    ("profiler_buffer", None), ("kv_len", None), ("page_table", None),
    ("return_lse_base_on_e", False), ("o_scale", None), KEYWORD_ONLY,
    ("query", None), ("kv_cache", None), ("ckv_scale", None), ("ckv_scale_arr", None),
    ("kpe_scale", None), ("sinks", None), ("skip_softmax_threshold_scale_factor", None),
    ("bmm1_scale", None), ("bmm2_scale", None),
]
METADATA_CSR = [("qo_indptr", REQUIRED), ("kv_indptr", REQUIRED), ("kv_indices", REQUIRED),
                ("kv_len_arr", REQUIRED)]
# The native module's run (data/csrc/batch_mla_sm90_run.cu and batch_mla_run.cu), which
# launch="direct" calls positionally.
NATIVE_RUN = ["float_workspace_buffer", "int_workspace_buffer", "plan_info_vec", "q_nope",
              "q_pe", "ckv_cache", "kpe_cache", "kv_indices", "o", "maybe_lse",
              "mask_mode_code", "num_heads", "page_size", "sm_scale", "return_lse_base_on_e",
              "ckv_scale", "kpe_scale", "maybe_ckv_scale_arr"]
# ---------------------------------------------------------------------------------------

CONFIG = {"backend": "fa3", "page_size": 1, "launch": "wrapper", "fp8_scale": "host"}


def _cfg(**kw):
    return {**CONFIG, **kw}


def test_registered_with_its_declared_space():
    backend = get_backend("flashinfer")
    assert isinstance(backend, fib.FlashInferBackend)
    space = backend.declared_space(torch.device("cuda"))
    assert space.names == ["backend", "page_size", "launch", "fp8_scale"]
    assert set(space.choices("page_size")) == {1, 16, 64}


def test_unavailable_here_with_a_reason():
    backend = fib.FlashInferBackend()
    cpu = backend.available(torch.device("cpu"))
    assert not cpu and "NVIDIA" in cpu.reason
    if not torch.cuda.is_available():
        gpu = backend.available(torch.device("cuda"))
        assert not gpu and gpu.reason


@pytest.fixture()
def fake_cuda(monkeypatch):
    """Pretend to be a CUDA machine so availability gets as far as the library checks."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "hip", None)


def test_missing_library_reason_names_the_pip_extra(fake_cuda, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "flashinfer" else real(name, *a))
    av = fib.FlashInferBackend().available(torch.device("cuda"))
    assert not av and "pip install 'mla-tune[cuda]'" in av.reason


def test_import_error_text_is_the_reason(fake_cuda, monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setitem(sys.modules, "flashinfer", None)
    av = fib.FlashInferBackend().available(torch.device("cuda"))
    assert not av and "import flashinfer.mla failed" in av.reason and "flashinfer" in av.reason


def test_rocm_torch_is_not_nvidia(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", "6.4")
    av = fib.FlashInferBackend().available(torch.device("cuda"))
    assert not av and "ROCm" in av.reason


def test_versions_names_the_wheel(monkeypatch):
    monkeypatch.setattr(importlib.metadata, "version",
                        lambda dist: "0.7.4" if dist == "flashinfer-python" else "?")
    assert fib.FlashInferBackend().versions() == {"flashinfer": "0.7.4"}


def test_candidates_prune_meaningless_and_uncopyable_points():
    backend = fib.FlashInferBackend()
    dev = torch.device("cuda")
    bf16 = backend.candidates(Shape.uniform(4, 1024), dev)
    assert len(bf16) == 3 * 3 * 2 and {c["fp8_scale"] for c in bf16} == {"host"}
    fp8 = backend.candidates(Shape.uniform(4, 1024, kv_format="fp8"), dev)
    assert len(fp8) == 3 * 3 * 2 * 2
    ragged = backend.candidates(Shape(2, (100, 64)), dev)
    assert {c["page_size"] for c in ragged} == {1}
    assert backend.supports(Shape.uniform(4, 1024, kv_format="mxfp4"))
    assert backend.supports(Shape.uniform(4, 1024, q_len=4)) is None


@pytest.mark.parametrize("shape,config", [
    (Shape.uniform(4, 1024), _cfg()),
    (Shape.uniform(32, 8192, kv_format="fp8"), _cfg(backend="fa2", page_size=64)),
    (Shape(3, (64, 1024, 320), q_len=4, heads=32), _cfg(backend="auto", page_size=16)),
])
def test_plan_binds_to_flashinfer_api(shape, config):
    plan = fib.make_plan(shape, config)
    csr = bind(METADATA_CSR, **plan.metadata).arguments
    assert csr["qo_indptr"].tolist() == list(range(0, shape.total_q + 1, shape.q_len))
    assert csr["kv_len_arr"].tolist() == list(shape.kv_lens)
    assert all(t.dtype == torch.int32 for t in plan.metadata.values())
    bind(WRAPPER_INIT, object(), torch.empty(1), backend=plan.backend)
    args = bind(WRAPPER_PLAN, object(), metadata=object(), **plan.plan_kwargs).arguments
    assert args["num_heads"] == shape.heads and args["page_size"] == config["page_size"]
    assert (args["head_dim_ckv"], args["head_dim_kpe"]) == (512, 64)
    assert args["causal"] == (shape.q_len > 1)
    assert args["query_layout"] == args["kv_cache_layout"] == "packed"
    fp8 = shape.kv_format is KVFormat.FP8
    assert args["kv_data_type"] == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
    assert args.get("scale_mode", "default") == ("kv-per-tensor" if fp8 else "default")
    pages, page, width = plan.kv_view_shape
    assert pages * page == shape.total_kv and page == config["page_size"] and width == 576
    q = torch.empty(shape.total_q, shape.heads, 576)
    kv = torch.empty(plan.kv_view_shape)
    run = bind(WRAPPER_RUN, object(), **fib.run_kwargs(q, kv, 0.5 if fp8 else None)).arguments
    assert run["query"] is q and run["kv_cache"] is kv
    assert ("ckv_scale" in run) == ("kpe_scale" in run) == fp8


def test_direct_launch_passes_the_native_arguments(monkeypatch):
    class MaskMode(enum.Enum):
        NON_CAUSAL = 0
        CAUSAL = 1

    utils = types.ModuleType("flashinfer.utils")
    utils.MaskMode = MaskMode
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.utils", utils)
    calls = []
    wrapper = types.SimpleNamespace(
        _planned_backend_name="fa3", _float_workspace_buffer="fws", _int_workspace_buffer="iws",
        _plan_info="info", _kv_indices_buf="indices",
        _cached_module=types.SimpleNamespace(run=lambda *a: calls.append(a)))
    shape = Shape.uniform(2, 64, q_len=2)
    plan = fib.make_plan(shape, _cfg(page_size=16, launch="direct"))
    launch = fib._direct_launch(wrapper, plan, shape.heads)
    q = torch.randn(shape.total_q, shape.heads, 576)
    kv = torch.randn(plan.kv_view_shape)
    out = launch(q, kv, 0.25)
    (args,) = calls
    assert len(args) == len(NATIVE_RUN)
    a = dict(zip(NATIVE_RUN, args))
    assert (a["float_workspace_buffer"], a["int_workspace_buffer"], a["plan_info_vec"],
            a["kv_indices"]) == ("fws", "iws", "info", "indices")
    assert torch.equal(a["q_nope"], q[..., :512]) and torch.equal(a["q_pe"], q[..., 512:])
    assert torch.equal(a["ckv_cache"], kv[..., :512]) and torch.equal(a["kpe_cache"], kv[..., 512:])
    assert a["o"] is out and out.shape == (4, 16, 512) and out.dtype == torch.bfloat16
    assert a["maybe_lse"] is None and a["maybe_ckv_scale_arr"] is None
    assert a["mask_mode_code"] == 1 and a["num_heads"] == 16 and a["page_size"] == 16
    assert a["sm_scale"] == pytest.approx(576 ** -0.5) and a["return_lse_base_on_e"] is False
    assert a["ckv_scale"] == a["kpe_scale"] == 0.25
    wrapper._planned_backend_name = "cutlass"
    with pytest.raises(RuntimeError, match="launch='wrapper'"):
        fib._direct_launch(wrapper, plan, shape.heads)


@pytest.mark.parametrize("fp8_scale", ["host", "fold"])
def test_fp8_scale_handling_matches_the_reference(fp8_scale):
    """Both ways of handing FlashInfer the per-tensor scale give the dequantized result.
    The stand-in launch computes what FlashInfer does: attention over `kv * scale`."""
    shape = Shape(2, (96, 160), q_len=2, kv_format="fp8")
    data = generate_input(shape, seed=3)
    q, kv_data, qo, kv_indptr, config = data

    def launch(qq, kv_pages, scale):
        kv = kv_pages.reshape(-1, 1, 576).float() * scale
        return mla_decode_reference(qq, kv, qo, kv_indptr, config).to(torch.bfloat16)

    plan = fib.make_plan(shape, _cfg(fp8_scale=fp8_scale, page_size=16))
    out = fib._kernel(plan, launch, shape, torch.device("cpu"))(data)
    ref = mla_decode_reference(q, kv_data, qo, kv_indptr, config, kv_format="fp8")
    result = check(out, ref, Tolerance(rtol=2e-2, atol=2e-2))
    assert result.ok, result.reason


# ---------------------------------------------------------------------------------------
# On the GPU: real FlashInfer against the float32 reference.
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")

GPU_CASES = [
    (Shape.uniform(4, 1024), _cfg()),
    (Shape.uniform(4, 1024), _cfg(backend="fa2")),
    (Shape.uniform(4, 1024), _cfg(backend="auto", page_size=64, launch="direct")),
    (Shape(3, (64, 1024, 320)), _cfg(page_size=64)),
    (Shape(3, (64, 1024, 320)), _cfg(backend="fa2", page_size=16, launch="direct")),
    (Shape(4, (37, 1000, 5, 300)), _cfg(launch="direct")),
    (Shape.uniform(2, 1024, q_len=4, heads=32), _cfg(page_size=16)),
    (Shape.uniform(2, 1024, q_len=4, heads=32), _cfg(backend="fa2", launch="direct")),
    (Shape(3, (5, 130, 64), q_len=2), _cfg()),
    (Shape.uniform(2, 512, heads=128), _cfg(page_size=64)),
    (Shape.uniform(4, 1024, kv_format="fp8"), _cfg()),
    (Shape.uniform(4, 1024, kv_format="fp8"), _cfg(fp8_scale="fold", launch="direct")),
    (Shape.uniform(4, 1024, kv_format="fp8"), _cfg(backend="fa2", page_size=64)),
    (Shape.uniform(2, 1024, q_len=4, heads=32, kv_format="fp8"), _cfg(fp8_scale="fold")),
]


def _gpu_backend() -> fib.FlashInferBackend:
    backend = fib.FlashInferBackend()
    av = backend.available(torch.device("cuda"))
    if not av:
        pytest.skip(av.reason)
    return backend


@gpu
@pytest.mark.parametrize("shape,config", GPU_CASES, ids=lambda v: getattr(v, "key", None)
                         or "-".join(map(str, v.values())))
def test_flashinfer_matches_reference(shape, config):
    backend = _gpu_backend()
    dev = torch.device("cuda")
    reason = backend.precheck(shape, config, dev)
    if reason:
        pytest.skip(reason)
    data = generate_input(shape, seed=1, device=dev)
    ref = mla_decode_reference(*data[:4], data[4], kv_format=shape.kv_format)
    out = backend.build(shape, config, dev)(data)
    assert out.shape == (shape.total_q, shape.heads, 512) and out.dtype == torch.bfloat16
    result = check(out, ref, tolerance_for(shape.kv_format))
    assert result.ok, result.reason


@gpu
def test_direct_launch_equals_wrapper_bitwise():
    backend = _gpu_backend()
    dev = torch.device("cuda")
    shape = Shape(3, (64, 1024, 320), q_len=2)
    data = generate_input(shape, seed=2, device=dev)
    outs = [backend.build(shape, _cfg(page_size=16, launch=launch), dev)(data)
            for launch in ("wrapper", "direct")]
    assert torch.equal(outs[0], outs[1])
