"""Compiled-source families (mla_tune/backends/compiled_source.py): family files, the
expression language, contract errors at load time, the shipped CUDA family's variants
compiled for sm_90a with nvcc on this machine (no GPU), the static check's pruning, the
on-disk cache, and the HIP path's command lines (no ROCm compiler installs here)."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from mla_tune import backends as registry
from mla_tune.backends.compiled_expr import ExprError, parse
from mla_tune.backends.compiled_source import FAMILIES_ENV, CompiledSourceFamily
from mla_tune.backends.compiled_spec import ContractError, entry_params, load_spec, shape_env
from mla_tune.backends.compiled_toolchain import (
    ToolchainError,
    compile_command,
    compile_variant,
    find_compiler,
    parse_amdgpu_remarks,
    parse_ptx_entries,
)
from mla_tune.problem.shapes import KVFormat, Shape

ROOT = Path(__file__).resolve().parents[2]
NVCC = find_compiler("cuda")
needs_nvcc = pytest.mark.skipif(NVCC is None, reason="nvcc not installed (pip install "
                                                      "nvidia-cuda-nvcc provides it)")

SMALL_CU = r"""
#include <stdint.h>
#ifndef TILE
#error "define TILE"
#endif
extern "C" __global__ void small(const float* x, float* y, int n, float s) {
  int i = blockIdx.x * TILE + threadIdx.x;
  if (i < n) y[i] = x[i] * s;
}
"""

SMALL_TOML = """
[family]
language = "{language}"
sources = ["small.cu"]
formats = ["bf16"]
archs = ["sm_90a", "gfx950"]
constraints = {constraints}
[flags]
cuda = {flags}
hip = ["-O3"]
[space]
TILE = [16, 64, 128, 256]
{extra_space}
[[launch]]
entry = "{entry}"
grid = ["ceil_div(total_q * heads, TILE)"]
block = "TILE"
shared = {shared}
args = {args}
"""


def family(tmp_path: Path, name: str = "small", source: str = SMALL_CU, **kw: object) -> Path:
    """A family file `name`.toml with `small.cu` beside it; keywords replace fields."""
    fields = {"language": "cuda", "constraints": '["TILE <= 128"]', "flags": '["-O3"]',
              "extra_space": "", "entry": "small", "shared": 0,
              "args": '["q", "out", "int:total_q", "float:sm_scale"]'}
    fields.update(kw)
    (tmp_path / "small.cu").write_text(source)
    path = tmp_path / f"{name}.toml"
    path.write_text(SMALL_TOML.format(**fields))
    return path


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A private compile cache, so each test really compiles."""
    monkeypatch.setenv("MLA_TUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


# -- expressions ----------------------------------------------------------------------------

def test_expressions_evaluate_arithmetic_and_refuse_code() -> None:
    assert parse("BN * NW <= 512", "t")({"BN": 64, "NW": 8}) is True
    assert parse("BN * NW <= 512", "t")({"BN": 64, "NW": 16}) is False
    assert parse("ceil_div(q_len * heads, 16)", "t")({"q_len": 4, "heads": 20}) == 5
    assert parse("0 if P == 0 else\n 2 * BN", "t")({"P": 1, "BN": 32}) == 64
    assert parse(96, "t").names == frozenset()
    for bad in ("__import__('os').system('true')", "x.y", "(lambda: 1)()", "[1, 2]",
                "open('f')", "a[0]", "BN ** 99999"):
        with pytest.raises(ExprError):
            parse(bad, "t")
    with pytest.raises(ExprError, match="division by zero"):
        parse("a // b", "t")({"a": 1, "b": 0})


# -- the shipped family ---------------------------------------------------------------------

SHIPPED = {"cuda": set(KVFormat), "cuda_mma": set(KVFormat),
           "cuda_frag": {KVFormat.FP8, KVFormat.MXFP4},
           "cuda_wgmma": {KVFormat.FP8, KVFormat.MXFP4}}
"""The compiled families shipped in configs/backends and the KV formats each decodes (CUDA
cores; tensor cores on decoded tiles; tensor cores on fragments decoded in registers; keys
on the M side of warpgroup MMAs, register operands)."""


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_family_is_registered_and_small(name: str) -> None:
    b = registry.get_backend(name)
    assert b.spec.language == "cuda" and set(b.spec.formats) == SHIPPED[name]
    variants = b.variants()
    assert len(SHIPPED[name]) <= len(variants) <= 112  # every one is compiled by CI below
    # SPLITS is a kernel argument: it never multiplies compiles.
    assert all("SPLITS" not in macros for _, macros in variants)
    # The class is importable by path, as the sweep's worker processes import it.
    import importlib

    cls = getattr(importlib.import_module("mla_tune.backends.compiled_source"), f"family_{name}")
    assert cls is type(b) and cls.name == name


def test_constraints_prune_candidates_per_shape() -> None:
    b = registry.get_backend("cuda")
    dev = torch.device("cuda")
    short = b.candidates(Shape.uniform(4, 256), dev)
    long = b.candidates(Shape.uniform(4, 8192), dev)
    # SPLITS * BN <= kv_len: at kv 256 no 32-way split, at kv 8192 all of them.
    assert not [c for c in short if c["SPLITS"] == 32]
    assert all(c["SPLITS"] == 1 or c["SPLITS"] * c["BN"] <= 256 for c in short)
    assert len(long) == b.declared_space(dev).size()
    assert b.supports(Shape.uniform(2, 64, kv_format="mxfp4")) is None


def test_bulk_copy_loads_are_a_load_value_of_bf16_and_fp8() -> None:
    b = registry.get_backend("cuda_mma")
    formats: dict[int, set[KVFormat]] = {}
    for fmt, macros in b.variants():
        formats.setdefault(macros["LOAD"], set()).add(fmt)
    # bf16 tiles are used as copied, so the register prefetch (1) is not theirs; MXFP4's
    # small raw tiles gain nothing from bulk copies (bench/results/cuda_mma_family.md).
    assert formats == {0: set(KVFormat), 1: {KVFormat.FP8, KVFormat.MXFP4},
                       2: {KVFormat.BF16, KVFormat.FP8}}
    bulk = [m for _, m in b.variants() if m["LOAD"] == 2]
    assert bulk and all(m["MT"] == 1 for m in bulk)
    # The same shared memory as the cp.async double buffer (its barriers are static).
    env = {**shape_env(Shape.uniform(4, 1024)), **b.spec.defines["fp8"], "BN": 64, "MT": 1,
           "QK": 1, "CLUSTER": 0, "SPLITS": 16, "MERGE": 0}
    assert b.spec.launches[0].shared({**env, "LOAD": 2}) == b.spec.launches[0].shared(
        {**env, "LOAD": 0})


def test_bf16_cluster_exchange_is_a_cluster_knob_stored_results_read_as_off() -> None:
    b = registry.get_backend("cuda_mma")
    bf16 = [m for _, m in b.variants() if m["CLUSTER_BF16"]]
    assert bf16 and all(m["CLUSTER"] for m in bf16)
    assert len(bf16) == len([m for _, m in b.variants() if m["CLUSTER"]]) // 2
    stored = {"BN": 64, "MT": 1, "LOAD": 0, "QK": 1, "SPLITS": 16, "MERGE": 0, "CLUSTER": 16}
    assert b.declared_space(torch.device("cuda")).validate(stored)["CLUSTER_BF16"] == 0


def test_cluster_merges_take_whole_clusters_of_splits() -> None:
    b = registry.get_backend("cuda_mma")
    compiled = [m for _, m in b.variants() if m["CLUSTER"]]
    assert compiled and all(m["MT"] == 1 and m["QK"] == 1 for m in compiled)
    cands = b.candidates(Shape.uniform(4, 1024), torch.device("cuda"))
    clustered = [c for c in cands if c["CLUSTER"]]
    assert {c["CLUSTER"] for c in clustered} == {8, 16}
    assert all(c["SPLITS"] % c["CLUSTER"] == 0 and c["MERGE"] == 0 for c in clustered)
    one = next(c for c in clustered if c["SPLITS"] == c["CLUSTER"])
    several = next(c for c in clustered if c["SPLITS"] == 4 * c["CLUSTER"])
    shape = Shape.uniform(4, 1024)
    for cfg in (one, several):
        env = {**shape_env(shape), **b.spec.defines["bf16"], **cfg}
        # One launch either way: clusters merge in shared memory, then (several clusters
        # per row tile) through scratch in the same launch.
        assert [ln.entry for ln in b.spec.launches if ln.when is None or ln.when(env)] == [
            "mla_split"]
    env_one = {**shape_env(shape), **b.spec.defines["bf16"], **one}
    assert b.spec.scratch(env_one) == 0
    env = {**shape_env(shape), **b.spec.defines["bf16"], **several}
    rows, clusters = 4 * 16, 4
    # Per (row, cluster): 512 values and a log-sum-exp per cluster rank; per row tile
    # (one per sequence at 16 heads) CLUSTER counters.
    assert b.spec.scratch(env) == (rows * clusters * (512 + several["CLUSTER"])
                                   + 4 * several["CLUSTER"]) * 4


def test_knob_only_constraints_prune_the_compile_list(tmp_path: Path) -> None:
    spec_path = family(tmp_path, "prune1", constraints='["TILE * 2 <= 256"]')
    b = family_class_for(spec_path)
    assert sorted(m["TILE"] for _, m in b.variants()) == [16, 64, 128]
    shape_bound = family(tmp_path, "prune2", constraints='["TILE <= heads * 8"]')
    b2 = family_class_for(shape_bound)
    assert len(b2.variants()) == 4  # names a shape variable: pruned per shape instead
    assert [c["TILE"] for c in b2.candidates(Shape.uniform(1, 64, heads=16), "cuda")] == [
        16, 64, 128]


def family_class_for(path: Path):
    """An instance of the generic class for the family file at `path`."""
    cls = type(f"family_{path.stem}", (CompiledSourceFamily,),
               {"name": path.stem, "spec_path": path})
    return cls()


# -- contract errors at load time ----------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    ({"entry": "missing_kernel"}, "entry 'missing_kernel' is not a __global__ function"),
    ({"args": '["q", "out", "int:total_q"]'}, "takes 4 parameters but its [[launch]] passes 3"),
    ({"extra_space": "UNUSED = [1, 2]"}, "knob 'UNUSED' is passed as the macro"),
    ({"args": '["q", "out", "int:total_q", "float:nope"]'}, "names ['nope']"),
    ({"args": '["q", "weights", "int:total_q", "float:sm_scale"]'}, "'weights' is neither"),
    ({"language": "opencl"}, "language must be one of"),
    ({"constraints": '["import os"]'}, "is not an expression"),
])
def test_wrong_contracts_are_clear_errors_at_load(tmp_path: Path, kw: dict,
                                                  message: str) -> None:
    with pytest.raises(ContractError) as e:
        load_spec(family(tmp_path, **kw))
    assert message in str(e.value) and "small.toml" in str(e.value)


