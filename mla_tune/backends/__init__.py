"""Registry of kernel families. Backends are imported lazily so a missing library
(FlashInfer, aiter) never breaks importing mla_tune."""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

from mla_tune.backends.base import Availability, Backend, KernelFn

_REGISTRY: dict[str, str] = {
    "torch": "mla_tune.backends.torch_family:TorchFamily",
    "flashinfer": "mla_tune.backends.flashinfer_backend:FlashInferBackend",
    "aiter": "mla_tune.backends.aiter_backend:AiterBackend",
    "triton": "mla_tune.backends.triton_family:TritonFamily",
    "cuda": "mla_tune.backends.compiled_source:family_cuda",
    "cuda_mma": "mla_tune.backends.compiled_source:family_cuda_mma",
    "cuda_frag": "mla_tune.backends.compiled_source:family_cuda_frag",
    "cuda_wgmma": "mla_tune.backends.compiled_source:family_cuda_wgmma",
}

_instances: dict[str, Backend] = {}
T = TypeVar("T")


class UnknownBackendError(ValueError):
    pass


def register(name: str, target: str) -> None:
    """Register a backend class by import path `module:Class` (used by tests and plugins)."""
    _REGISTRY[name] = target
    _instances.pop(name, None)


def backend_names() -> list[str]:
    return list(_REGISTRY)


def get_backend(name: str) -> Backend:
    if name not in _REGISTRY:
        raise UnknownBackendError(
            f"unknown backend {name!r}; known backends: {', '.join(_REGISTRY)}")
    if name not in _instances:
        module, cls = _REGISTRY[name].split(":")
        _instances[name] = getattr(importlib.import_module(module), cls)()
    return _instances[name]


def _per_backend(value: Callable[[Backend], T]) -> dict[str, T]:
    """`value` of every backend that can be loaded here (an unloadable one has none)."""
    out: dict[str, T] = {}
    for name in _REGISTRY:
        try:
            out[name] = value(get_backend(name))
        except Exception:  # noqa: BLE001 - an unloadable backend has no current source
            continue
    return out


def source_hashes() -> dict[str, str]:
    """Kernel-source hash of every backend that can be loaded here: trials and winners of
    other sources (edited or removed kernels) are never reused."""
    return _per_backend(lambda b: b.source_hash())


def source_hash_pairs() -> dict[str, tuple[str, str]]:
    """(bytes hash, code hash) of every backend that can be loaded here: results stored
    under the first are this checkout's code under its old name (`mla-tune rehash`)."""
    return _per_backend(lambda b: (b.source_bytes_hash(), b.source_hash()))


def source_files() -> dict[str, list[Path]]:
    """The files each loadable backend's source hash is made of (`mla-tune rehash
    --from-git` hashes them as an earlier revision held them)."""
    return _per_backend(lambda b: list(b.source_files()))


EXTRA_BACKENDS_ENV = "MLA_TUNE_EXTRA_BACKENDS"


def _register_from_env() -> None:
    """Register backends named in $MLA_TUNE_EXTRA_BACKENDS (`name=module:Class,...`), so a
    plugin or test backend reaches a CLI run and its worker processes."""
    for item in os.environ.get(EXTRA_BACKENDS_ENV, "").split(","):
        name, _, target = item.strip().partition("=")
        if not item.strip():
            continue
        if not name or ":" not in target:
            raise ValueError(f"{EXTRA_BACKENDS_ENV}: expected name=module:Class, got {item!r}")
        register(name.strip(), target.strip())


_register_from_env()

FAMILY_FILES_ENV = "MLA_TUNE_BACKENDS"


def _register_family_files() -> None:
    """Register the compiled-source family files named in $MLA_TUNE_BACKENDS (paths joined
    by ':'), each as a backend named after its file stem; the file is read when the backend
    is first used, so a bad one is reported then (mla_tune/backends/compiled_source.py)."""
    for item in os.environ.get(FAMILY_FILES_ENV, "").split(os.pathsep):
        if item.strip():
            name = os.path.splitext(os.path.basename(item.strip()))[0]
            register(name, f"mla_tune.backends.compiled_source:family_{name}")


_register_family_files()


def library_versions(device: torch.device | str) -> dict[str, str]:
    """Versions of the libraries of every backend available on `device`: part of the
    software fingerprint, whichever backends a given sweep selects."""
    versions: dict[str, str] = {}
    for name in _REGISTRY:
        try:
            backend = get_backend(name)
            if backend.available(torch.device(device)):
                versions.update(backend.versions())
        except Exception:  # noqa: BLE001 - an unloadable backend contributes nothing
            continue
    return versions


__all__ = ["Availability", "Backend", "KernelFn", "UnknownBackendError", "backend_names",
           "get_backend", "library_versions", "register", "source_hash_pairs",
           "source_hashes"]
