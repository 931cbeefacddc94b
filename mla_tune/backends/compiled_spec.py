"""The family file of a compiled-source kernel family: parsing and the load-time contract check.

A family file (`configs/backends/<name>.toml`, or any file named in $MLA_TUNE_BACKENDS)
declares the kernel sources, their language, the knobs (macros or kernel arguments), the
constraints between knobs and shapes, the value a knob added later takes in results stored
before it (`[defaults]`), compiler flags per vendor and the launch contract (entries, grids,
blocks, shared bytes, arguments, scratch). Everything that can be wrong
in it without a compiler is reported here, when the family loads, naming the file and the
fix: a missing entry, an argument count that differs from the entry's parameters, a knob
the source never reads, an expression naming something unknown.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mla_tune.backends import UnknownBackendError
from mla_tune.backends.compiled_expr import Expr, ExprError, parse
from mla_tune.problem.shapes import KVFormat, Shape

LANGUAGES = ("cuda", "hip")
TENSOR_ARGS = ("q", "kv", "kv_scale", "qo_indptr", "kv_indptr", "out", "scratch")
"""Tensors a launch may receive: the task's q, the KV format's data tensor and its scale
(fp8: float32 (1,); MXFP4: E8M0 bytes, row stride `kv_scale_stride`; bf16: null), the
indptr arrays, the (total_q, heads, 512) bf16 output and the family's scratch buffer."""
SHAPE_VARS = ("batch", "heads", "q_len", "kv_len", "min_kv_len", "total_kv", "total_q",
              "page_size")
CALL_VARS = ("kv_scale_stride",)
"""Read from the call's tensors (the MXFP4 scale tensor's row stride in bytes; 0 otherwise)."""
CONST_VARS = ("sm_scale",)
SCALAR_KINDS = {"int": 4, "float": 4}
POINTER_BYTES = 8


class ContractError(UnknownBackendError):
    """A family file that cannot describe a working family (an UnknownBackendError: the
    CLI reports it and exits 2, as for a backend name it does not know)."""


@dataclass(frozen=True)
class Arg:
    """One kernel argument: a task tensor, or an int32/float32 computed by `expr`."""

    kind: str  # "tensor", "int" or "float"
    name: str = ""
    expr: Expr | None = None

    @property
    def size(self) -> int:
        return POINTER_BYTES if self.kind == "tensor" else SCALAR_KINDS[self.kind]

    def describe(self) -> str:
        return self.name if self.kind == "tensor" else f"{self.kind}:{self.expr.text}"


@dataclass(frozen=True)
class LaunchSpec:
    """One kernel launch of a call, in order."""

    entry: str
    grid: tuple[Expr, ...]
    block: Expr
    shared: Expr
    args: tuple[Arg, ...]
    when: Expr | None = None


@dataclass(frozen=True)
class FamilySpec:
    """A parsed, checked family file."""

    name: str
    path: Path
    description: str
    language: str
    sources: tuple[Path, ...]
    formats: tuple[KVFormat, ...]
    archs: tuple[str, ...]
    defines: Mapping[str, Mapping[str, int]]
    flags: tuple[str, ...]
    space: Mapping[str, Any]
    runtime_knobs: frozenset[str]
    constraints: tuple[Expr, ...]
    scratch: Expr
    launches: tuple[LaunchSpec, ...]
    defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def knobs(self) -> list[str]:
        return [k for k, v in self.space.items() if not isinstance(v, dict)]

    @property
    def macro_knobs(self) -> list[str]:
        return [k for k in self.knobs if k not in self.runtime_knobs]

    def arch_for(self, device_arch: str) -> str | None:
        """The family's compile target for a device of `device_arch` ('sm_90' -> 'sm_90a')."""
        for a in self.archs:
            if a == device_arch or (a.startswith(device_arch) and a[len(device_arch):] == "a"):
                return a
        return None


def shape_env(shape: Shape) -> dict[str, int | float]:
    """The shape variables of expressions."""
    from mla_tune.problem.shapes import SM_SCALE

    return {"batch": shape.batch, "heads": shape.heads, "q_len": shape.q_len,
            "kv_len": shape.kv_len, "min_kv_len": min(shape.kv_lens),
            "total_kv": shape.total_kv, "total_q": shape.total_q,
            "page_size": shape.page_size, "sm_scale": SM_SCALE}


def _fail(path: Path, msg: str) -> ContractError:
    return ContractError(f"{path}: {msg}")


def strip_comments(code: str) -> str:
    """C/C++ source without comments (strings are rare in kernels and left as they are)."""
    code = re.sub(r"/\*.*?\*/", " ", code, flags=re.S)
    return re.sub(r"//[^\n]*", "", code)


