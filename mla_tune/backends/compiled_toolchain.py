"""Compilers of compiled-source families: command lines, the on-disk cache, and what the
compiler reports about each variant (registers, spills, shared memory, entry parameters).

A variant is compiled once per distinct (sources, flags, macros, arch, toolchain version)
into a device image (a cubin on NVIDIA, a code object on AMD) that both the static check
and the GPU worker read, so a sweep's compile stage, its precheck and its build share one
compile. Nothing here imports torch: CI compiles every variant on a machine without a GPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

NVCC_ENV = "MLA_TUNE_NVCC"
HIPCC_ENV = "MLA_TUNE_HIPCC"
FAMILIES_ENV_NAME = "MLA_TUNE_BACKENDS"
COMPILE_TIMEOUT_S = 300.0

SHARED_LIMIT = {"sm_90": 232448, "sm_90a": 232448, "gfx950": 163840, "gfx942": 65536}
"""Max shared memory per block (bytes): H100/H200 227 KiB; MI355X 160 KiB; MI300 64 KiB."""
REGISTER_FILE = {"sm_90": 65536, "sm_90a": 65536}
"""32-bit registers per SM: a block needing more cannot launch."""


class ToolchainError(RuntimeError):
    """The compiler a family needs is not installed here."""


@dataclass(frozen=True)
class CompileReport:
    """One compiled variant: its image on disk and the compiler's resource report."""

    ok: bool
    arch: str
    image: str = ""
    error: str = ""
    registers: dict[str, int] = field(default_factory=dict)
    spills: dict[str, int] = field(default_factory=dict)
    static_shared: dict[str, int] = field(default_factory=dict)
    params: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "CompileReport":
        return cls(**json.loads(text))


def find_compiler(language: str) -> str | None:
    """Path of nvcc (language 'cuda') or hipcc ('hip'): $MLA_TUNE_NVCC / $MLA_TUNE_HIPCC,
    then PATH, then the toolkit's usual homes; None when there is none."""
    env, exe, homes = ((NVCC_ENV, "nvcc", ("CUDA_HOME", "CUDA_PATH"))
                       if language == "cuda" else (HIPCC_ENV, "hipcc", ("ROCM_PATH", "HIP_PATH")))
    if os.environ.get(env):
        return os.environ[env]
    found = shutil.which(exe)
    if found:
        return found
    roots = [os.environ[h] for h in homes if os.environ.get(h)]
    roots += ["/usr/local/cuda"] if language == "cuda" else ["/opt/rocm"]
    for root in roots:
        cand = Path(root) / "bin" / exe
        if cand.is_file():
            return str(cand)
    return None


def compilers_summary() -> str:
    """One line for `mla-tune doctor`: which compiler each language has here."""
    parts = []
    for language, tool in (("cuda", "nvcc"), ("hip", "hipcc")):
        path = find_compiler(language)
        if path is None:
            why = ("`pip install nvidia-cuda-nvcc` installs it" if language == "cuda" else
                   "ROCm's compiler does not install from the registries; HIP family files "
                   "load and are checked, their variants are not compiled here")
            parts.append(f"{language}: no {tool} ({why})")
        else:
            try:
                parts.append(f"{language}: {tool} at {path} ({toolchain_version(path)})")
            except ToolchainError as e:
                parts.append(f"{language}: {tool} at {path} does not run ({e})")
    return "; ".join(parts) + f"; extra family files via ${FAMILIES_ENV_NAME}"


@functools.cache
def toolchain_version(compiler: str) -> str:
    """The compiler's own version text (part of the cache key: an upgrade changes code)."""
    try:
        res = subprocess.run([compiler, "--version"], capture_output=True, text=True,
                             timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"{compiler} --version failed: {e}") from e
    lines = [ln.strip() for ln in (res.stdout + res.stderr).splitlines() if ln.strip()]
    return " | ".join(lines[-2:]) if lines else "unknown"


