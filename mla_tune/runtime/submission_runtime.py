"""The runtime of the one-file leaderboard submission (`mla-tune export --submission`).

Copied verbatim into the exported file after routing_rules.py, bucket_rules.py,
input_checks.py, kernels/triton/mla_decode.py and kernels/triton/launch.py, and followed
there by the table literals (`TABLE_DEVICE`, `TABLE_WINNERS`, `TRITON_SPACES`,
`TABLE_CHECKS`) and `custom_kernel`. It routes like the dispatcher (mla_tune/runtime/routing.py), on
the same rules (routing_rules.py): the exact tuned shape; else a tuned variant of the call's
family verified at its shape, the nearest tuned uniform shape of any q_len/heads family
with its variant moved by the row model (block and splits re-derived), the nearest tuned
shape of the call's family as tuned; then the row model's heuristic on the Triton family,
then plain PyTorch; never a variant stored wrong for the call's shape, with the
dispatcher's trust tiers (`routing_rules.trust_tier`) over where each winner's config was
verified. A ragged call
(its KV holds fewer rows than `batch * kv_seq_len`) runs its length bucket's variant, as
the dispatcher's bucket router does (mla_tune/runtime/buckets.py, on the rules of
bucket_rules.py): routed once per bucket as the bucket's representative uniform shape,
with the config made length-independent, and built as the dispatcher's bucket runner (the
balanced schedule, `build_bucket_variant`), reading each sequence's length from
`kv_indptr` on the device. A variant whose build or first call fails falls through to the
next. A key's first call is checked in full, by the dispatcher's own checks
(input_checks.py), and its indptrs are read on the host once; its later calls are one dict
lookup and the kernel, so they must match that first call (same KV formats, and KV rows
for a uniform key), as the leaderboard's calls of a shape do. Its only in-project imports
are the files copied before it.
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import sys
from collections.abc import Callable, Mapping
from typing import Any

import torch

from mla_tune.kernels.triton.launch import (
    build_bucket_variant,
    build_variant,
    complete_config,
    variant_feasible,
)
from mla_tune.runtime.bucket_rules import (
    bucket_config,
    is_ragged_rows,
    kv_class,
    kv_edges_from_env,
    rep_len,
    winner_pages,
)
from mla_tune.runtime.input_checks import (
    TASK_QK_DIM,
    TASK_V_DIM,
    check_config,
    check_sizes,
    check_task_tensors,
    kv_rows,
)
from mla_tune.runtime.routing_rules import (
    FORMAT_NAMES,
    ROW_BLOCK_KNOB,
    TRANSFER_TRIES,
    call_key,
    config_text,
    format_rank,
    nearest_distance,
    row_model_note,
    row_model_picks,
    shape_key,
    transfer_order,
    trust_tier,
    tuned_route_order,
)

SUB_TRACE_ENV = "MLA_TUNE_TRACE"
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


def sub_first_checks(data: Any) -> tuple[dict[str, int], list[str], int]:
    """The dispatcher's checks of a key's first call before its format is chosen (the
    config's fields, the tensors' sizes against it, the formats kv_data holds): returns
    the config's key values, the formats present and the call's KV rows."""
    if not isinstance(data, (tuple, list)) or len(data) != 5:
        raise ValueError("data must be the tuple (q, kv_data, qo_indptr, kv_indptr, config)")
    vals = check_config(data[4])
    check_sizes(data, vals)
    kv_data = data[1]
    if not isinstance(kv_data, Mapping):
        raise ValueError(f"kv_data must be a dict, got {type(kv_data).__name__}")
    present = [f for f in FORMAT_NAMES if f in kv_data]
    if not present:
        raise ValueError(f"kv_data holds none of {list(FORMAT_NAMES)}")
    return vals, present, kv_rows(kv_data, present)


def sub_check_indptrs(data: tuple, batch: int, q_len: int, kv_max: int, rows: int) -> None:
    """Read a first call's indptrs on the host (once per key): q_seq_len queries per
    sequence, kv lengths in [q_seq_len, kv_seq_len] covering the KV's rows, so no later
    launch of the key reads past the cache."""
    qo_h, kv_h = data[2].tolist(), data[3].tolist()
    if qo_h != [i * q_len for i in range(batch + 1)]:
        raise ValueError(f"qo_indptr must be 0, {q_len}, 2*{q_len}, ... (q_seq_len "
                         f"{q_len} per sequence), got {qo_h[:6]}...")
    lens = [b - a for a, b in zip(kv_h, kv_h[1:])]
    if kv_h[0] != 0 or min(lens) < q_len or max(lens) > kv_max or kv_h[-1] != rows:
        raise ValueError(f"kv_indptr must start at 0, give lengths in [{q_len}, {kv_max}] "
                         f"(q_seq_len, kv_seq_len) and end at the {rows} KV rows, got "
                         f"{kv_h[:6]}...")


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
        s = sc.view(torch.uint8)[:b.shape[0], :TASK_QK_DIM // 32].to(torch.int32) << 23
        s = torch.where(s == 0, torch.full_like(s, 0x00400000), s).view(torch.float32)
        kv = (vals.view(b.shape[0], -1, 32) * s.unsqueeze(-1)).reshape(b.shape[0], -1)
    return kv.reshape(kv.shape[0], TASK_QK_DIM)


def sub_torch_decode(data: tuple, fmt: str) -> torch.Tensor:
    """MLA decode in float32 PyTorch on the dequantized cache (any device): the path for
    shapes no Triton variant runs. Query j of a sequence of length L sees keys
    [0, L - q_len + j]."""
    q, kv_data, qo, kvp, config = data
    kv = sub_dequantized(kv_data, fmt)
    qf, scale = q.float(), float(config["sm_scale"])
    out = torch.empty((q.shape[0], q.shape[1], TASK_V_DIM), dtype=torch.bfloat16,
                      device=q.device)
    qo_h, kv_h = qo.tolist(), kvp.tolist()
    for b in range(len(qo_h) - 1):
        q0, q1, k0, k1 = qo_h[b], qo_h[b + 1], kv_h[b], kv_h[b + 1]
        keys, ql, n = kv[k0:k1], q1 - q0, k1 - k0
        s = torch.einsum("qhd,kd->qhk", qf[q0:q1], keys) * scale
        j = torch.arange(ql, device=q.device).view(ql, 1, 1)
        k = torch.arange(n, device=q.device).view(1, 1, n)
        p = torch.softmax(s.masked_fill(k > n - ql + j, float("-inf")), dim=-1)
        out[q0:q1] = torch.einsum("qhk,kd->qhd", p, keys[:, :TASK_V_DIM]).to(torch.bfloat16)
    return out


class SubmissionRouter:
    """The exported table, the per-key cache of built variants (`routes`, uniform keys)
    and the per-bucket one (`buckets`, ragged calls)."""

    def __init__(self, device_json: dict[str, Any], winners: dict[str, tuple],
                 spaces: dict[str, tuple], stacks: dict[str, dict[str, str]],
                 checks: dict[str, tuple]) -> None:
        self.device = (torch.device("cuda", torch.cuda.current_device())
                       if torch.cuda.is_available() else torch.device("cpu"))
        self.here = sub_device_fingerprint(self.device)
        self.mine = self.here == device_json
        names, choices = zip(*spaces["cpu" if self.device.type == "cpu" else "cuda"])
        # Configs in one form, knobs stored before they existed spelled out as the
        # dispatcher's space validates them (`complete_config`): table, checks and grid.
        self.winners = {k: (*w[:6], complete_config(w[6], names), *w[7:])
                        for k, w in (winners if self.mine else {}).items()}
        self.stacks = stacks
        # config text -> (shape keys verified ok, stored wrong, a wrong shape per family)
        merged: dict[str, tuple[set, set, dict]] = {}
        for k, (ok, bad, fam) in (checks if self.mine else {}).items():
            acc = merged.setdefault(config_text(complete_config(json.loads(k), names)),
                                    (set(), set(), {}))
            acc[0].update(ok)
            acc[1].update(bad)
            acc[2].update({f: v for f, v in fam.items() if f not in acc[2]})
        self.checks = {k: (frozenset(ok), frozenset(bad), fam)
                       for k, (ok, bad, fam) in merged.items()}
        self.edges = kv_edges_from_env(os.environ)
        self.uniform: dict[tuple, list[tuple]] = {}
        self.ragged: dict[tuple, tuple] = {}
        for w in self.winners.values():
            fmt, batch, kv, q_len, heads, page = w[:6]
            if isinstance(kv, int):
                self.uniform.setdefault((fmt, heads, q_len, page), []).append(w)
            else:  # the fastest winner tuned on a ragged batch of each bucket
                key = (fmt, batch, *kv_class(self.edges, sum(kv) / batch), q_len, heads,
                       page)
                if key not in self.ragged or w[7] < self.ragged[key][7]:
                    self.ragged[key] = w
        self.grid = [dict(zip(names, c)) for c in itertools.product(*choices)]
        self.space = dict(zip(names, choices))
        interp = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
        self.triton = (self.device.type == "cpu") == interp
        self.gfx942 = bool(torch.version.hip) and self.here.get("arch") == "gfx942"
        self.trace = os.environ.get(SUB_TRACE_ENV, "").strip() not in ("", "0")
        self.routes: dict[tuple, Callable[[tuple], torch.Tensor]] = {}
        self.buckets: dict[tuple, Callable[[tuple], torch.Tensor]] = {}
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

    def _trusted(self, fmt: str, batch: int, kv_lens: tuple, q_len: int,
                 heads: int) -> list[tuple[dict, tuple[int, str]]]:
        """The grid's points that run the shape and are not stored wrong here, with their
        trust, in the grid's order (the dispatcher's family candidates)."""
        out = []
        for c in self.grid:
            if variant_feasible(fmt, kv_lens, q_len, heads, 1, c):
                t = self.trust(c, fmt, kv_lens, batch, q_len, heads)
                if t is not None:
                    out.append((c, t))
        return out

    def _row_model(self, fmt: str, batch: int, kv_lens: tuple, q_len: int, heads: int,
                   source: tuple | None, limit: int) -> list[tuple[dict, tuple, str]]:
        """Up to `limit` configs by the row model (RoutingTable._row_model): moved from
        the tuned winner `source`, or the heuristic's when None; each with its trust and
        what the model wanted."""
        trusted = self._trusted(fmt, batch, kv_lens, q_len, heads)
        if not trusted:
            return []
        rows, units = q_len * heads, self.here["sm_count"]
        src = None if source is None else (source[6], source[1], source[3] * source[4],
                                           source[2])
        picked, block_m, want = row_model_picks(
            batch, rows, max(kv_lens), units, [c for c, _ in trusted],
            [t[0] for _, t in trusted], self.space, src, limit)
        note = row_model_note(rows, block_m, want, units,
                              "cores" if self.here.get("vendor") == "cpu" else "SMs")
        return [(trusted[i][0], trusted[i][1], note) for i in picked]

    def _moved(self, fmt: str, batch: int, kv_lens: tuple, q_len: int,
               heads: int) -> list[tuple]:
        """The nearest tuned uniform shape of any q_len/heads family, its variant moved by
        the row model (RoutingTable._moved), as `tuned_all` routes."""
        rows, own = q_len * heads, (fmt, heads, q_len, 1)
        loaded, sources = [], []
        for fam, ws in self.uniform.items():
            if (fam[0], fam[3]) != (fmt, 1):
                continue
            for w in ws:
                if ROW_BLOCK_KNOB in w[6]:
                    loaded.append(w)
                    sources.append((w[1], w[2], w[3] * w[4], w[3], fam != own,
                                    ("triton", config_text(w[6]))))
        for i in transfer_order(batch, max(kv_lens), rows, q_len, sources):
            w, other = loaded[i], sources[i][4]
            moved = self._row_model(fmt, batch, kv_lens, q_len, heads, w, TRANSFER_TRIES)
            if moved:
                reason = "transfer" if other else "nearest"
                key = shape_key(w[1], (w[2],), w[3], w[4], fmt)
                return [(reason, c, w[7], w[1] * w[2], key,
                         f"{key} ({w[7]:.1f} us there) moved: {note}; {t[1]}")
                        for c, t, note in moved]
        return []

    def tuned_all(self, fmt: str, batch: int, kv_lens: tuple, q_len: int,
                  heads: int) -> list[tuple]:
        """The dispatcher's tuned routes of a uniform call (RoutingTable._tuned_all), as
        (reason, config, tuned us, tuned total kv, tuned key, detail): the exact winner;
        else a variant of the call's family verified here, the nearest tuned shape's
        variant moved by the row model, the nearest tuned shape of the family as tuned."""
        if not self._triton_runs(fmt):
            return []
        key = shape_key(batch, kv_lens, q_len, heads, fmt)
        w = self.winners.get(key)
        if w is not None:
            total = w[1] * w[2] if isinstance(w[2], int) else sum(w[2])
            return [("exact", w[6], w[7], total, key, f"{key} tuned at {w[7]:.1f} us")]
        ranked = []
        for w in self.uniform.get((fmt, heads, q_len, 1), ()):
            t = self.trust(w[6], fmt, kv_lens, batch, q_len, heads)
            if t is not None and t[0] < 2:  # never stored wrong here nor suspect
                ranked.append((t[0], nearest_distance(batch, max(kv_lens), w[1], w[2]), w))
        as_tuned: list[tuple[int, tuple]] = []
        for tier, _, w in sorted(ranked, key=lambda x: x[:2]):
            if any(t == tier for t, _ in as_tuned) \
                    or not variant_feasible(fmt, kv_lens, q_len, heads, 1, w[6]):
                continue
            wkey = shape_key(w[1], (w[2],), q_len, heads, fmt)
            as_tuned.append((tier, ("nearest", w[6], w[7], w[1] * w[2], wkey,
                                    f"{wkey} as tuned ({w[7]:.1f} us there)")))
        return tuned_route_order(as_tuned, self._moved(fmt, batch, kv_lens, q_len, heads))

    def heuristic(self, fmt: str, batch: int, kv_lens: tuple, q_len: int,
                  heads: int) -> tuple[dict, str] | None:
        """The row model's Triton config for the shape without a tuned shape
        (RoutingTable._heuristic), and why; None if no point of the grid runs it unless
        stored wrong here."""
        if not self._triton_runs(fmt):
            return None
        for c, t, note in self._row_model(fmt, batch, kv_lens, q_len, heads, None, 1):
            return c, f"no tuned shape to move here; {note}; {t[1]}"
        return None

    def decisions(self, fmt: str, batch: int, kv_lens: tuple, q_len: int,
                  heads: int) -> list[tuple[str, dict | None, str]]:
        """(reason, Triton config or None for PyTorch, detail) in the order tried."""
        out: list[tuple[str, dict | None, str]] = []
        seen: set[str] = set()
        h = self.heuristic(fmt, batch, kv_lens, q_len, heads)
        tuned = [(r[0], r[1], r[5]) for r in self.tuned_all(fmt, batch, kv_lens, q_len, heads)]
        for reason, config, detail in tuned + ([("heuristic", *h)] if h else []):
            k = config_text(config)
            if k not in seen and self.trust(config, fmt, kv_lens, batch, q_len,
                                            heads) is not None:
                seen.add(k)
                out.append((reason, config, detail))
        out.append(("fallback", None, "plain PyTorch"))
        return out

    def bucket_decisions(self, fmt: str, batch: int, kv_lo: int, kv_hi: int, q_len: int,
                         heads: int) -> list[tuple[str, dict | None, str]]:
        """The dispatcher's bucket routing (BucketRouter.decisions) of bucket `batch x
        (kv_lo, kv_hi]`: the winner tuned on a ragged batch of the bucket, the tuned
        uniform shapes of the format/heads/q_len nearest the representative, the
        heuristic, PyTorch; each config made length-independent (`bucket_config`) and
        kept only where the bucket runner (the balanced schedule) runs it at the
        representative shape and it was not stored wrong there as tuned or as adapted.
        Task tuples hold a contiguous cache: the lookups are a page-1 bucket's
        (`winner_pages`; the file holds no paged winners)."""
        rep = (rep_len(kv_lo, kv_hi, q_len),) * batch
        label = f"bucket {batch}x({kv_lo},{kv_hi}]"
        out: list[tuple[str, dict | None, str]] = []
        seen: set[str] = set()

        def add(config: dict, reason: str, detail: str) -> None:
            cfg = bucket_config("triton", config)
            if cfg is None or not self._triton_runs(fmt) \
                    or not variant_feasible(fmt, rep, q_len, heads, 1, cfg, balanced=True) \
                    or self.trust(config, fmt, rep, batch, q_len, heads) is None \
                    or self.trust(cfg, fmt, rep, batch, q_len, heads) is None:
                return
            k = config_text(cfg)
            if k not in seen:
                seen.add(k)
                out.append((reason, cfg, f"{label}: {detail}"))

        for page in winner_pages(1):
            w = self.ragged.get((fmt, batch, kv_lo, kv_hi, q_len, heads, page))
            if w is not None:
                add(w[6], "exact", f"tuned on a ragged batch at {w[7]:.1f} us")
        for page in winner_pages(1):
            for w in sorted(self.uniform.get((fmt, heads, q_len, page), ()),
                            key=lambda w: nearest_distance(batch, rep[0], w[1], w[2])):
                add(w[6], "nearest",
                    f"variant of tuned shape {w[1]}x{w[2]} ({w[7]:.1f} us there)")
        h = self.heuristic(fmt, batch, rep, q_len, heads)
        if h is not None:
            add(h[0], "heuristic", h[1])
        out.append(("fallback", None, f"{label}: plain PyTorch"))
        return out

    def choose_format(self, batch: int, kv_lens: tuple, q_len: int, heads: int,
                      present: list[str]) -> str:
        def rank(f: str) -> tuple:
            t = next(iter(self.tuned_all(f, batch, kv_lens, q_len, heads)), None)
            return format_rank(t and t[0], t and t[2], sum(kv_lens), t and t[3], f)

        return min(present, key=rank)

    def _version_note(self) -> None:
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

    def bucket_key(self, data: Any) -> tuple | None:
        """The bucket cache key of a ragged call from host metadata only (config, KV rows,
        formats held), or None if the call is not (recognisably) ragged."""
        try:
            c, kv_data = data[4], data[1]
            b, ql, kv_max = c["batch_size"], c["q_seq_len"], c["kv_seq_len"]
            rows = kv_rows(kv_data, FORMAT_NAMES)
            if not is_ragged_rows(rows, b, ql, kv_max):
                return None
            return (b, ql, c["num_heads"], kv_class(self.edges, rows / b)[1],
                    tuple(kv_data))
        except (LookupError, TypeError, ValueError, AttributeError, ZeroDivisionError):
            return None

    def first_call(self, data: Any) -> torch.Tensor:
        """Check, route, build and run a key's first call; later calls take the cache (a
        ragged call: its bucket's, found from host metadata)."""
        bkey = self.bucket_key(data)
        run = self.buckets.get(bkey) if bkey is not None else None
        if run is not None:
            return run(data)
        vals, present, rows = sub_first_checks(data)
        batch, q_len, kv_max, heads = (vals[f] for f in ("batch_size", "q_seq_len",
                                                         "kv_seq_len", "num_heads"))
        if bkey is not None:
            mean = max(q_len, rows // batch)
            fmt = self.choose_format(batch, (mean,) * batch, q_len, heads, present)
            lo, hi = kv_class(self.edges, rows / batch)
            routes = self.bucket_decisions(fmt, batch, lo, hi, q_len, heads)
            what = f"{batch}x({lo},{hi}] {fmt} h{heads} q{q_len}"
        else:
            build_lens = (kv_max,) * batch
            fmt = self.choose_format(batch, build_lens, q_len, heads, present)
            routes = self.decisions(fmt, batch, build_lens, q_len, heads)
            what = f"{batch}x{kv_max} {fmt} h{heads} q{q_len}"
        check_task_tensors(data, batch, q_len, heads, rows, fmt, self.device)
        sub_check_indptrs(data, batch, q_len, kv_max, rows)
        self._version_note()
        scale = float(data[4]["sm_scale"])
        for reason, config, detail in routes:
            try:
                if config is None:
                    def run(d: tuple, fmt: str = fmt) -> torch.Tensor:
                        return sub_torch_decode(d, fmt)
                elif bkey is not None:  # the dispatcher's bucket runner: any lengths
                    run = build_bucket_variant(fmt, batch, q_len, heads, config,
                                               self.device, sm_scale=scale)
                else:
                    run = build_variant(fmt, list(build_lens), q_len, heads, config,
                                        self.device, sm_scale=scale)
                out = run(data)
            except Exception as e:  # noqa: BLE001 - fall through to the next variant
                print(f"mla-tune submission: {reason} variant failed for {what} "
                      f"({type(e).__name__}: {e}); trying the next", file=sys.stderr)
                continue
            if self.trace:
                print(f"mla-tune route: {what} -> {reason} {config} ({detail})",
                      file=sys.stderr, flush=True)
            if bkey is not None:
                self.buckets[bkey] = run
            else:
                self.routes[call_key(data[4])] = run
            return out
        raise RuntimeError("mla-tune submission: every variant failed")
