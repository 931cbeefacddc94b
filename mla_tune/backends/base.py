"""The one small interface every kernel family implements.

A backend knows how to enumerate its variants for a shape and how to build one into a
callable over the task tuple. It knows nothing of the DB, the search or the CLI.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch

from mla_tune.backends.source_hash import hash_source_bytes, hash_sources
from mla_tune.problem.shapes import Shape, TaskInput
from mla_tune.tuning.space import ParamSpace, load_backend_space

KernelFn = Callable[[TaskInput], torch.Tensor]
"""A built variant: the task tuple in, (total_q, heads, 512) bf16 out. It may return the
same preallocated output tensor on every call (allocating per call would be timed), so a
caller keeps an output past the next call only by copying it, and a variant is not called
concurrently from several threads or streams."""


@dataclass(frozen=True)
class Availability:
    """Whether a backend can run here, and if not, exactly why."""

    ok: bool
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


class Backend(ABC):
    """A kernel family. Subclasses set `name` and implement the abstract methods."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    plans_own_rows: ClassVar[bool] = False
    """True for a library that chooses its own tiling for any q_len x heads (its knobs say
    nothing about query rows): a config tuned for one q_len/heads family then serves
    another as it is, so the dispatcher's transfers across families may take it."""

    @abstractmethod
    def available(self, device: torch.device) -> Availability:
        """Can this family run on `device` at all (library installed, right vendor)?"""

    def supports(self, shape: Shape) -> str | None:
        """None if the family handles `shape`, else the reason it does not."""
        return None

    def declared_space(self, device: torch.device) -> ParamSpace:
        """The space from `configs/backends/<name>.toml`; used to validate stored configs."""
        return load_backend_space(self.name, torch.device(device).type)

    def feasible(self, shape: Shape, config: Mapping[str, Any]) -> bool:
        """Prune points that cannot work for this shape (too many splits, etc.)."""
        return True

    def candidates(self, shape: Shape, device: torch.device,
                   pins: Mapping[str, Any] | None = None) -> list[dict[str, Any]]:
        """The grid of feasible configs for `shape`, in a stable order; `pins` narrows
        knobs to given values (a value or a list per knob)."""
        space = self.declared_space(device)
        if pins:
            space = space.restrict(pins)
        return [c for c in space.grid() if self.feasible(shape, c)]

    def precheck(self, shape: Shape, config: Mapping[str, Any],
                 device: torch.device) -> str | None:
        """A reason to skip this variant before spending device time (e.g. it spills
        registers or exceeds shared memory when compiled), or None to go ahead."""
        return None

    def compile_key(self, shape: Shape, config: Mapping[str, Any],
                    device: torch.device) -> Hashable | None:
        """What `build` compiles for this variant on `device`, or None when there is nothing
        to compile ahead. Candidates with equal keys share one compile."""
        return None

    def compile_ahead(self, shape: Shape, config: Mapping[str, Any], arch: str) -> None:
        """Compile this variant for a GPU of `arch` (a device fingerprint's arch, e.g.
        'sm_90') into the on-disk caches `precheck` and `build` read, in a process without a
        GPU context. A sweep calls it once per distinct `compile_key`, in CPU processes,
        while its GPU workers start, so the workers share one compile of each kernel."""

    @abstractmethod
    def build(self, shape: Shape, config: Mapping[str, Any], device: torch.device) -> KernelFn:
        """Compile/prepare one variant. All one-time work (JIT, plans, buffers) happens here,
        never in the returned callable."""

    @abstractmethod
    def source_files(self) -> list[Path]:
        """Files whose content defines this family's kernels."""

    def source_hash(self) -> str:
        """Hash of the code of `source_files` (comments and docstrings left out): results
        are reused only while it is unchanged."""
        return hash_sources(self.source_files())

    def source_bytes_hash(self) -> str:
        """Hash of the bytes of `source_files`: what results were stored under before
        `source_hash` left comments out (`mla-tune rehash` re-keys them)."""
        return hash_source_bytes(self.source_files())

    def versions(self) -> dict[str, str]:
        """Versions of libraries this family depends on beyond torch/triton."""
        return {}