def compile_command(language: str, compiler: str, source: Path, output: Path, arch: str,
                    flags: Sequence[str], defines: Mapping[str, object],
                    include_dirs: Sequence[Path], keep_dir: Path | None = None) -> list[str]:
    """The command that compiles `source` into a device image for `arch`, with verbose
    resource output: `nvcc -cubin -arch=sm_90a -Xptxas -v` (keeping the PTX, which names
    every entry's parameters) or `hipcc --genco --offload-arch=gfx950` with the AMDGPU
    resource-usage remarks."""
    macros = [f"-D{k}={_macro_value(v)}" for k, v in defines.items()]
    incs = [f"-I{d}" for d in include_dirs]
    if language == "cuda":
        cmd = [compiler, "-cubin", f"-arch={arch}", "-Xptxas", "-v", *flags, *macros, *incs]
        if keep_dir is not None:
            cmd += ["--keep", "--keep-dir", str(keep_dir)]
        return [*cmd, "-o", str(output), str(source)]
    if language == "hip":
        return [compiler, "--genco", f"--offload-arch={arch}",
                "-Rpass-analysis=kernel-resource-usage", *flags, *macros, *incs,
                "-o", str(output), str(source)]
    raise ValueError(f"unknown language {language!r}")


def _macro_value(v: object) -> str:
    if isinstance(v, bool):
        return "1" if v else "0"
    return str(v)


def cache_dir() -> Path:
    """Where images and reports live: `$MLA_TUNE_CACHE/compiled` (default ~/.cache/mla-tune)."""
    root = os.environ.get("MLA_TUNE_CACHE") or Path.home() / ".cache" / "mla-tune"
    return Path(root) / "compiled"


def cache_key(language: str, sources: Sequence[Path], arch: str, flags: Sequence[str],
              defines: Mapping[str, object], version: str) -> str:
    """Hash of everything that decides the compiled code."""
    h = hashlib.sha256()
    for p in sources:
        h.update(Path(p).name.encode())
        h.update(Path(p).read_bytes())
    h.update(json.dumps([language, arch, list(flags),
                         sorted((k, _macro_value(v)) for k, v in defines.items()),
                         version]).encode())
    return h.hexdigest()[:24]


