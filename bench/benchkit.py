"""What the bench scripts share, taken from the package so a benchmark measures what the tuner
measures: the task's inputs (`mla_tune.problem.generate_input`), the float32 reference and
the sweep's correctness gate (`mla_tune.problem.reference`, `mla_tune.problem.verify`), the device's read
ceiling (the one the tuning DB stores for it, else measured by `mla_tune.machine.bandwidth`), and the
Triton variant notation the dev scripts take on their command lines.

Scripts run as `python3 bench/NAME.py` from the repository root, so this directory is on
`sys.path` and `import benchkit` needs nothing else. The package must be importable from this
checkout (`pip install -e .`, or `source .device/setup.sh` on the GPU machine, which puts the
root on PYTHONPATH): a benchmark run against another copy of mla_tune or kernels/ would
measure code that is not the checkout's, so importing this module refuses that.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parent.parent
"""The repository root (bench/ is its child)."""


def _check_checkout() -> None:
    """Refuse to run when mla_tune or kernels/ would be imported from anywhere but ROOT."""
    fix = ("run from the repository root after `pip install -e .` there, or with "
           "PYTHONPATH=. (on the GPU machine: `source .device/setup.sh`)")
    for name in ("mla_tune", "kernels"):
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None:
            raise SystemExit(f"bench/: cannot import {name}; {fix}")
        where = Path(spec.origin).resolve().parent.parent
        if where != ROOT:
            raise SystemExit(f"bench/: {name} would be imported from {where}, not from this "
                             f"checkout ({ROOT}); {fix}")


_check_checkout()

from mla_tune.problem.shapes import KVFormat, Shape, TaskInput, parse_shape  # noqa: E402

if TYPE_CHECKING:
    import torch

    from mla_tune.kernels.triton.mla_decode import KernelConfig
    from mla_tune.problem.verify import VerifyResult


def parse_format_shape(text: str, heads: int = 16) -> Shape:
    """'FORMAT:BATCHxKV' (e.g. 'fp8:256x8192') -> the uniform q_len-1 Shape."""
    fmt, _, dims = text.partition(":")
    if not dims:
        raise SystemExit(f"bad shape {text!r}: expected FORMAT:BATCHxKV, e.g. fp8:256x8192")
    try:
        return parse_shape(dims.split(":")[0], heads=heads, kv_format=KVFormat.parse(fmt))
    except ValueError as e:
        raise SystemExit(f"bad shape {text!r}: {e}") from None


def parse_int_knobs(text: str, heads: int = 16) -> tuple[Shape, dict[str, int]]:
    """'FORMAT:BATCHxKV:knob=value,...' with integer values -> (shape, knobs): a point of
    a family's space as the compiled and Gluon probes take it."""
    head, _, knobs = text.rpartition(":")
    shape = parse_format_shape(head, heads)
    try:
        return shape, {k: int(v) for k, v in (kv.split("=") for kv in knobs.split(",") if kv)}
    except ValueError as e:
        raise SystemExit(f"bad variant {text!r}: {e}") from None


def parse_variant(text: str, heads: int = 16) -> tuple[Shape, KernelConfig]:
    """'FORMAT:BATCHxKV:knob=value,...' -> (shape, the Triton kernel's KernelConfig), with
    KernelConfig's fields as knobs, e.g.
    'fp8:256x8192:compute=fp8,block_n=64,kv_load=tma,num_stages=3,num_splits=1'."""
    shape = parse_format_shape(text, heads)
    parts = text.split(":")
    return shape, kernel_config(parts[2] if len(parts) > 2 else "", shape.kv_format.value,
                                where=text)


def kernel_config(knobs: str, kv_format: str, where: str = "",
                  **defaults: object) -> KernelConfig:
    """'knob=value,...' (KernelConfig's fields as knobs) -> the Triton kernel's KernelConfig
    for `kv_format`; `defaults` are knobs the text may override. `where` names the text in
    errors."""
    from mla_tune.kernels.triton.mla_decode import KernelConfig

    types = {f.name: f.type for f in fields(KernelConfig)}
    kw: dict[str, object] = {**defaults, "kv_format": kv_format}
    for item in (knobs.split(",") if knobs else []):
        key, _, val = item.partition("=")
        if key not in types:
            raise SystemExit(f"{where or knobs}: unknown knob {key!r}; KernelConfig has "
                             f"{sorted(types)}")
        t = types[key]
        try:
            kw[key] = (val if t in ("str", str) else
                       bool(int(val)) if t in ("bool", bool) else int(val))
        except ValueError:
            raise SystemExit(f"{where or knobs}: knob {key} takes {t}, not {val!r}") from None
    return KernelConfig(**kw)


