"""Compiled-source kernel families: a CUDA or HIP kernel with compile-time knobs, declared in
a family file (mla_tune/backends/compiled_spec.py) instead of a Python backend class.

One class serves every family file. Each distinct set of macros (the macro knobs plus the
KV format's defines) is one compile: nvcc (`-cubin`) or hipcc (`--genco`), cached on disk by
a hash of sources, flags, macros, arch and compiler version, compiled ahead in the sweep's
compile stage. The compiler's report (registers, spills, shared memory, entry parameters)
prunes variants before GPU time; the GPU worker loads the same image through the driver
(compiled_launch.py). A family named `X` is the class `family_X` of this module, made on
first use from `configs/backends/X.toml` or a file of that stem in $MLA_TUNE_BACKENDS, so
worker processes import it by path like any backend.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from mla_tune.backends.base import Availability, Backend, KernelFn
from mla_tune.backends.compiled_spec import (
    Arg,
    ContractError,
    FamilySpec,
    load_spec,
    shape_env,
)
from mla_tune.backends.compiled_toolchain import (
    REGISTER_FILE,
    SHARED_LIMIT,
    CompileReport,
    ToolchainError,
    compile_variant,
    find_compiler,
)
from mla_tune.problem.shapes import V_HEAD_DIM, KVFormat, Shape, TaskInput
from mla_tune.tuning.space import CONFIG_DIR, ParamSpace

FAMILIES_ENV = "MLA_TUNE_BACKENDS"
"""Family files outside configs/backends, separated by ':' (os.pathsep); each registers a
backend named after its file stem."""
CLASS_PREFIX = "family_"


def env_family_files() -> dict[str, Path]:
    """The family files named in $MLA_TUNE_BACKENDS, by backend name (file stem)."""
    out: dict[str, Path] = {}
    for item in os.environ.get(FAMILIES_ENV, "").split(os.pathsep):
        if item.strip():
            p = Path(item.strip()).expanduser()
            out[p.stem] = p
    return out


def family_file(name: str) -> Path:
    """Where the family `name` is declared."""
    return env_family_files().get(name) or CONFIG_DIR / "backends" / f"{name}.toml"


class CompiledSourceFamily(Backend):
    """A family described by a family file; subclasses made by `family_class` set
    `spec_path` and `name`."""

    spec_path: Path

    def __init__(self) -> None:
        self.spec: FamilySpec = load_spec(self.spec_path, self.name)
        self.description = self.spec.description or f"{self.spec.language} family {self.name}"

    # -- where it runs --------------------------------------------------------------------
    def _vendor_ok(self, device: torch.device) -> str | None:
        if device.type != "cuda" or not torch.cuda.is_available():
            return "no GPU here"
        if self.spec.language == "cuda" and torch.version.hip:
            return "a CUDA source needs an NVIDIA GPU (this is ROCm)"
        if self.spec.language == "hip" and not torch.version.hip:
            return "a HIP source needs an AMD GPU with ROCm"
        return None

    def available(self, device: torch.device) -> Availability:
        dev = torch.device(device)
        compiler = find_compiler(self.spec.language)
        tool = ("nvcc" if self.spec.language == "cuda" else "hipcc")
        where = (f"{tool} at {compiler}" if compiler else
                 f"no {tool} here" + ("" if self.spec.language == "cuda" else
                                      " (ROCm's compiler does not install from the registries;"
                                      " HIP sources are not compiled on such machines)"))
        why = self._vendor_ok(dev)
        if why:
            archs = ", ".join(self.spec.archs)
            return Availability(False, f"{why}; {self.spec.language} family for {archs}, "
                                       f"{where}")
        if compiler is None:
            return Availability(False, f"{where}: variants cannot be compiled")
        if self._arch(dev) is None:
            return Availability(False, f"device arch {self._device_arch(dev)} is not in "
                                       f"[family] archs {list(self.spec.archs)}")
        return Availability(True)

    def supports(self, shape: Shape) -> str | None:
        if shape.kv_format not in self.spec.formats:
            return (f"kv format {shape.kv_format.value} is not among the family's "
                    f"{[f.value for f in self.spec.formats]}")
        env = self._env(shape, {})
        for c in self.spec.constraints:
            if c.names <= env.keys() and not c(env):
                return f"shape fails constraint {c.text!r}"
        return None

    # -- the space ------------------------------------------------------------------------
    def declared_space(self, device: torch.device) -> ParamSpace:
        return _space(self.spec.path, self.name, torch.device(device).type)

    def _env(self, shape: Shape, config: Mapping[str, Any]) -> dict[str, Any]:
        env: dict[str, Any] = shape_env(shape)
        env.update(self.spec.defines.get(shape.kv_format.value, {}))
        env.update(self.spec.defaults)  # a stored config may predate a knob
        env.update(config)
        return env

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        env = self._env(shape, config)
        return all(c(env) for c in self.spec.constraints)

    def variants(self, device_type: str = "cuda") -> list[tuple[KVFormat, dict[str, Any]]]:
        """Every distinct compile of the declared space: (KV format, macro knobs), with the
        constraints that read only knobs and defines applied (what CI compiles)."""
        space = self.declared_space(torch.device(device_type))
        seen: dict[tuple, tuple[KVFormat, dict[str, Any]]] = {}
        for fmt in self.spec.formats:
            defines = self.spec.defines.get(fmt.value, {})
            for point in space.grid():
                env = {**defines, **point}
                if not all(c(env) for c in self.spec.constraints if c.names <= env.keys()):
                    continue
                macros = {k: point[k] for k in self.spec.macro_knobs}
                seen.setdefault((fmt, tuple(sorted(macros.items()))), (fmt, macros))
        return list(seen.values())

    def macros(self, kv_format: KVFormat, config: Mapping[str, Any]) -> dict[str, Any]:
        """The -D macros of a variant: the format's defines, then the macro knobs (those a
        stored config predates at their `[defaults]` value)."""
        config = {**self.spec.defaults, **config}
        out: dict[str, Any] = dict(self.spec.defines.get(kv_format.value, {}))
        out.update({k: config[k] for k in self.spec.macro_knobs})
        return out

    # -- compiling ------------------------------------------------------------------------
    @staticmethod
    def _device_arch(device: torch.device) -> str:
        props = torch.cuda.get_device_properties(device)
        if torch.version.hip:
            return str(props.gcnArchName).split(":", 1)[0]
        return f"sm_{props.major}{props.minor}"

    def _arch(self, device: torch.device) -> str | None:
        return self.spec.arch_for(self._device_arch(device))

    def compile(self, kv_format: KVFormat, config: Mapping[str, Any], arch: str) -> CompileReport:
        """The compiled variant for `arch` (a cache hit after the first time)."""
        return compile_variant(self.spec.language, self.spec.sources, arch, self.spec.flags,
                               self.macros(kv_format, config))

    def compile_key(self, shape: Shape, config: Mapping[str, Any],
                    device: torch.device) -> tuple | None:
        dev = torch.device(device)
        if self._vendor_ok(dev):
            return None
        macros = self.macros(shape.kv_format, config)
        return (self._arch(dev), tuple(sorted(macros.items())))

    def compile_ahead(self, shape: Shape, config: Mapping[str, Any], arch: str) -> None:
        target = self.spec.arch_for(arch)
        if target is not None:
            self.compile(shape.kv_format, config, target)

    def problem(self, report: CompileReport, shape: Shape,
                config: Mapping[str, Any]) -> str | None:
        """Why a compiled variant must not run on `shape`: a compile error, a contract the
        compiled entries contradict, spills, or more registers or shared memory than a
        block may have; None when it may run."""
        if not report.ok:
            return f"does not compile for {report.arch}: {report.error}"
        env = self._env(shape, config)
        for ln in self.spec.launches:
            if ln.when is not None and not ln.when(env):
                continue
            if report.params and ln.entry not in report.params:
                mangled = [n for n in report.params if ln.entry in n]
                hint = (f" (found C++-mangled {mangled[0]}: declare it extern \"C\")"
                        if mangled else "")
                return f"entry {ln.entry!r} is not in the compiled image{hint}"
            want = [a.size for a in ln.args]
            got = report.params.get(ln.entry)
            if got is not None and got != want:
                return (f"entry {ln.entry!r} takes parameters of {got} bytes, its [[launch]] "
                        f"passes {want} ({', '.join(a.describe() for a in ln.args)})")
            spills = report.spills.get(ln.entry, 0)
            regs = report.registers.get(ln.entry, 0)
            if spills:
                return f"{ln.entry} spills {spills} B (registers {regs})"
            threads = int(ln.block(env))
            limit = REGISTER_FILE.get(report.arch)
            if limit and regs * threads > limit:
                return f"{ln.entry}: {regs} registers x {threads} threads exceed {limit}"
            shared = int(ln.shared(env)) + report.static_shared.get(ln.entry, 0)
            cap = SHARED_LIMIT.get(report.arch)
            if cap and shared > cap:
                return f"{ln.entry}: shared memory {shared} B over {cap}"
        return None

    def precheck(self, shape: Shape, config: Mapping[str, Any],
                 device: torch.device) -> str | None:
        dev = torch.device(device)
        if self._vendor_ok(dev) or self._arch(dev) is None:
            return None
        try:
            report = self.compile(shape.kv_format, config, self._arch(dev))
        except ToolchainError as e:
            return str(e)
        return self.problem(report, shape, config)

    # -- running --------------------------------------------------------------------------
    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        from mla_tune.backends.compiled_launch import Launch, Module

        dev = torch.device(device)
        why = self._vendor_ok(dev)
        if why:
            raise RuntimeError(f"{self.name}: {why}")
        arch = self._arch(dev)
        if arch is None:
            raise RuntimeError(f"{self.name}: no compile target for {self._device_arch(dev)}")
        report = self.compile(shape.kv_format, config, arch)
        problem = self.problem(report, shape, config)
        if problem:
            raise RuntimeError(f"{self.name}: {problem}")
        env = self._env(shape, config)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        torch.cuda.set_device(index)
        module = Module(self.spec.language, Path(report.image).read_bytes(), index)
        out = torch.empty((shape.total_q, shape.heads, V_HEAD_DIM), dtype=torch.bfloat16,
                          device=dev)
        scratch = torch.zeros(max(16, int(self.spec.scratch(env))), dtype=torch.uint8,
                              device=dev)
        tensor_cells: list[tuple[Any, int]] = []  # (cell, position in the call's tensors)
        call_cells: list[tuple[Any, Arg]] = []  # scalars read from the call's tensors
        launches = []
        for ln in self.spec.launches:
            if ln.when is not None and not ln.when(env):
                continue
            cells = [_cell(a, env, tensor_cells, call_cells) for a in ln.args]
            launch = Launch(module, ln.entry, [int(g(env)) for g in ln.grid], int(ln.block(env)),
                            int(ln.shared(env)), cells)
            sizes = module.param_sizes(launch.fn)
            if sizes is not None and sizes != [a.size for a in ln.args]:
                raise RuntimeError(f"{self.name}: the driver reports {ln.entry} parameters "
                                   f"{sizes} bytes, the contract passes "
                                   f"{[a.size for a in ln.args]}")
            launches.append(launch)
        fmt = shape.kv_format
        base = {**env, "kv_scale_stride": 0}

        def run(data: TaskInput) -> torch.Tensor:
            q, kv_data, qo, kvp, _ = data
            if fmt is KVFormat.BF16:
                kv, scale = kv_data["bf16"], None
            else:
                kv, scale = kv_data[fmt.value]
            tensors = (q, kv, scale, qo, kvp, out, scratch)
            for cell, i in tensor_cells:
                t = tensors[i]
                cell.value = 0 if t is None else t.data_ptr()
            if call_cells:
                call_env = dict(base)
                if fmt is KVFormat.MXFP4:
                    call_env["kv_scale_stride"] = scale.stride(0) * scale.element_size()
                for cell, arg in call_cells:
                    cell.value = _scalar(arg, call_env)
            stream = torch.cuda.current_stream(dev).cuda_stream
            for launch in launches:
                launch(stream)
            return out

        return run

    def source_files(self) -> list[Path]:
        here = Path(__file__).resolve().parent
        return [*self.spec.sources, self.spec.path, Path(__file__).resolve(),
                here / "compiled_spec.py", here / "compiled_launch.py"]


def _scalar(arg: Arg, env: Mapping[str, Any]) -> int | float:
    assert arg.expr is not None
    v = arg.expr(env)
    return float(v) if arg.kind == "float" else int(v)


def _cell(arg: Arg, env: Mapping[str, Any], tensor_cells: list, call_cells: list) -> Any:
    """A ctypes cell for `arg`: tensor addresses and call-time scalars are filled in per
    call, the rest now."""
    import ctypes

    from mla_tune.backends.compiled_spec import CALL_VARS, TENSOR_ARGS

    if arg.kind == "tensor":
        cell = ctypes.c_uint64(0)
        tensor_cells.append((cell, TENSOR_ARGS.index(arg.name)))
        return cell
    cell = ctypes.c_float() if arg.kind == "float" else ctypes.c_int32()
    assert arg.expr is not None
    if arg.expr.names & set(CALL_VARS):
        call_cells.append((cell, arg))
    else:
        cell.value = _scalar(arg, env)
    return cell


@functools.cache
def _space(path: Path, name: str, device_type: str) -> ParamSpace:
    """`[space]` of a family file with its `[space.<device_type>]` lists applied, taking
    `[defaults]` for knobs a stored config lacks (tuned before the knob existed)."""
    spec = load_spec(path, name)
    space = dict(spec.space)
    per_device = {k: v for k, v in space.items() if isinstance(v, dict)}
    base = {k: v for k, v in space.items() if not isinstance(v, dict)}
    base.update(per_device.get(device_type, {}))
    return ParamSpace.from_mapping(base).with_defaults(spec.defaults)


_classes: dict[str, type[CompiledSourceFamily]] = {}


def family_class(name: str) -> type[CompiledSourceFamily]:
    """The backend class of family `name`, importable as `compiled_source:family_<name>`."""
    if name not in _classes:
        path = family_file(name)
        if not path.is_file():
            raise ContractError(f"no family file for backend {name!r}: looked for {path} "
                                f"(add configs/backends/{name}.toml or name the file in "
                                f"${FAMILIES_ENV})")
        cls = type(CLASS_PREFIX + name, (CompiledSourceFamily,),
                   {"name": name, "spec_path": path, "__module__": __name__,
                    "__qualname__": CLASS_PREFIX + name})
        _classes[name] = cls
    return _classes[name]


def __getattr__(attr: str) -> Any:
    if attr.startswith(CLASS_PREFIX):
        return family_class(attr[len(CLASS_PREFIX):])
    raise AttributeError(f"module {__name__!r} has no attribute {attr!r}")


__all__ = ["CLASS_PREFIX", "CompiledSourceFamily", "FAMILIES_ENV", "env_family_files",
           "family_class", "family_file"]