def parse_ptxas(text: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(registers, spill bytes, static shared bytes) per entry from `ptxas -v` output."""
    regs: dict[str, int] = {}
    spills: dict[str, int] = {}
    shared: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"(?:Compiling entry function|Function properties for) '?([\w$]+)'?", line)
        if m:
            current = m.group(1)
            continue
        if current is None:
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            spills[current] = int(m.group(1)) + int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            regs[current] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            shared[current] = int(s.group(1)) if s else 0
    return regs, spills, shared


def parse_amdgpu_remarks(text: str) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(VGPRs + AGPRs, spills, LDS bytes) per kernel from the AMDGPU compiler's
    `-Rpass-analysis=kernel-resource-usage` remarks."""
    regs: dict[str, int] = {}
    spills: dict[str, int] = {}
    shared: dict[str, int] = {}
    current = None
    for line in text.splitlines():
        m = re.search(r"Function Name: ([\w$]+)", line)
        if m:
            current = m.group(1)
            regs[current] = spills[current] = shared[current] = 0
            continue
        if current is None:
            continue
        m = re.search(r"\b(VGPRs|AGPRs): (\d+)", line)
        if m:
            regs[current] += int(m.group(2))
        m = re.search(r"(SGPRs|VGPRs) Spill: (\d+)", line)
        if m:
            spills[current] += int(m.group(2))
        m = re.search(r"LDS Size \[bytes/block\]: (\d+)", line)
        if m:
            shared[current] = int(m.group(1))
    return regs, spills, shared


_PTX_TYPE_BYTES = {"8": 1, "16": 2, "32": 4, "64": 8}


def parse_ptx_entries(ptx: str) -> dict[str, list[int]]:
    """Parameter sizes in bytes of every `.entry` of a PTX text (the compiler's own record
    of a kernel's signature, so an argument-count mismatch is caught before any launch)."""
    out: dict[str, list[int]] = {}
    for m in re.finditer(r"\.entry\s+([\w$]+)\s*\((.*?)\)", ptx, re.S):
        sizes = []
        for param in m.group(2).split(","):
            param = param.strip()
            if not param:
                continue
            arr = re.search(r"\.b8\s+[\w$]+\[(\d+)\]", param)
            if arr:
                sizes.append(int(arr.group(1)))
                continue
            t = re.search(r"\.[busf](8|16|32|64)\b", param)
            sizes.append(_PTX_TYPE_BYTES[t.group(1)] if t else 0)
        out[m.group(1)] = sizes
    return out


def _read_report(path: Path) -> CompileReport | None:
    """A cached report whose image still exists, else None (a miss is recompiled)."""
    try:
        rep = CompileReport.from_json(path.read_text())
    except (OSError, ValueError, TypeError):
        return None
    if rep.ok and not Path(rep.image).is_file():
        return None
    return rep


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `path` through a temporary file and a rename: concurrent compiles of one
    variant (several GPU workers, the compile stage) never see a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def compile_variant(language: str, sources: Sequence[Path], arch: str, flags: Sequence[str],
                    defines: Mapping[str, object], use_cache: bool = True) -> CompileReport:
    """Compile `sources[0]` (the others are headers it includes) with `defines` for `arch`,
    or return the cached result. A compile error is a report (ok False), never a raise;
    a missing compiler raises ToolchainError."""
    import time

    compiler = find_compiler(language)
    if compiler is None:
        what = ("nvcc (CUDA toolkit; `pip install nvidia-cuda-nvcc` where it is missing)"
                if language == "cuda" else "hipcc (ROCm; not installable from the registries)")
        env = NVCC_ENV if language == "cuda" else HIPCC_ENV
        raise ToolchainError(f"no {what} found; set ${env} to its path")
    version = toolchain_version(compiler)
    key = cache_key(language, sources, arch, flags, defines, version)
    base = cache_dir() / key
    report_path = base.with_suffix(".json")
    if use_cache and (cached := _read_report(report_path)) is not None:
        return cached
    t0 = time.time()
    suffix = ".cubin" if language == "cuda" else ".hsaco"
    includes = sorted({Path(s).resolve().parent for s in sources})
    with tempfile.TemporaryDirectory(prefix="mla-tune-cc-") as tmp:
        out = Path(tmp) / ("variant" + suffix)
        cmd = compile_command(language, compiler, Path(sources[0]), out, arch, flags, defines,
                              includes, keep_dir=Path(tmp) if language == "cuda" else None)
        try:
            res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp,
                                 timeout=COMPILE_TIMEOUT_S)
            text, failed = res.stdout + res.stderr, res.returncode != 0 or not out.is_file()
        except subprocess.TimeoutExpired:
            text, failed = f"compiler timed out after {COMPILE_TIMEOUT_S:.0f} s", True
        seconds = round(time.time() - t0, 2)
        if failed:
            errors = [ln for ln in text.splitlines() if "error" in ln.lower()] or text.splitlines()
            rep = CompileReport(False, arch, error=" | ".join(errors[:4])[:600], seconds=seconds)
        else:
            if language == "cuda":
                regs, spills, shared = parse_ptxas(text)
                params: dict[str, list[int]] = {}
                for ptx in Path(tmp).glob("*.ptx"):
                    params.update(parse_ptx_entries(ptx.read_text()))
            else:
                regs, spills, shared = parse_amdgpu_remarks(text)
                params = {}
            image = base.with_suffix(suffix)
            _write_atomic(image, out.read_bytes())
            rep = CompileReport(True, arch, str(image), registers=regs, spills=spills,
                                static_shared=shared, params=params, seconds=seconds)
    if use_cache:
        with contextlib.suppress(OSError):
            _write_atomic(report_path, rep.to_json().encode())
    return rep


__all__ = ["CompileReport", "REGISTER_FILE", "SHARED_LIMIT", "ToolchainError", "cache_dir",
           "cache_key", "compile_command", "compile_variant", "compilers_summary",
           "find_compiler", "parse_amdgpu_remarks", "parse_ptx_entries", "parse_ptxas", "toolchain_version"]