def test_runtime_knob_must_reach_a_launch(tmp_path: Path) -> None:
    path = family(tmp_path, extra_space="SPLITS = [1, 2]")
    path.write_text(path.read_text().replace("[family]", '[family]\nruntime_knobs = ["SPLITS"]'))
    with pytest.raises(ContractError, match="runtime knob 'SPLITS' reaches no launch"):
        load_spec(path)


def test_defaults_give_stored_configs_a_later_knob(tmp_path: Path) -> None:
    path = family(tmp_path, "later_knob")
    path.write_text(path.read_text() + "[defaults]\nTILE = 64\n")
    b = family_class_for(path)
    space = b.declared_space(torch.device("cuda"))
    assert space.validate({}) == {"TILE": 64}  # a config stored before TILE existed
    assert space.validate({"TILE": 16}) == {"TILE": 16}
    # Built unvalidated (a run-off of stored trials), it compiles and launches the same.
    assert b.macros(KVFormat.BF16, {}) == b.macros(KVFormat.BF16, {"TILE": 64}) == {"TILE": 64}
    assert b.feasible(Shape.uniform(4, 64), {})  # its constraint TILE <= 128 reads 64


@pytest.mark.parametrize("defaults, message", [
    ("NOPE = 1", "[defaults] names 'NOPE', which is not a knob"),
    ("TILE = 48", "[defaults] TILE = 48 is not one of its values [16, 64, 128, 256]"),
])
def test_bad_defaults_are_clear_errors_at_load(tmp_path: Path, defaults: str,
                                               message: str) -> None:
    path = family(tmp_path)
    path.write_text(path.read_text() + f"[defaults]\n{defaults}\n")
    with pytest.raises(ContractError) as e:
        load_spec(path)
    assert message in str(e.value)