def entry_params(code: str, entry: str) -> list[str] | None:
    """The parameter declarations of `__global__ ... void entry(...)` in `code` (comments
    stripped), or None when the source defines no such entry."""
    attrs = r"(?:\w+(?:\s*\([^)]*\))?\s+)*?"  # __launch_bounds__(..), __cluster_dims__(..), macros
    m = re.search(rf"__global__\s+{attrs}void\s+{attrs}{re.escape(entry)}\s*\(", code)
    if m is None:
        return None
    depth, start, params = 1, m.end(), []
    i = start
    while i < len(code) and depth:
        c = code[i]
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if (c == "," and depth == 1) or depth == 0:
            params.append(code[start:i].strip())
            start = i + 1
        i += 1
    return [p for p in params if p and p != "void"]


_PREPROCESSOR_GUARD = re.compile(r"^\s*#\s*(ifndef|ifdef|undef|error|warning)\b.*$", re.M)


def reads_macro(code: str, knob: str) -> bool:
    """Whether `code` uses macro `knob` beyond guarding or defaulting it."""
    code = _PREPROCESSOR_GUARD.sub("", code)
    code = re.sub(rf"^\s*#\s*define\s+{re.escape(knob)}\b.*$", "", code, flags=re.M)
    code = re.sub(rf"defined\s*\(?\s*{re.escape(knob)}\b", "", code)
    return re.search(rf"\b{re.escape(knob)}\b", code) is not None


def _expr(path: Path, raw: object, where: str, allowed: set[str]) -> Expr:
    try:
        e = parse(raw, where)
    except ExprError as exc:
        raise _fail(path, str(exc)) from None
    unknown = e.names - allowed
    if unknown:
        raise _fail(path, f"{where}: {e.text!r} names {sorted(unknown)}, which is not a knob, "
                          f"a shape variable ({', '.join(SHAPE_VARS)}) or a define")
    return e


def _arg(path: Path, raw: object, where: str, allowed: set[str]) -> Arg:
    if not isinstance(raw, str):
        raise _fail(path, f"{where}: expected a string, got {raw!r}")
    if raw in TENSOR_ARGS:
        return Arg("tensor", raw)
    kind, sep, text = raw.partition(":")
    if not sep or kind not in SCALAR_KINDS:
        raise _fail(path, f"{where}: {raw!r} is neither a tensor ({', '.join(TENSOR_ARGS)}) "
                          "nor a scalar written int:EXPR or float:EXPR")
    return Arg(kind, expr=_expr(path, text, where, allowed | set(CALL_VARS)))


