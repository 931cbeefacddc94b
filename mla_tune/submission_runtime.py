"""The runtime of the one-file leaderboard submission (`mla-tune export --submission`).

Copied verbatim into the exported file after routing_rules.py, kernels/triton/mla_decode.py
and kernels/triton/launch.py, and followed there by the table literals (`TABLE_DEVICE`,
`TABLE_WINNERS`, `TRITON_SPACES`, `TABLE_CHECKS`) and `custom_kernel`. It routes like the
dispatcher (mla_tune/dispatch.py): the exact tuned shape, else the nearest tuned uniform
shape of the same format/heads/q_len, else the occupancy heuristic on the Triton family,
else plain PyTorch; never a variant stored wrong for the call's shape, with the
dispatcher's trust tiers (`routing_rules.trust_tier`) over where each winner's config was
verified. A variant whose build or first call fails falls through to the next. A shape's
first call is checked in full (tensors, dtypes, devices, indptrs read on the host); its
later calls are one dict lookup and the kernel, so they must match that first call (same
kv lengths and KV formats), as the leaderboard's calls of a shape do. Nothing here
imports mla_tune.
"""

from __future__ import annotations

import itertools
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from kernels.triton.launch import build_variant, variant_feasible
from mla_tune.routing_rules import (
    FORMAT_NAMES,
    call_key,
    closest_splits,
    config_text,
    format_rank,
    nearest_distance,
    occupancy_splits,
    shape_key,
    trust_tier,
)

SUB_QK_DIM, SUB_V_DIM = 576, 512
SUB_TRACE_ENV = "MLA_TUNE_TRACE"
_SUB_FP8 = {torch.float8_e4m3fn, torch.float8_e4m3fnuz}
_SUB_U8 = {torch.uint8} | ({torch.float4_e2m1fn_x2} if hasattr(torch, "float4_e2m1fn_x2")
                           else set())
_SUB_E8M0 = {torch.uint8} | ({torch.float8_e8m0fnu} if hasattr(torch, "float8_e8m0fnu")
                             else set())
_SUB_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0,
             -4.0, -6.0)


def sub_device_fingerprint(device: torch.device) -> dict[str, Any]:
    """The running device as the tuning DB names it (mla_tune.fingerprint.current_device)."""
    if device.type == "cpu":
        name = platform.processor() or platform.machine() or "unknown cpu"
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (AttributeError, ValueError, OSError):
            memory = 0
        return {"vendor": "cpu", "name": name, "arch": platform.machine() or "unknown",
                "sm_count": os.cpu_count() or 1, "memory_bytes": memory}
    props = torch.cuda.get_device_properties(device.index)
    if torch.version.hip:
        vendor, arch = "amd", str(props.gcnArchName).split(":", 1)[0]
    else:
        vendor, arch = "nvidia", f"sm_{props.major}{props.minor}"
    return {"vendor": vendor, "name": props.name, "arch": arch,
            "sm_count": props.multi_processor_count, "memory_bytes": props.total_memory}


