"""The correctness gate: compare a kernel's output with the float32 reference.

Every trial records `max_abs_err` and `mismatch_frac` whether it passes or not, so a
tolerance can be re-judged later from the DB without re-running kernels.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mla_tune.problem.shapes import KVFormat
from mla_tune.tuning.space import load_toml

TOLERANCES_FILE = "tolerances.toml"


@dataclass(frozen=True)
class Tolerance:
    """Element `i` mismatches when `|out_i - ref_i| > atol + rtol * |ref_i|`; the output
    passes when at most `max_mismatch_frac` of its elements mismatch."""

    rtol: float
    atol: float
    max_mismatch_frac: float = 0.0

    def __post_init__(self) -> None:
        if self.rtol < 0 or self.atol < 0 or not 0 <= self.max_mismatch_frac <= 1:
            raise ValueError(f"bad tolerance {self}")


@dataclass(frozen=True)
class VerifyResult:
    """Outcome of one check; the metrics are NaN when they could not be computed."""

    ok: bool
    max_abs_err: float
    mismatch_frac: float
    reason: str = ""

    def __bool__(self) -> bool:
        return self.ok


def tolerance_for(kv_format: KVFormat | str) -> Tolerance:
    """The gate for a KV format, from `configs/tolerances.toml` (see its comments for why
    each number is what it is)."""
    fmt = KVFormat(kv_format).value
    table = load_toml(TOLERANCES_FILE)
    if fmt not in table:
        raise KeyError(f"{TOLERANCES_FILE} has no [{fmt}] table")
    t = table[fmt]
    return Tolerance(rtol=float(t["rtol"]), atol=float(t["atol"]),
                     max_mismatch_frac=float(t.get("max_mismatch_frac", 0.0)))


def check(out: torch.Tensor, ref: torch.Tensor, tol: Tolerance) -> VerifyResult:
    """Judge `out` (any float dtype, cast to float32) against the float32 `ref`."""
    nan = float("nan")
    if not isinstance(out, torch.Tensor):
        return VerifyResult(False, nan, nan, f"output is {type(out).__name__}, not a tensor")
    if tuple(out.shape) != tuple(ref.shape):
        return VerifyResult(False, nan, nan,
                            f"shape {tuple(out.shape)} != expected {tuple(ref.shape)}")
    if not (out.is_floating_point() and ref.is_floating_point()):
        return VerifyResult(False, nan, nan, f"output dtype {out.dtype} is not floating point")
    o = out.detach().float()
    r = ref.detach().to(device=o.device, dtype=torch.float32)
    if o.numel() == 0:
        return VerifyResult(True, 0.0, 0.0, "")
    if not bool(torch.isfinite(r).all()):
        return VerifyResult(False, nan, nan, "reference has NaN/Inf")
    diff = (o - r).abs()
    # written as "not within" so that NaN counts as a mismatch
    mismatch = ~(diff <= tol.atol + tol.rtol * r.abs())
    n_bad = int(mismatch.sum())
    frac = n_bad / o.numel()
    finite = torch.isfinite(o)
    if not bool(finite.all()):
        n_nf = int((~finite).sum())
        kinds = [k for k, m in (("NaN", torch.isnan(o)), ("Inf", torch.isinf(o)))
                 if bool(m.any())]
        return VerifyResult(False, float("inf"), frac,
                            f"output has {n_nf} non-finite element(s) ({'/'.join(kinds)})")
    max_err = float(diff.max())
    if frac > tol.max_mismatch_frac:
        idx = int(mismatch.flatten().nonzero()[0])
        where = tuple(int(i) for i in torch.unravel_index(torch.tensor(idx), o.shape))
        return VerifyResult(
            False, max_err, frac,
            f"{n_bad} of {o.numel()} elements ({frac:.3%}) exceed "
            f"atol={tol.atol:g} + rtol={tol.rtol:g}*|ref| (allowed {tol.max_mismatch_frac:.3%}); "
            f"max abs err {max_err:.3g}; first at {where}: "
            f"out={float(o.flatten()[idx]):.6g} ref={float(r.flatten()[idx]):.6g}")
    return VerifyResult(True, max_err, frac, "")