def load_kernel(path: Path) -> ModuleType:
    """A kernel source file (another version of kernels/triton/mla_decode.py) as a module of
    its own, so its kernels compile and run next to the checkout's."""
    spec = importlib.util.spec_from_file_location(f"mla_decode_{path.stem}", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def config_in(md: ModuleType, cfg: KernelConfig) -> Any:
    """`cfg` as the KernelConfig of kernel module `md` (another version of the kernel; knobs
    it does not have are left out)."""
    return md.KernelConfig(**{f.name: getattr(cfg, f.name) for f in fields(cfg)
                              if f.name in md.KernelConfig.__dataclass_fields__})


def task_input(shape: Shape, device: str | torch.device = "cuda", seed: int = 0) -> TaskInput:
    """The task tuple the sweep times (`mla_tune.problem.generate_input`), on `device`."""
    from mla_tune.problem.shapes import generate_input

    return generate_input(shape, seed=seed, device=device)


def launcher_args(data: TaskInput, kv_format: KVFormat | str) -> tuple:
    """The task tuple as `MlaDecodeLauncher.__call__` takes it for `kv_format`:
    (q, kv, fp8 scale, MXFP4 scales, qo_indptr, kv_indptr)."""
    import torch

    q, kv_data, qo, kvp, _ = data
    fmt = KVFormat(kv_format)
    if fmt is KVFormat.BF16:
        return q, kv_data["bf16"], None, None, qo, kvp
    if fmt is KVFormat.FP8:
        kv, scale = kv_data["fp8"]
        return q, kv, scale, None, qo, kvp
    kv, scales = kv_data["mxfp4"]
    if kv.dtype != torch.uint8:  # float4_e2m1fn_x2 storage: the same bytes
        kv = kv.view(torch.uint8)
    return q, kv, None, scales, qo, kvp


def prepared_launcher(md: ModuleType, cfg: KernelConfig, shape: Shape, data: TaskInput,
                      device: str = "cuda") -> Any:
    """Kernel module `md`'s launcher of `cfg` for `shape`, compiled (its raw launchers bound)
    for the inputs `data`."""
    launcher = md.MlaDecodeLauncher(config_in(md, cfg), heads=shape.heads, q_len=shape.q_len,
                                    kv_lens=list(shape.kv_lens), device=device)
    scales = launcher_args(data, shape.kv_format)[3]
    launcher.prepare(scales.stride(0) if scales is not None else 0)
    return launcher


def reference(data: TaskInput, kv_format: KVFormat | str) -> torch.Tensor:
    """The float32 reference output of the task tuple for `kv_format`."""
    from mla_tune.problem.reference import mla_decode_reference

    return mla_decode_reference(*data, kv_format=KVFormat(kv_format))


def check(out: torch.Tensor, ref: torch.Tensor, kv_format: KVFormat | str,
          atol_scale: float = 1.0) -> VerifyResult:
    """`out` judged against `ref` by the sweep's gate for the format
    (configs/tolerances.toml); `atol_scale` widens its atol for inputs scaled up by that
    factor (their outputs and rounding errors scale with them)."""
    from dataclasses import replace

    from mla_tune.problem.verify import check as gate
    from mla_tune.problem.verify import tolerance_for

    tol = tolerance_for(kv_format)
    return gate(out, ref, tol if atol_scale == 1.0 else replace(tol, atol=tol.atol * atol_scale))


def graphed(launch: Callable[[], object]) -> Callable[[], None]:
    """`launch` captured in a CUDA graph, returned as its replay: a timed call then costs no
    Python launch work (tens of µs through Triton's JIT path, descriptors included), which
    the timer's L2 flush hides only while it is shorter than the flush."""
    import torch

    launch()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        launch()
    return graph.replay


def _device_row(store: Any, device: str) -> Any:
    """The DB's row of this device's fingerprint, or None."""
    from mla_tune.machine.fingerprint import current_device

    fp_hash = current_device(device).hash
    return next((d for d in store.devices() if d.hash == fp_hash), None)


@functools.cache
def read_ceiling_gbps(device: str = "cuda:0", db: str = "shipped") -> float:
    """The device's read ceiling in GB/s, the figure reports compare kernels with: the one
    tuning DB `db` stores for this device model (a sweep measures and stores it once), else
    measured here (`mla_tune.bandwidth.measure_read_bandwidth`, a few seconds)."""
    from mla_tune.db import TuningStore
    from mla_tune.machine.bandwidth import measure_read_bandwidth

    with TuningStore(db, read_only=True) as store:
        row = _device_row(store, device)
    if row is not None and row.read_bw_gbps:
        return float(row.read_bw_gbps)
    gbps = measure_read_bandwidth(device)
    if not gbps:
        raise SystemExit(f"no read ceiling for {device}: it is not a GPU")
    return gbps


def best_stored_us(store: Any, device_id: int, shape: Shape, backend: str,
                   source: str | None) -> float | None:
    """Fastest stored median of `backend` at `shape` on device `device_id`, from correct
    trials of its kernel source `source` only (an edited kernel's old trials describe code
    that no longer exists)."""
    times = [t.median_us for t in store.trials(device_id=device_id, shape_key=shape.key,
                                               backend=backend, status="ok")
             if t.median_us is not None and t.source_hash == source]
    return min(times) if times else None


@functools.cache
def shipped_best_us(shape: Shape, backend: str, device: str = "cuda:0") -> float | None:
    """`best_stored_us` in the shipped tuning DB for this device model (None when it has no
    trial of the backend's current source there)."""
    from mla_tune.backends import source_hashes
    from mla_tune.db import TuningStore

    with TuningStore("shipped", read_only=True) as store:
        row = _device_row(store, device)
        if row is None:
            return None
        return best_stored_us(store, row.id, shape, backend, source_hashes().get(backend))