def _sub_check(t: Any, name: str, dtypes: set, shape: tuple, device: torch.device,
               contiguous: bool = True) -> None:
    """Raise ValueError naming `name` unless `t` is a tensor as described; a negative
    shape entry -n means at least n."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        raise ValueError(f"{name} has dtype {t.dtype}; expected "
                         f"{' or '.join(sorted(map(str, dtypes)))}")
    if t.dim() != len(shape) or any(t.shape[i] < -w if w < 0 else t.shape[i] != w
                                    for i, w in enumerate(shape)):
        want = tuple(f">={-w}" if w < 0 else w for w in shape)
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {want}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device}; this submission runs on {device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


def sub_check_call(data: Any, device: torch.device) -> tuple[tuple, list[str]]:
    """Check a shape's first call in full; returns its shape `(batch, kv_lens, q_len,
    heads)` (kv lengths read from kv_indptr) and the KV formats it holds."""
    if not isinstance(data, (tuple, list)) or len(data) != 5:
        raise ValueError("data must be the tuple (q, kv_data, qo_indptr, kv_indptr, config)")
    q, kv_data, qo, kvp, config = data
    if not isinstance(config, Mapping):
        raise ValueError(f"config must be a dict, got {type(config).__name__}")
    for f in ("batch_size", "q_seq_len", "kv_seq_len", "num_heads"):
        if type(config.get(f)) is not int or config[f] < 1:
            raise ValueError(f"config[{f!r}] must be a positive int, got {config.get(f)!r}")
    for f, want in (("num_kv_heads", 1), ("qk_head_dim", SUB_QK_DIM),
                    ("kv_lora_rank", SUB_V_DIM), ("v_head_dim", SUB_V_DIM)):
        if f in config and config[f] != want:
            raise ValueError(f"config[{f!r}] is {config[f]!r}; MLA decode here needs {want}")
    if not isinstance(config.get("sm_scale"), (int, float)) or isinstance(config["sm_scale"],
                                                                          bool):
        raise ValueError(f"config['sm_scale'] must be a number, got {config.get('sm_scale')!r}")
    batch, q_len, kv_max, heads = call_key(config)
    _sub_check(q, "q", {torch.bfloat16}, (batch * q_len, heads, SUB_QK_DIM), device)
    for t, n in ((qo, "qo_indptr"), (kvp, "kv_indptr")):
        _sub_check(t, n, {torch.int32}, (batch + 1,), device)
    qo_h, kv_h = qo.tolist(), kvp.tolist()
    if qo_h != [i * q_len for i in range(batch + 1)]:
        raise ValueError(f"qo_indptr must be 0, {q_len}, 2*{q_len}, ... (q_seq_len "
                         f"{q_len} per sequence), got {qo_h[:6]}...")
    kv_lens = tuple(b - a for a, b in zip(kv_h, kv_h[1:]))
    if kv_h[0] != 0 or min(kv_lens) < q_len or max(kv_lens) > kv_max:
        raise ValueError(f"kv_indptr must start at 0 and give lengths in [{q_len}, "
                         f"{kv_max}] (q_seq_len, kv_seq_len), got {kv_h[:6]}...")
    if not isinstance(kv_data, Mapping):
        raise ValueError(f"kv_data must be a dict of KV formats, got {type(kv_data).__name__}")
    present = [f for f in FORMAT_NAMES if f in kv_data]
    if not present:
        raise ValueError(f"kv_data holds none of {list(FORMAT_NAMES)}")
    rows = kv_h[-1]
    for fmt in present:
        entry, name = kv_data[fmt], f"kv_data[{fmt!r}]"
        if fmt == "bf16":
            _sub_check(entry, name, {torch.bfloat16}, (-rows, 1, SUB_QK_DIM), device)
            continue
        if not isinstance(entry, (tuple, list)) or len(entry) != 2:
            raise ValueError(f"{name} must be a (values, scale) pair")
        if fmt == "fp8":
            _sub_check(entry[0], f"{name}[0]", _SUB_FP8, (-rows, 1, SUB_QK_DIM), device)
            _sub_check(entry[1], f"{name}[1]", {torch.float32}, (1,), device, False)
        else:
            _sub_check(entry[0], f"{name}[0]", _SUB_U8, (-rows, 1, SUB_QK_DIM // 2), device)
            _sub_check(entry[1], f"{name}[1]", _SUB_E8M0, (-rows, -(SUB_QK_DIM // 32)),
                       device, False)
    return (batch, kv_lens, q_len, heads), present


def sub_dequantized(kv_data: Mapping[str, Any], fmt: str) -> torch.Tensor:
    """float32 `(N, 576)` values of the cache in `fmt`, exactly as stored."""
    if fmt == "bf16":
        kv = kv_data["bf16"].float()
    elif fmt == "fp8":
        kv8, scale = kv_data["fp8"]
        kv = kv8.float() * scale.float()
    else:
        fp4, sc = kv_data["mxfp4"]
        b = fp4.view(torch.uint8).reshape(fp4.shape[0], -1)
        table = torch.tensor(_SUB_E2M1, dtype=torch.float32, device=b.device)
        vals = table[torch.stack((b & 0xF, b >> 4), -1).reshape(b.shape[0], -1).long()]
        s = sc.view(torch.uint8)[:b.shape[0], :SUB_QK_DIM // 32].to(torch.int32) << 23
        s = torch.where(s == 0, torch.full_like(s, 0x00400000), s).view(torch.float32)
        kv = (vals.view(b.shape[0], -1, 32) * s.unsqueeze(-1)).reshape(b.shape[0], -1)
    return kv.reshape(kv.shape[0], SUB_QK_DIM)


def sub_torch_decode(data: tuple, fmt: str) -> torch.Tensor:
    """MLA decode in float32 PyTorch on the dequantized cache (any device): the path for
    shapes no Triton variant runs. Query j of a sequence of length L sees keys
    [0, L - q_len + j]."""
    q, kv_data, qo, kvp, config = data
    kv = sub_dequantized(kv_data, fmt)
    qf, scale = q.float(), float(config["sm_scale"])
    out = torch.empty((q.shape[0], q.shape[1], SUB_V_DIM), dtype=torch.bfloat16,
                      device=q.device)
    qo_h, kv_h = qo.tolist(), kvp.tolist()
    for b in range(len(qo_h) - 1):
        q0, q1, k0, k1 = qo_h[b], qo_h[b + 1], kv_h[b], kv_h[b + 1]
        keys, ql, n = kv[k0:k1], q1 - q0, k1 - k0
        s = torch.einsum("qhd,kd->qhk", qf[q0:q1], keys) * scale
        j = torch.arange(ql, device=q.device).view(ql, 1, 1)
        k = torch.arange(n, device=q.device).view(1, 1, n)
        p = torch.softmax(s.masked_fill(k > n - ql + j, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("qhk,kd->qhd", p, keys[:, :SUB_V_DIM]).to(torch.bfloat16)
    return out


class SubmissionRouter:
    """The exported table and the per-key cache of built variants."""

    def __init__(self, device_json: dict[str, Any], winners: dict[str, tuple],
                 spaces: dict[str, tuple], stacks: dict[str, dict[str, str]],
                 checks: dict[str, tuple]) -> None:
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.here = sub_device_fingerprint(self.device)
        self.mine = self.here == device_json
        self.winners = winners if self.mine else {}
        self.stacks = stacks
        # config text -> (shape keys verified ok, stored wrong, a wrong shape per family)
        self.checks = {k: (frozenset(ok), frozenset(bad), fam)
                       for k, (ok, bad, fam) in (checks if self.mine else {}).items()}
        self.uniform: dict[tuple, list[tuple]] = {}
        for w in self.winners.values():
            fmt, batch, kv, q_len, heads, page = w[:6]
            if isinstance(kv, int):
                self.uniform.setdefault((fmt, heads, q_len, page), []).append(w)
        names, choices = zip(*spaces["cpu" if self.device.type == "cpu" else "cuda"])
        self.grid = [dict(zip(names, c)) for c in itertools.product(*choices)]
        interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.triton = (self.device.type == "cpu") == interp
        self.gfx942 = bool(torch.version.hip) and self.here.get("arch") == "gfx942"
        self.trace = os.environ.get(SUB_TRACE_ENV, "").strip() not in ("", "0")
        self.routes: dict[tuple, Callable[[tuple], torch.Tensor]] = {}
        self.warned = False
        if self.trace and not self.mine:
            print(f"mla-tune route: this device {self.here} is not the table's "
                  f"{device_json}: no tuned winner applies", file=sys.stderr, flush=True)

    def trust(self, config: dict, fmt: str, kv_lens: tuple, batch: int, q_len: int,
              heads: int) -> tuple[int, str] | None:
        """The dispatcher's trust in a variant at this shape (routing_rules.trust_tier)."""
        c = self.checks.get(config_text(config))
        if c is None:
            return 1, "never verified at this shape"
        return trust_tier(shape_key(batch, kv_lens, q_len, heads, fmt), (fmt, heads, q_len, 1),
                          *c)

    def _triton_runs(self, fmt: str) -> bool:
        return self.triton and not (fmt == "fp8" and self.gfx942)

    def tuned(self, fmt: str, batch: int, kv_lens: tuple, q_len: int,
              heads: int) -> tuple | None:
        """("exact" | "nearest", config, tuned us, tuned total kv, tuned key) or None."""
        if not self._triton_runs(fmt):
            return None
        key = shape_key(batch, kv_lens, q_len, heads, fmt)
        w = self.winners.get(key)
        if w is not None:
            return ("exact", w[6], w[7], w[1] * w[2] if isinstance(w[2], int) else sum(w[2]),
                    key)
        kv_len = max(kv_lens)

        ranked = []
        for w in self.uniform.get((fmt, heads, q_len, 1), ()):
            t = self.trust(w[6], fmt, kv_lens, batch, q_len, heads)
            if t is not None and t[0] < 2:  # never stored wrong here nor suspect
                ranked.append((t[0], nearest_distance(batch, kv_len, w[1], w[2]), w))
        for _, _, w in sorted(ranked, key=lambda x: x[:2]):
            if variant_feasible(fmt, kv_lens, q_len, heads, 1, w[6]):
                return ("nearest", w[6], w[7], w[1] * w[2],
                        shape_key(w[1], (w[2],), q_len, heads, fmt))
        return None

    def decisions(self, fmt: str, batch: int, kv_lens: tuple, q_len: int,
                  heads: int) -> list[tuple[str, dict | None, str]]:
        """(reason, Triton config or None for PyTorch, detail) in the order tried."""
        out: list[tuple[str, dict | None, str]] = []
        t = self.tuned(fmt, batch, kv_lens, q_len, heads)
        if t is not None and self.trust(t[1], fmt, kv_lens, batch, q_len, heads) is not None:
            out.append((t[0], t[1], f"{t[4]} tuned at {t[2]:.1f} us"))
        if self._triton_runs(fmt):
            units = self.here["sm_count"]
            splits = occupancy_splits(batch, q_len * heads, max(kv_lens), units)
            cands, tiers = [], []
            for c in self.grid:
                if variant_feasible(fmt, kv_lens, q_len, heads, 1, c):
                    t = self.trust(c, fmt, kv_lens, batch, q_len, heads)
                    if t is not None:
                        cands.append(c)
                        tiers.append(t[0] == 2)
            if cands:
                c = cands[closest_splits([x["num_splits"] for x in cands], splits, tiers)]
                if t is None or c != t[1]:
                    out.append(("heuristic", c, f"occupancy model wants {splits} split(s) "
                                                f"over {units} units"))
        out.append(("fallback", None, "plain PyTorch"))
        return out

    def choose_format(self, batch: int, kv_lens: tuple, q_len: int, heads: int,
                      present: list[str]) -> str:
        def rank(f: str) -> tuple:
            t = self.tuned(f, batch, kv_lens, q_len, heads)
            return format_rank(t and t[0], t and t[2], sum(kv_lens), t and t[3], f)

        return min(present, key=rank)

    def _version_note(self, config: dict) -> None:
        if self.warned or not self.mine:
            return
        self.warned = True
        import importlib.metadata

        here = {"python": platform.python_version(), "torch": str(torch.__version__)}
        for dist in ("triton", "pytorch-triton", "pytorch-triton-rocm"):
            try:
                here["triton"] = importlib.metadata.version(dist)
                break
            except importlib.metadata.PackageNotFoundError:
                continue
        tuned = {k: v for s in self.stacks.values() for k, v in s.items()}
        diff = sorted(k for k in tuned if k in here and tuned[k] != here[k])
        if diff:
            print("mla-tune submission: winners tuned under other versions (" +
                  ", ".join(f"{k} {tuned[k]} here {here[k]}" for k in diff) + ")",
                  file=sys.stderr)

    def first_call(self, data: Any) -> torch.Tensor:
        """Check, route, build and run a key's first call; later calls take the cache."""
        (batch, kv_lens, q_len, heads), present = sub_check_call(data, self.device)
        self._version_note(data[4])
        fmt = self.choose_format(batch, kv_lens, q_len, heads, present)
        scale = float(data[4]["sm_scale"])
        for reason, config, detail in self.decisions(fmt, batch, kv_lens, q_len, heads):
            try:
                if config is None:
                    def run(d: tuple, fmt: str = fmt) -> torch.Tensor:
                        return sub_torch_decode(d, fmt)
                else:
                    run = build_variant(fmt, list(kv_lens), q_len, heads, config, self.device,
                                        sm_scale=scale)
                out = run(data)
            except Exception as e:  # noqa: BLE001 - fall through to the next variant
                print(f"mla-tune submission: {reason} variant failed for {batch}x"
                      f"{max(kv_lens)} {fmt} h{heads} q{q_len} ({type(e).__name__}: {e}); "
                      "trying the next", file=sys.stderr)
                continue
            if self.trace:
                print(f"mla-tune route: {batch}x{max(kv_lens)} {fmt} h{heads} q{q_len} -> "
                      f"{reason} {config} ({detail})", file=sys.stderr, flush=True)
            self.routes[call_key(data[4])] = run
            return out
        raise RuntimeError("mla-tune submission: every variant failed")