def load_spec(path: Path, name: str | None = None) -> FamilySpec:
    """Read and check the family file at `path` (see the module docstring)."""
    path = Path(path)
    try:
        data = tomllib.loads(path.read_text())
    except OSError as e:
        raise ContractError(f"cannot read family file {path}: {e.strerror or e}") from None
    except tomllib.TOMLDecodeError as e:
        raise _fail(path, f"not valid TOML: {e}") from None
    fam = data.get("family")
    if not isinstance(fam, dict):
        raise _fail(path, "no [family] table (language, sources, formats, archs)")
    language = fam.get("language")
    if language not in LANGUAGES:
        raise _fail(path, f"[family] language must be one of {LANGUAGES}, got {language!r}")
    raw_sources = fam.get("sources")
    if not isinstance(raw_sources, list) or not raw_sources:
        raise _fail(path, "[family] sources must list the kernel file first (then headers)")
    sources = tuple((path.parent / str(s)).resolve() for s in raw_sources)
    for s in sources:
        if not s.is_file():
            raise _fail(path, f"source {s} does not exist (paths are relative to the file)")
    try:
        formats = tuple(KVFormat.parse(str(f)) for f in fam.get("formats", []))
    except ValueError as e:
        raise _fail(path, f"[family] formats: {e}") from None
    if not formats:
        raise _fail(path, "[family] formats must name the KV formats the kernel reads")
    archs = tuple(str(a) for a in fam.get("archs", []))
    if not archs:
        raise _fail(path, "[family] archs must list compile targets (e.g. sm_90a, gfx950)")
    defines = {f.value: dict(fam.get("defines", {}).get(f.value, {})) for f in formats}
    space = data.get("space")
    if not isinstance(space, dict) or not space:
        raise _fail(path, "no [space] table of knobs")
    knobs = [k for k, v in space.items() if not isinstance(v, dict)]
    runtime = frozenset(fam.get("runtime_knobs", []))
    if runtime - set(knobs):
        raise _fail(path, f"runtime_knobs {sorted(runtime - set(knobs))} are not in [space]")
    define_names = {k for d in defines.values() for k in d}
    clash = define_names & set(knobs)
    if clash:
        raise _fail(path, f"{sorted(clash)} are both knobs and format defines")
    defaults = data.get("defaults", {})
    if not isinstance(defaults, dict):
        raise _fail(path, "[defaults] must be a table of knob = value")
    for k, v in defaults.items():
        if k not in knobs:
            raise _fail(path, f"[defaults] names {k!r}, which is not a knob of [space]")
        if v not in space[k]:
            raise _fail(path, f"[defaults] {k} = {v!r} is not one of its values {space[k]}")
    allowed = set(knobs) | set(SHAPE_VARS) | set(CONST_VARS) | define_names
    constraints = tuple(_expr(path, c, f"constraint {i + 1}", allowed)
                        for i, c in enumerate(fam.get("constraints", [])))
    flags = tuple(str(f) for f in data.get("flags", {}).get(language, []))
    scratch = _expr(path, data.get("scratch", {}).get("bytes", 0), "[scratch] bytes", allowed)
    raw_launches = data.get("launch")
    if not isinstance(raw_launches, list) or not raw_launches:
        raise _fail(path, "no [[launch]] tables (entry, grid, block, shared, args)")
    launches = []
    for i, ln in enumerate(raw_launches):
        where = f"[[launch]] {i + 1}"
        entry = ln.get("entry")
        if not isinstance(entry, str) or not re.fullmatch(r"[A-Za-z_]\w*", entry):
            raise _fail(path, f"{where}: entry must be the kernel's function name")
        grid = ln.get("grid")
        if not isinstance(grid, list) or not 1 <= len(grid) <= 3:
            raise _fail(path, f"{where}: grid must be a list of 1-3 expressions")
        launches.append(LaunchSpec(
            entry=entry,
            grid=tuple(_expr(path, g, f"{where} grid", allowed) for g in grid),
            block=_expr(path, ln.get("block", 128), f"{where} block", allowed),
            shared=_expr(path, ln.get("shared", 0), f"{where} shared", allowed),
            args=tuple(_arg(path, a, f"{where} args[{j}]", allowed)
                       for j, a in enumerate(ln.get("args", []))),
            when=_expr(path, ln["when"], f"{where} when", allowed) if "when" in ln else None))
    spec = FamilySpec(
        name=name or str(fam.get("name") or path.stem), path=path,
        description=str(fam.get("description", "")), language=language, sources=sources,
        formats=formats, archs=archs, defines=defines, flags=flags, space=space,
        runtime_knobs=runtime, constraints=constraints, scratch=scratch,
        launches=tuple(launches), defaults=defaults)
    check_contract(spec)
    return spec


def check_contract(spec: FamilySpec) -> None:
    """What can be checked in the sources without compiling: every entry exists with as
    many parameters as its launch passes, every macro knob is read by the source, every
    runtime knob reaches a launch."""
    code = strip_comments("\n".join(s.read_text(errors="replace") for s in spec.sources))
    for ln in spec.launches:
        params = entry_params(code, ln.entry)
        if params is None:
            raise _fail(spec.path, f"entry {ln.entry!r} is not a __global__ function of "
                                   f"{', '.join(s.name for s in spec.sources)}; define it "
                                   "(extern \"C\" __global__ void ...) or fix [[launch]] entry")
        if len(params) != len(ln.args):
            raise _fail(spec.path, f"entry {ln.entry!r} takes {len(params)} parameters but its "
                                   f"[[launch]] passes {len(ln.args)} "
                                   f"({', '.join(a.describe() for a in ln.args)})")
    for knob in spec.macro_knobs:
        if not reads_macro(code, knob):
            raise _fail(spec.path, f"knob {knob!r} is passed as the macro -D{knob}=... but the "
                                   "source never reads it; use it, drop it from [space], or "
                                   "list it in runtime_knobs and pass it as an argument")
    used: set[str] = set(spec.scratch.names)
    for ln in spec.launches:
        exprs = [*ln.grid, ln.block, ln.shared, *(a.expr for a in ln.args if a.expr)]
        exprs += [ln.when] if ln.when else []
        for e in exprs:
            used |= e.names
    for knob in sorted(spec.runtime_knobs - used):
        raise _fail(spec.path, f"runtime knob {knob!r} reaches no launch (grid, block, "
                               "shared or args): the kernel could never see it")


__all__ = ["Arg", "CALL_VARS", "ContractError", "FamilySpec", "LaunchSpec", "SHAPE_VARS",
           "TENSOR_ARGS", "check_contract", "entry_params", "load_spec", "reads_macro",
           "shape_env", "strip_comments"]
