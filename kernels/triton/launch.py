"""A Triton variant from a point of its tuning space: the launch rules of the Triton family.

`variant_feasible` (which points can run a shape: shape arithmetic, no launch, no compile),
`variant_config` (the kernel's KernelConfig of a point) and `build_variant` (a prepared
launcher as `run(data) -> output` on the task tuple) take plain values (format name, kv
lengths, the config dict). `mla_tune.backends.triton_family` delegates its `feasible`,
`kernel_config` and `build` to them, and the one-file leaderboard submission (`mla-tune
export --submission`) carries this file next to mla_decode.py, so a tuned config runs the
same kernel both ways. Like every file of kernels/, it imports nothing of mla_tune.

A ragged shape (kv lengths not all equal) is built as the length-bucket runner the
dispatcher serves its bucket with (`balanced_launcher`: the balanced schedule of
mla_decode.py, one build for any lengths of its batch; mla_tune/runtime/buckets.py builds
its Triton runners with the same function), so a ragged sweep times what runs there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch

from .mla_decode import (
    SCHED_PAGED,
    SCHED_TOKENS,
    SEG_COST,
    BalancedLauncher,
    KernelConfig,
    MlaDecodeLauncher,
    pool_tma,
)

COMPUTE_BY_FORMAT = {"bf16": ("bf16",), "fp8": ("bf16", "fp16", "fp8", "fp8qk"),
                     "mxfp4": ("bf16",)}
"""Compute paths that make sense per KV format (bf16 KV is not re-quantized; MXFP4 blocks
scales along the head dim, so only bf16 holds the decoded values exactly)."""

WARPS_FOR_BLOCK_M = {16: 4, 32: 8, 64: 8, 128: 8}
"""The accumulator is 512 x block_m float32: 32 or more rows need two warpgroups to stay in
registers (sm_90 static check: 32 rows on 4 warps spill), 16 rows fit one (measured on
H200: 8 warps at 16 rows was 1.3-1.7x slower)."""

MXFP4_SCALE_STRIDE = 24
"""Row stride of the MXFP4 scale tensor as aiter pads it: 24 bytes, 18 used."""

KNOB_DEFAULTS: dict[str, Any] = {"fp8_convert": "staged", "kv_load": "pointer", "pdl": True,
                                 "seg_cost": SEG_COST, "page_rows": "key",
                                 "bucket_runs": "stream"}
"""What a config without one of these knobs means: how the kernel ran before the knob
existed. The launch rules read a missing knob so, and the family's space fills them into
stored configs it validates (`complete_config`), so a config stored before a knob keeps
routing, under the same key as the point that spells the default out."""


def complete_config(config: Mapping[str, Any], knobs: Iterable[str]) -> dict[str, Any]:
    """`config` with `KNOB_DEFAULTS` for those of `knobs` (the space's) it lacks."""
    names = set(knobs)
    return {**{k: v for k, v in KNOB_DEFAULTS.items() if k in names}, **config}


def variant_seg_cost(config: Mapping[str, Any]) -> int:
    """Blocks of the balanced schedule's stream charged per sequence start (a runtime
    argument of the same compiled kernels; see seg_cost in configs/backends/triton.toml)."""
    return int(config.get("seg_cost", SEG_COST))


def variant_page_size(page_size: int, config: Mapping[str, Any]) -> int:
    """A paged shape is read with its own page size; the knob applies to contiguous ones."""
    return page_size if page_size > 1 else int(config["page_size"])


def variant_feasible(kv_format: str, kv_lens: tuple[int, ...], q_len: int, heads: int,
                     page_size: int, config: Mapping[str, Any], *,
                     balanced: bool | None = None) -> bool:
    """Whether the config can run the shape (shape arithmetic only: no launch, no
    compile); the Triton family's `feasible`. `balanced`: whether the balanced schedule
    runs it (`balanced_launcher`); by default, as `build_variant` builds, for ragged
    shapes only (a length bucket's runner is balanced whatever lengths it is checked at).
    Knobs one schedule ignores keep their default there, so no two points are the same
    variant."""
    if balanced is None:
        balanced = len(set(kv_lens)) > 1
    if str(config["compute"]) not in COMPUTE_BY_FORMAT[kv_format]:
        return False
    chunks = str(config.get("bucket_runs", "stream")) == "chunks"
    if (not balanced or chunks) and variant_seg_cost(config) != SEG_COST:
        return False  # no run crosses a sequence: see seg_cost in triton.toml
    if chunks and not balanced:
        return False  # a balanced runner's knob: see bucket_runs in triton.toml
    block_m, block_n = int(config["block_m"]), int(config["block_n"])
    if WARPS_FOR_BLOCK_M.get(block_m) != int(config["num_warps"]):
        return False
    if block_m > 16 and block_m >= 2 * q_len * heads:
        return False  # half the rows or more would be padding
    if block_m > 16 and (block_n != 64 or (kv_format == "fp8" and (
            str(config["compute"]) in ("bf16", "fp16")
            or str(config.get("kv_load", "pointer")) != "pointer"
            or str(config.get("fp8_convert", "staged")) != "staged"))):
        return False  # see block_m in configs/backends/triton.toml
    if not bool(config.get("pdl", True)) and (
            bool(config["fast_mode"]) or (int(config["num_splits"]) == 1 and not balanced)):
        return False  # no second launch to make plain: see pdl in configs/backends/triton.toml
    if (page_size > 1 or balanced) and int(config["page_size"]) != 1:
        return False  # paged shapes use their own page size, balanced contiguous ones none
    # fp8 KV converted for the MMAs (fp8qk converts the values, to fp16).
    converts_fp8 = kv_format == "fp8" and str(config["compute"]) != "fp8"
    if not converts_fp8 and str(config.get("fp8_convert", "staged")) != "staged":
        return False  # the knob only exists for fp8 KV on 16-bit MMAs
    kv_load = str(config.get("kv_load", "pointer"))
    pages = variant_page_size(page_size, config)
    if kv_load in ("tma", "tma_host") and (
            (pages > 1 and not (balanced and pool_tma(
                variant_config(kv_format, page_size, config), pages))) or not (
                kv_format == "bf16" or (kv_format == "fp8" and str(config["compute"]) == "fp8"))):
        return False  # see kv_load in configs/backends/triton.toml
    if kv_load == "tma_host" and (balanced or q_len != 1 or any(L % block_n for L in kv_lens)):
        return False  # shared descriptors: tiles_stay_inside must hold (balanced: runs 'tma')
    if str(config.get("page_rows", "key")) != "key" and not (
            balanced and kv_load == "pointer" and 1 < page_size and block_n <= page_size):
        return False  # see page_rows in configs/backends/triton.toml
    return int(config["num_splits"]) * block_n <= max(kv_lens)


def variant_config(kv_format: str, page_size: int, config: Mapping[str, Any]) -> KernelConfig:
    """The kernel's KernelConfig for a point of the space."""
    return KernelConfig(
        kv_format=kv_format, compute=str(config["compute"]),
        block_m=int(config["block_m"]), block_n=int(config["block_n"]),
        num_warps=int(config["num_warps"]), num_stages=int(config["num_stages"]),
        num_splits=int(config["num_splits"]),
        page_size=variant_page_size(page_size, config),
        fast_mode=bool(config["fast_mode"]),
        fp8_convert=str(config.get("fp8_convert", "staged")),
        kv_load=str(config.get("kv_load", "pointer")), pdl=bool(config.get("pdl", True)),
        page_rows=str(config.get("page_rows", "key")),
        bucket_runs=str(config.get("bucket_runs", "stream")))


def balanced_launcher(kv_format: str, batch: int, q_len: int, heads: int,
                      config: Mapping[str, Any], device: torch.device, *, paged: bool,
                      page_size: int = 1, sm_scale: float = 1.0 / math.sqrt(576)
                      ) -> BalancedLauncher:
    """The length-bucket runner of a config, compiled and ready: the balanced schedule
    built once for `batch` sequences of any lengths (SCHED_PAGED over a page pool of
    `page_size`-token pages when `paged`, else SCHED_TOKENS over a contiguous cache),
    charging the config's seg_cost per sequence start. A ragged shape's `build_variant`
    and the dispatcher's bucket runners are this one function, so what a ragged sweep
    times is what serves the bucket."""
    launcher = BalancedLauncher(
        variant_config(kv_format, page_size, config), heads=heads, q_len=q_len, batch=batch,
        device=device, sched=SCHED_PAGED if paged else SCHED_TOKENS, page_size=page_size,
        sm_scale=sm_scale, seg_cost=variant_seg_cost(config))
    # Any MXFP4 scale row stride works: it is a runtime argument of the kernel.
    launcher.prepare(sc_stride=MXFP4_SCALE_STRIDE if kv_format == "mxfp4" else 0)
    return launcher


def build_bucket_variant(kv_format: str, batch: int, q_len: int, heads: int,
                         config: Mapping[str, Any], device: torch.device,
                         sm_scale: float = 1.0 / math.sqrt(576)
                         ) -> Callable[[tuple], torch.Tensor]:
    """The bucket runner of contiguous task tuples of `batch` sequences of any lengths
    (read from kv_indptr on the device), as `run(data) -> output`: what the one-file
    submission serves a ragged call's bucket with, and a ragged shape's build."""
    return _task_runner(kv_format, balanced_launcher(kv_format, batch, q_len, heads, config,
                                                     device, paged=False, sm_scale=sm_scale))


def build_variant(kv_format: str, kv_lens: list[int], q_len: int, heads: int,
                  config: Mapping[str, Any], device: torch.device, page_size: int = 1,
                  sm_scale: float = 1.0 / math.sqrt(576)) -> Callable[[tuple], torch.Tensor]:
    """A prepared launcher of the config for the shape, as `run(data) -> output` on the
    task tuple (`run.launcher` is what runs). Uniform shapes: per-sequence splits
    (MlaDecodeLauncher); ragged ones: their bucket's runner (`balanced_launcher`), paged
    through a pool of the shape's page size when it has one (`_paged_task_runner`). The
    output tensor is the launcher's, overwritten by the next call."""
    if len(set(kv_lens)) > 1:
        if page_size > 1:
            paged = balanced_launcher(kv_format, len(kv_lens), q_len, heads, config, device,
                                      paged=True, page_size=page_size, sm_scale=sm_scale)
            return _paged_task_runner(kv_format, paged, list(kv_lens), page_size, device)
        return build_bucket_variant(kv_format, len(kv_lens), q_len, heads, config, device,
                                    sm_scale=sm_scale)
    launcher = MlaDecodeLauncher(variant_config(kv_format, page_size, config), heads=heads,
                                 q_len=q_len, kv_lens=list(kv_lens), device=device,
                                 sm_scale=sm_scale)
    launcher.prepare(sc_stride=MXFP4_SCALE_STRIDE if kv_format == "mxfp4" else 0)
    return _task_runner(kv_format, launcher)


def _task_runner(kv_format: str, launcher: Any) -> Callable[[tuple], torch.Tensor]:
    """`run(data)` of a launcher over the task tuple's contiguous cache."""
    if kv_format == "bf16":
        def run(data: tuple) -> torch.Tensor:
            return launcher(data[0], data[1]["bf16"], None, None, data[2], data[3])
    elif kv_format == "fp8":
        def run(data: tuple) -> torch.Tensor:
            kv, scale = data[1]["fp8"]
            return launcher(data[0], kv, scale, None, data[2], data[3])
    else:
        u8 = torch.uint8

        def run(data: tuple) -> torch.Tensor:
            kv, scale = data[1]["mxfp4"]
            if kv.dtype != u8:  # float4_e2m1fn_x2 storage: same bytes
                kv = kv.view(u8)
            if scale.dtype != u8:  # float8_e8m0fnu storage: same bytes
                scale = scale.view(u8)
            return launcher(data[0], kv, None, scale, data[2], data[3])
    run.launcher = launcher  # type: ignore[attr-defined]
    return run


def _paged_task_runner(kv_format: str, launcher: BalancedLauncher, kv_lens: list[int],
                       page_size: int, device: torch.device) -> Callable[[tuple], torch.Tensor]:
    """`run(data)` of a paged bucket runner on the task tuple of a shape of lengths
    `kv_lens`. The task's cache is contiguous (a row per token), not a page pool, so it is
    copied into one: sequence b's pages consecutive from page `page_indptr[b]`, its last
    page padded with zeros, read through FlashInfer's metadata (lengths, page indptr, page
    indices) as a server's pool is. The copy is made once per KV tensor, again only for a
    call with another tensor or one written since (its version counter), so the calls a
    sweep times run the paged kernels alone."""
    n_pages = [-(-L // page_size) for L in kv_lens]
    page_indptr, starts = [0], [0]
    for n, L in zip(n_pages, kv_lens):
        page_indptr.append(page_indptr[-1] + n)
        starts.append(starts[-1] + L)
    shift = torch.tensor([p * page_size - s for p, s in zip(page_indptr, starts[:-1])])
    dst = (torch.arange(starts[-1]) + torch.repeat_interleave(shift, torch.tensor(kv_lens))
           ).to(device)
    pages = page_indptr[-1]
    lens = torch.tensor(kv_lens, dtype=torch.int32, device=device)
    ptr = torch.tensor(page_indptr, dtype=torch.int32, device=device)
    idx = torch.arange(pages, dtype=torch.int32, device=device)
    held: list[Any] = [None, None, None]  # (source tensors, their versions), pool, scales

    def pooled(kv: torch.Tensor, sc: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor | None]:
        versions = (_version(kv), 0 if sc is None else _version(sc))
        was = held[0]
        if was is None or was[0] is not kv or was[1] is not sc or was[2] != versions \
                or None in versions:
            u8 = torch.uint8
            rows = kv.view(u8) if kv_format == "mxfp4" and kv.dtype != u8 else kv
            held[1] = _into_slots(rows, dst, pages * page_size).view(pages, page_size, -1)
            held[2] = None if sc is None else _into_slots(
                sc.view(u8) if sc.dtype != u8 else sc, dst, pages * page_size)
            held[0] = (kv, sc, versions)
        return held[1], held[2]

    def run(data: tuple) -> torch.Tensor:
        entry = data[1][kv_format]
        kv, aux = (entry, None) if kv_format == "bf16" else entry
        pool, pool_sc = pooled(kv, aux if kv_format == "mxfp4" else None)
        return launcher(data[0], pool, aux if kv_format == "fp8" else None, pool_sc, data[2],
                        lens, ptr, idx)

    run.launcher = launcher  # type: ignore[attr-defined]
    run.pool = lambda: held[1]  # type: ignore[attr-defined]  # the pool the last call read
    return run


def _version(t: torch.Tensor) -> int | None:
    """The version counter of `t` (every in-place write bumps it), or None where torch
    keeps none (tensors made under inference mode: copied again at every call)."""
    try:
        return t._version
    except RuntimeError:
        return None


def _into_slots(t: torch.Tensor, dst: torch.Tensor, slots: int) -> torch.Tensor:
    """A zeroed `(slots, row)` tensor of `t`'s dtype holding row i of `t` at row `dst[i]`,
    for the first `len(dst)` rows (MXFP4 scales may have padding rows after them); copied
    as bytes: not every device indexes fp8 dtypes."""
    rows = t.reshape(t.shape[0], -1)[:dst.numel()].contiguous()
    out = torch.zeros((slots, rows.shape[1]), dtype=t.dtype, device=t.device)
    out.view(torch.uint8)[dst] = rows.view(torch.uint8)
    return out
