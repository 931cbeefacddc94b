"""Load a compiled device image and launch its entries through the GPU driver (ctypes).

The image is the very file the static check inspected, loaded with `cuModuleLoadData`
(NVIDIA) or `hipModuleLoadData` (AMD) into the context torch uses; launches go on torch's
current stream. No binding code is compiled per variant, so a variant's build is one
compiler run with no torch headers in it. Arguments are packed once per build into ctypes
cells; a call only rewrites the tensor addresses and launches.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

_DYNAMIC_SHARED_ATTR = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (hip: same value)
_NON_PORTABLE_CLUSTER_ATTR = 14  # CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED
_INVALID_CONTEXT = 201     # CUDA_ERROR_INVALID_CONTEXT


class LaunchError(RuntimeError):
    """The driver refused to load or launch a variant."""


@dataclass(frozen=True)
class _Api:
    lib: ctypes.CDLL
    prefix: str  # "cu" or "hip"

    def call(self, name: str, *args: object) -> None:
        rc = getattr(self.lib, self.prefix + name)(*args)
        if rc != 0:
            raise LaunchError(f"{self.prefix}{name} failed: {self.error(rc)}")

    def error(self, rc: int) -> str:
        text = ctypes.c_char_p()
        fn = getattr(self.lib, "cuGetErrorString" if self.prefix == "cu" else "hipGetErrorString")
        if self.prefix == "cu":
            fn(rc, ctypes.byref(text))
            return f"{rc} {text.value.decode() if text.value else ''}"
        fn.restype = ctypes.c_char_p
        return f"{rc} {fn(rc).decode()}"


@functools.cache
def driver(language: str) -> _Api:
    """The GPU driver library for `language` ('cuda' or 'hip')."""
    name, prefix = ("libcuda.so.1", "cu") if language == "cuda" else ("libamdhip64.so", "hip")
    try:
        return _Api(ctypes.CDLL(name), prefix)
    except OSError as e:
        raise LaunchError(f"cannot load the GPU driver {name}: {e}") from e


class Module:
    """One loaded image and its entries, in the current device's primary context."""

    def __init__(self, language: str, image: bytes, device_index: int) -> None:
        self.api = driver(language)
        self._image = ctypes.create_string_buffer(image, len(image))
        self.ctx = ctypes.c_void_p()
        if self.api.prefix == "cu":
            dev = ctypes.c_int()
            self.api.call("DeviceGet", ctypes.byref(dev), device_index)
            self.api.call("DevicePrimaryCtxRetain", ctypes.byref(self.ctx), dev)
            self.api.call("CtxSetCurrent", self.ctx)
        self.handle = ctypes.c_void_p()
        self.api.call("ModuleLoadData", ctypes.byref(self.handle), self._image)

    def function(self, name: str, dynamic_shared: int) -> ctypes.c_void_p:
        fn = ctypes.c_void_p()
        self.api.call("ModuleGetFunction", ctypes.byref(fn), self.handle, name.encode())
        if dynamic_shared > 48 * 1024:
            self.api.call("FuncSetAttribute", fn, _DYNAMIC_SHARED_ATTR,
                          ctypes.c_int(dynamic_shared))
        if self.api.prefix == "cu":
            # Lets an entry compiled with __cluster_dims__ above 8 (Hopper's non-portable
            # sizes, up to 16) launch; a driver without the attribute refuses it here and
            # such a launch then fails with the driver's own error.
            self.api.lib.cuFuncSetAttribute(fn, _NON_PORTABLE_CLUSTER_ATTR, ctypes.c_int(1))
        return fn

    def param_sizes(self, fn: ctypes.c_void_p) -> list[int] | None:
        """The entry's parameter sizes as the driver sees them (CUDA 12.4+), else None."""
        if self.api.prefix != "cu" or not hasattr(self.api.lib, "cuFuncGetParamInfo"):
            return None
        sizes = []
        while True:
            off, size = ctypes.c_size_t(), ctypes.c_size_t()
            rc = self.api.lib.cuFuncGetParamInfo(fn, ctypes.c_size_t(len(sizes)),
                                                 ctypes.byref(off), ctypes.byref(size))
            if rc != 0:
                return sizes
            sizes.append(size.value)


Cell = ctypes.c_uint64 | ctypes.c_int32 | ctypes.c_float


class Launch:
    """One entry with its grid, block, shared bytes and argument cells."""

    def __init__(self, module: Module, entry: str, grid: Sequence[int], block: int,
                 shared: int, cells: Sequence[Cell]) -> None:
        self.module = module
        self.fn = module.function(entry, shared)
        self.grid = tuple(int(g) for g in (*grid, 1, 1)[:3])
        self.block, self.shared = int(block), int(shared)
        self.cells = list(cells)
        self.params = (ctypes.c_void_p * max(1, len(cells)))(
            *[ctypes.cast(ctypes.pointer(c), ctypes.c_void_p) for c in cells])

    def __call__(self, stream: int) -> None:
        api = self.module.api
        launch = getattr(api.lib, api.prefix + "LaunchKernel" if api.prefix == "cu"
                         else "hipModuleLaunchKernel")
        gx, gy, gz = self.grid
        rc = launch(self.fn, gx, gy, gz, self.block, 1, 1, self.shared,
                    ctypes.c_void_p(stream), self.params, None)
        if rc == _INVALID_CONTEXT and api.prefix == "cu":  # a thread with no current context
            api.call("CtxSetCurrent", self.module.ctx)
            rc = launch(self.fn, gx, gy, gz, self.block, 1, 1, self.shared,
                        ctypes.c_void_p(stream), self.params, None)
        if rc != 0:
            raise LaunchError(f"launch failed: {api.error(rc)}")


__all__ = ["Launch", "LaunchError", "Module", "driver"]
