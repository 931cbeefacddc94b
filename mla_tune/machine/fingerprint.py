"""Who measured a timing: the device and the software stack.

Tuning results are only valid for the device and software that produced them, so every
trial and winner is keyed by these fingerprints. Both are plain data with a short stable
hash, so a shared DB can be matched against the current machine without importing kernels.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

VENDORS = ("nvidia", "amd", "cpu")
# Packages every software fingerprint records; anything else came in through `extra`.
CORE_PACKAGES = ("python", "torch", "triton")


def _short_hash(data: Any) -> str:
    text = json.dumps(data, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class DeviceFingerprint:
    """The properties of an accelerator (or CPU) that decide which config is fastest."""

    vendor: str
    name: str
    arch: str
    sm_count: int
    memory_bytes: int

    def __post_init__(self) -> None:
        if self.vendor not in VENDORS:
            raise ValueError(f"unknown vendor {self.vendor!r}; expected one of {VENDORS}")

    @property
    def hash(self) -> str:
        """Short stable id: the same device model and partition always gives the same hash."""
        return _short_hash(self.to_json())

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "DeviceFingerprint":
        return cls(vendor=str(d["vendor"]), name=str(d["name"]), arch=str(d["arch"]),
                   sm_count=int(d["sm_count"]), memory_bytes=int(d["memory_bytes"]))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown cpu"


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return 0


def current_device(device: str | torch.device) -> DeviceFingerprint:
    """Fingerprint of `device` ('cuda', 'cuda:1', 'cpu'); ROCm GPUs report vendor 'amd'."""
    import torch

    dev = torch.device(device)
    if dev.type == "cpu":
        return DeviceFingerprint(vendor="cpu", name=_cpu_name(),
                                 arch=platform.machine() or "unknown",
                                 sm_count=os.cpu_count() or 1,
                                 memory_bytes=_physical_memory())
    if dev.type != "cuda":
        raise ValueError(f"cannot fingerprint device type {dev.type!r}; use 'cuda' or 'cpu'")
    if not torch.cuda.is_available():
        raise ValueError(f"device {str(dev)!r} requested but torch sees no GPU")
    props = torch.cuda.get_device_properties(dev.index if dev.index is not None
                                             else torch.cuda.current_device())
    if torch.version.hip:
        # gcnArchName looks like 'gfx942:sramecc+:xnack-'; the features do not change tuning.
        arch = str(props.gcnArchName).split(":", 1)[0]
        vendor = "amd"
    else:
        arch = f"sm_{props.major}{props.minor}"
        vendor = "nvidia"
    return DeviceFingerprint(vendor=vendor, name=props.name, arch=arch,
                             sm_count=props.multi_processor_count,
                             memory_bytes=props.total_memory)


@dataclass(frozen=True)
class SoftwareFingerprint:
    """Versions of everything that can change kernel speed: python, torch, triton, libraries.

    `versions` is kept sorted by package name so equal stacks compare and hash equal.
    """

    versions: tuple[tuple[str, str], ...]

    def __post_init__(self) -> None:
        pairs = {str(k): str(v) for k, v in self.versions}
        if len(pairs) != len(self.versions):
            raise ValueError(f"duplicate package names in {self.versions!r}")
        object.__setattr__(self, "versions", tuple(sorted(pairs.items())))

    @property
    def hash(self) -> str:
        """Short stable id of the whole stack."""
        return _short_hash(self.to_json())

    def as_dict(self) -> dict[str, str]:
        return dict(self.versions)

    def to_json(self) -> dict[str, str]:
        return self.as_dict()

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "SoftwareFingerprint":
        return cls(tuple((str(k), str(v)) for k, v in d.items()))


def installed_version(*dists: str) -> str | None:
    """Version of the first of `dists` (distribution names of one package) installed."""
    for dist in dists:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def current_software(extra: Mapping[str, str] | None = None) -> SoftwareFingerprint:
    """The running stack; `extra` adds library versions (e.g. flashinfer, aiter) that the
    caller knows matter. A core package that is not installed is left out."""
    import torch

    versions = {"python": platform.python_version(), "torch": str(torch.__version__)}
    # Triton ships under another distribution name in PyTorch's nightly and ROCm wheels.
    triton = installed_version("triton", "pytorch-triton", "pytorch-triton-rocm")
    if triton is not None:
        versions["triton"] = triton
    versions.update({str(k): str(v) for k, v in (extra or {}).items()})
    return SoftwareFingerprint(tuple(versions.items()))


def software_diff(a: SoftwareFingerprint,
                  b: SoftwareFingerprint) -> dict[str, tuple[str | None, str | None]]:
    """Packages whose versions differ, as {package: (version in a, version in b)}; None
    means absent. The dispatcher compares the keys with CORE_PACKAGES to decide whether a
    winner from a slightly different stack is still worth using (with a warning)."""
    da, db = a.as_dict(), b.as_dict()
    return {p: (da.get(p), db.get(p)) for p in sorted(da.keys() | db.keys())
            if da.get(p) != db.get(p)}


def resolve_hash_prefix(prefix: str, known: list[str], what: str) -> str:
    """The one hash of `known` starting with `prefix` (a device or software stack named by
    a prefix, as reports print them); ValueError naming the known ones otherwise."""
    match = sorted({h for h in known if h.startswith(prefix)})
    if len(match) != 1:
        which = f"no {what}" if not match else f"more than one {what}"
        raise ValueError(f"{which} with hash {prefix!r}; {what}s: "
                         f"{', '.join(sorted(set(known))) or '(none)'}")
    return match[0]