def test_missing_source_and_bad_toml(tmp_path: Path) -> None:
    path = family(tmp_path)
    (tmp_path / "small.cu").unlink()
    with pytest.raises(ContractError, match="small.cu does not exist"):
        load_spec(path)
    path.write_text("[family\n")
    with pytest.raises(ContractError, match="not valid TOML"):
        load_spec(path)


def test_family_files_from_env_register_and_bad_ones_fail_the_cli(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from mla_tune.cli.main import app

    good = family(tmp_path, "good_small")
    (tmp_path / "b").mkdir()
    bad = family(tmp_path / "b", "bad_small", entry="nowhere")
    monkeypatch.setenv(FAMILIES_ENV, os.pathsep.join([str(good), str(bad)]))
    try:
        registry._register_family_files()
        assert {"good_small", "bad_small"} <= set(registry.backend_names())
        assert registry.get_backend("good_small").spec.path == good
        r = CliRunner().invoke(app, ["sweep", "--backend", "bad_small", "--shape", "2x64",
                                     "-f", "bf16", "--device", "cpu",
                                     "--db", str(tmp_path / "t.db")])
        assert r.exit_code == 2, r.output
        assert "entry 'nowhere' is not a __global__ function" in r.output
        assert not (tmp_path / "t.db").exists()  # nothing stored before the input is checked
    finally:
        for name in ("good_small", "bad_small"):
            registry._REGISTRY.pop(name, None)
            registry._instances.pop(name, None)


def test_source_hash_moves_with_the_family_file(tmp_path: Path) -> None:
    path = family(tmp_path, "hash1")
    before = family_class_for(path).source_hash()
    path.write_text(path.read_text().replace('cuda = ["-O3"]', 'cuda = ["-O2"]'))
    assert family_class_for(path).source_hash() != before


def test_doctor_lists_the_family_and_the_compilers(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from mla_tune.cli.main import app

    r = CliRunner().invoke(app, ["doctor", "--device", "cpu", "--db", str(tmp_path / "n.db")])
    assert r.exit_code == 0, r.output
    assert "│ cuda " in r.output and "compiled-source families: cuda: " in r.output
    assert "hip: " in r.output and FAMILIES_ENV in r.output


def test_unavailable_without_gpu_says_why() -> None:
    b = registry.get_backend("cuda")
    avail = b.available(torch.device("cpu"))
    assert not avail and "no GPU here" in avail.reason and "sm_90a" in avail.reason
    with pytest.raises(RuntimeError, match="no GPU here"):
        b.build(Shape.uniform(2, 64), b.candidates(Shape.uniform(2, 64), "cpu")[0], "cpu")


# -- compiling for sm_90a without a GPU -------------------------------------------------------

@needs_nvcc
@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_variant_compiles_for_sm90a_with_resources_recorded(
        cache: Path, name: str) -> None:
    b = registry.get_backend(name)
    variants = b.variants()
    with ThreadPoolExecutor(2) as ex:
        reports = list(ex.map(lambda v: b.compile(v[0], v[1], "sm_90a"), variants))
    failed = [(f.value, m, r.error) for (f, m), r in zip(variants, reports) if not r.ok]
    assert not failed, failed[:2]
    for (fmt, macros), r in zip(variants, reports):
        assert Path(r.image).is_file()
        for entry in ("mla_split", "mla_merge"):
            assert r.registers[entry] > 0 and entry in r.spills, (fmt, macros, r)
        assert r.params["mla_split"] == [8] * 7 + [4] * (len(b.spec.launches[0].args) - 7)
        # A variant runs unless it spills (the precheck says so instead of a GPU finding out).
        runtime = {k: 1 for k in b.spec.runtime_knobs} | {"SPLITS": 8}
        problem = b.problem(r, Shape.uniform(4, 1024, kv_format=fmt), {**macros, **runtime})
        assert (problem is None) == (r.spills["mla_split"] == 0), (fmt, macros, problem)
    clean = {f for (f, _), r in zip(variants, reports) if not r.spills["mla_split"]}
    assert clean == SHIPPED[name]


@needs_nvcc
def test_cache_reuses_and_recompiles_a_corrupt_entry(cache: Path, tmp_path: Path) -> None:
    src = tmp_path / "c.cu"
    src.write_text(SMALL_CU)
    first = compile_variant("cuda", [src], "sm_90a", ["-O3"], {"TILE": 64})
    again = compile_variant("cuda", [src], "sm_90a", ["-O3"], {"TILE": 64})
    assert first == again  # the same report, read back (compile seconds included)
    other = compile_variant("cuda", [src], "sm_90a", ["-O3"], {"TILE": 128})
    assert other.image != first.image
    for report in cache.glob("*.json"):
        report.write_text("{not json")
    redone = compile_variant("cuda", [src], "sm_90a", ["-O3"], {"TILE": 64})
    assert redone.ok and redone.image == first.image


@needs_nvcc
def test_compiled_contract_checks_catch_what_text_cannot(cache: Path, tmp_path: Path) -> None:
    # Same parameter count, but a double where the contract passes a float.
    wrong_type = family(tmp_path, "types", source=SMALL_CU.replace("float s", "double s"))
    b = family_class_for(wrong_type)
    rep = b.compile(KVFormat.BF16, {"TILE": 64}, "sm_90a")
    assert rep.params["small"] == [8, 8, 4, 8]
    assert "takes parameters of [8, 8, 4, 8] bytes" in b.problem(rep, Shape.uniform(1, 64),
                                                                 {"TILE": 64})
    # A C++ entry (no extern "C") is mangled: the image has no `small`.
    mangled = family(tmp_path, "mangled", source=SMALL_CU.replace('extern "C" ', ""))
    b = family_class_for(mangled)
    rep = b.compile(KVFormat.BF16, {"TILE": 64}, "sm_90a")
    assert 'declare it extern "C"' in b.problem(rep, Shape.uniform(1, 64), {"TILE": 64})
    broken = family(tmp_path, "broken", source=SMALL_CU.replace("x[i] * s", "x[i] * undefined"))
    rep = family_class_for(broken).compile(KVFormat.BF16, {"TILE": 64}, "sm_90a")
    assert not rep.ok and "undefined" in rep.error


SPILLING_CU = r"""
#ifndef TILE
#error "define TILE"
#endif
extern "C" __global__ void __launch_bounds__(1024) small(const float* x, float* y, int n,
                                                         float s) {
  float v[TILE];  // TILE values live across barriers, in at most 64 registers
#pragma unroll
  for (int i = 0; i < TILE; ++i) v[i] = x[threadIdx.x + i * n];
  __syncthreads();
  y[threadIdx.x] = 0.f;
  __syncthreads();
  float acc = 0.f;
#pragma unroll
  for (int i = 0; i < TILE; ++i) acc = acc * s + v[TILE - 1 - i];
  y[blockIdx.x * TILE + threadIdx.x] = acc;
}
"""


@needs_nvcc
def test_static_check_prunes_spills_and_shared_overflow(cache: Path, tmp_path: Path) -> None:
    b = family_class_for(family(tmp_path, "spilling", source=SPILLING_CU))
    shape = Shape.uniform(1, 64)
    small, big = (b.compile(KVFormat.BF16, {"TILE": t}, "sm_90a") for t in (16, 128))
    assert small.ok and big.ok and big.spills["small"] > small.spills["small"] == 0
    assert b.problem(small, shape, {"TILE": 16}) is None
    assert "small spills" in b.problem(big, shape, {"TILE": 128})
    huge = family_class_for(family(tmp_path, "huge", shared="240000"))
    rep = huge.compile(KVFormat.BF16, {"TILE": 64}, "sm_90a")
    assert "shared memory 240000 B over 232448" in huge.problem(rep, shape, {"TILE": 64})


def test_ptx_entry_parameters_are_parsed() -> None:
    ptx = """.visible .entry k(
        .param .u64 .ptr .global .align 1 k_param_0,
        .param .u32 k_param_1,
        .param .f32 k_param_2,
        .param .align 8 .b8 k_param_3[24]
    )
    {"""
    assert parse_ptx_entries(ptx) == {"k": [8, 4, 4, 24]}


def test_entry_parameters_are_found_past_attributes() -> None:
    # Attributes (and macros standing for them) may sit before or after `void`.
    code = """
    __global__ void helper(int a) {}
    extern "C" __global__ void CLUSTER_DIMS __launch_bounds__(128, 2)
    mla_split(const float* __restrict__ q, int n) {}
    extern "C" __global__ __launch_bounds__(64) void mla_merge(float* o) {}
    """
    assert entry_params(code, "mla_split") == ["const float* __restrict__ q", "int n"]
    assert entry_params(code, "mla_merge") == ["float* o"]
    assert entry_params(code, "absent") is None


# -- HIP: command lines and contract handling (no ROCm compiler here) ------------------------

def test_hip_command_line_and_family_without_compiler(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    cmd = compile_command("hip", "/opt/rocm/bin/hipcc", tmp_path / "k.hip", tmp_path / "k.hsaco",
                          "gfx950", ["-O3"], {"BN": 64, "FAST": True}, [tmp_path])
    assert cmd[:4] == ["/opt/rocm/bin/hipcc", "--genco", "--offload-arch=gfx950",
                       "-Rpass-analysis=kernel-resource-usage"]
    assert "-DBN=64" in cmd and "-DFAST=1" in cmd and f"-I{tmp_path}" in cmd
    assert cmd[-3:] == ["-o", str(tmp_path / "k.hsaco"), str(tmp_path / "k.hip")]
    cuda = compile_command("cuda", "nvcc", tmp_path / "k.cu", tmp_path / "k.cubin", "sm_90a",
                           [], {"BN": 32}, [])
    assert cuda[:5] == ["nvcc", "-cubin", "-arch=sm_90a", "-Xptxas", "-v"] and "-DBN=32" in cuda

    b = family_class_for(family(tmp_path, "hipfam", language="hip"))
    assert b.spec.language == "hip" and len(b.variants()) == 3
    monkeypatch.delenv("MLA_TUNE_HIPCC", raising=False)
    if find_compiler("hip") is None:
        assert "no hipcc here" in b.available(torch.device("cpu")).reason
        with pytest.raises(ToolchainError, match="hipcc"):
            b.compile(KVFormat.BF16, {"TILE": 64}, "gfx950")
    assert b.compile_key(Shape.uniform(1, 64), {"TILE": 64}, torch.device("cpu")) is None


def test_amdgpu_resource_remarks_are_parsed() -> None:
    # The remark format of LLVM's AMDGPU backend (-Rpass-analysis=kernel-resource-usage).
    text = "\n".join(f"k.hip:3:0: remark: {s}" for s in (
        "Function Name: mla_split", "    SGPRs: 40", "    VGPRs: 128", "    AGPRs: 16",
        "    ScratchSize [bytes/lane]: 0", "    SGPRs Spill: 0", "    VGPRs Spill: 12",
        "    LDS Size [bytes/block]: 65536"))
    regs, spills, lds = parse_amdgpu_remarks(text)
    assert regs == {"mla_split": 144} and spills == {"mla_split": 12}
    assert lds == {"mla_split": 65536}


def test_shipped_sources_stay_free_of_torch_headers() -> None:
    for src in (ROOT / "kernels/cuda").glob("*.cu"):
        assert "torch/" not in src.read_text() and "ATen" not in src.read_text(), src


def test_example_family_loads(monkeypatch: pytest.MonkeyPatch) -> None:
    path = ROOT / "examples/user_family/my_mla.toml"
    b = family_class_for(path)
    assert b.name == "my_mla" and [m["NW"] for _, m in b.variants()] == [2, 4, 8]
    assert b.supports(Shape.uniform(1, 64, kv_format="fp8")) is not None
