"""`mla-tune export --submission`: one self-contained Python file for a leaderboard.

A participant submits one file and the runner has torch, triton and the vendor libraries,
not mla-tune. The file is rendered from the tuning DB, never edited by hand:
- `#!POPCORN leaderboard/gpu` lines when asked, and a header comment naming the DB, the
  device, the winners' software stacks, the kernel sources and the times each requested
  shape is expected to take;
- the source of mla_tune/runtime/routing_rules.py and mla_tune/runtime/bucket_rules.py (the dispatcher's
  routing and length-bucket rules), mla_tune/runtime/input_checks.py (its input checks),
  kernels/triton/mla_decode.py and kernels/triton/launch.py (the kernels and their launch)
  and mla_tune/runtime/submission_runtime.py (routing, bucket routing, the PyTorch path), copied
  verbatim but for their `from __future__` and in-project import lines;
- the device's winners as literals, and `custom_kernel(data)`.
Only Triton winners of the installed kernel sources are exported (other families' code
cannot travel in the file; the header says what was left out); a shape won by another
family (a vendor library) carries its fastest Triton trial instead. Of several winners of one
shape (several software stacks), the fastest is kept, as the dispatcher does between
stacks that differ equally from the running one. The same DB and arguments give the same
bytes: everything is sorted and nothing depends on the time or the machine.
"""

from __future__ import annotations

import ast
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import mla_tune
import mla_tune.kernels.triton
from mla_tune.problem.shapes import KVFormat, Shape
from mla_tune.results.winner import Winner

_PACKAGE = Path(mla_tune.__file__).resolve().parent
_KERNELS = Path(mla_tune.kernels.triton.__file__).resolve().parent
SOURCES = (Path(__file__).with_name("routing_rules.py"),
           Path(__file__).with_name("bucket_rules.py"),
           Path(__file__).with_name("input_checks.py"),
           _KERNELS / "mla_decode.py",
           _KERNELS / "launch.py",
           Path(__file__).with_name("submission_runtime.py"))
"""Files inlined into the submission, in this order (each may use the ones before)."""

def _source_name(p: Path) -> str:
    """A copied file's name as the repository has it (the same in a checkout and a wheel)."""
    if p.parent == _KERNELS:
        return f"kernels/triton/{p.name}"
    return f"mla_tune/{p.relative_to(_PACKAGE).as_posix()}"


_IN_PROJECT = re.compile(r"^from (mla_tune|kernels|\.)(\.?\w+)* import (\([^)]*\)|[^\n(]*)\n",
                         re.MULTILINE)
_FUTURE = "from __future__ import annotations\n"
_POPCORN_VALUE = re.compile(r"[A-Za-z0-9_.-]{1,64}")
EXPORTABLE = ("triton",)


class SubmissionError(ValueError):
    """The export cannot produce a correct file; the message says what to change."""


@dataclass(frozen=True)
class Submission:
    """The rendered file and what it holds, for the CLI's summary."""

    text: str
    winners: int
    left_out: dict[str, int]


def inline_source(path: Path) -> str:
    """A module's source as it goes into the file: without its `from __future__` line and
    its imports from mla_tune/kernels (those names are defined earlier in the file)."""
    text = path.read_text(encoding="utf-8")
    text = text.replace(_FUTURE, "", 1)
    text = _IN_PROJECT.sub("", text)
    tree = ast.parse(text)
    for node in ast.walk(tree):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                 else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        if any(n.split(".")[0] in ("mla_tune", "kernels") for n in names):
            raise SubmissionError(f"{path.name} imports {names} inside a block; the "
                                  "submission cannot carry mla_tune")
    return text


def _top_level_names(text: str) -> set[str]:
    out: set[str] = set()
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return out


def _literal(value: Any) -> str:
    """Deterministic Python literal text (dict keys sorted, floats as repr)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(value[k])}"
                               for k in sorted(value)) + "}"
    if isinstance(value, tuple):
        inner = ", ".join(_literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, (bool, int, float, str)) or value is None:
        return repr(value)
    raise SubmissionError(f"cannot write {type(value).__name__} {value!r} as a literal")


def _pick(records: Sequence[Winner], sources: dict[str, str]
          ) -> tuple[dict[str, Winner], dict[str, int]]:
    """One winner per shape key (the fastest exportable one) and counts of what was left
    out, by reason."""
    left: dict[str, int] = {}
    best: dict[str, Winner] = {}
    for r in records:
        if r.backend not in EXPORTABLE:
            why = f"{r.backend} winners (only Triton kernels travel in the file)"
        elif r.source_hash != sources.get(r.backend):
            why = f"{r.backend} winners of other kernel sources"
        elif r.shape.page_size != 1:
            why = "winners of paged shapes (the task's cache is contiguous)"
        else:
            prev = best.get(r.shape.key)
            rank = (r.median_us, r.software.hash)
            if prev is None or rank < (prev.median_us, prev.software.hash):
                best[r.shape.key] = r
            continue
        left[why] = left.get(why, 0) + 1
    return best, left


def _checks(records: Sequence[Winner], sources: dict[str, str]
            ) -> dict[str, tuple[tuple[str, ...], tuple[str, ...], dict[tuple, str]]]:
    """Config text -> (shape keys verified ok, shape keys stored wrong, the smallest wrong
    shape's label per shape family), from every current exportable winner (a winner is
    verified at its own shape): what the dispatcher's trust rule reads."""
    from mla_tune.runtime.routing_rules import config_text

    acc: dict[str, tuple[set[str], set[str], dict[tuple, Shape]]] = {}
    for r in records:
        if r.backend not in EXPORTABLE or r.source_hash != sources.get(r.backend):
            continue
        ok, bad, fam = acc.setdefault(config_text(r.config), (set(), set(), {}))
        ok.add(r.shape.key)
        ok.update(s.key for s in r.verified_ok)
        for s in r.verified_wrong:
            bad.add(s.key)
            f = (s.kv_format.value, s.heads, s.q_len, s.page_size)
            if f not in fam or s.key < fam[f].key:
                fam[f] = s
    return {k: (tuple(sorted(ok)), tuple(sorted(bad)),
                {f: s.label() for f, s in fam.items()}) for k, (ok, bad, fam) in acc.items()}


def _families(shapes: Sequence[Shape]) -> set[tuple[int, int]]:
    return {(s.heads, s.q_len) for s in shapes}


def render_submission(records: Sequence[Winner], device_hash: str, *,
                      db_label: str, shapes: Sequence[Shape] = (),
                      leaderboard: str | None = None, gpu: str | None = None,
                      stand_ins: int = 0) -> Submission:
    """The submission file for the winners of device `device_hash` in `records`. `shapes`
    (a suite): keep only winners of their heads/q_len (all the exact and nearest routes
    of those shapes can use) and list their expected times in the header. `stand_ins`:
    how many records are `triton_stand_ins` (said in the header)."""
    from mla_tune.backends import get_backend
    from mla_tune.tuning.space import load_backend_space

    for label, value in (("--leaderboard", leaderboard), ("--gpu", gpu)):
        if value is not None and not _POPCORN_VALUE.fullmatch(value):
            raise SubmissionError(f"{label} {value!r}: use letters, digits, '_', '.', '-'")
    mine = [r for r in records if r.device.hash == device_hash]
    if not mine:
        raise SubmissionError(f"no winners for device {device_hash} in {db_label}")
    device = mine[0].device
    triton = get_backend("triton")
    sources = {"triton": triton.source_hash()}
    table, left = _pick(mine, sources)
    if shapes:
        fams = _families(shapes)
        dropped = [k for k, r in table.items() if (r.shape.heads, r.shape.q_len) not in fams]
        for k in dropped:
            del table[k]
        if dropped:
            left["winners of heads/q_len no requested shape has"] = len(dropped)
    checks = _checks(mine, sources)
    winners = {}
    stacks: dict[str, dict[str, str]] = {}
    for key in sorted(table):
        r = table[key]
        s = r.shape
        kv: Any = s.kv_lens[0] if not s.is_ragged else tuple(s.kv_lens)
        winners[key] = (s.kv_format.value, s.batch, kv, s.q_len, s.heads, s.page_size,
                        dict(r.config), round(r.median_us, 3), r.software.hash)
        stacks[r.software.hash] = r.software.as_dict()
    spaces = {t: tuple((n, tuple(c)) for n, c in load_backend_space("triton", t).params)
              for t in ("cuda", "cpu")}
    body = [inline_source(p) for p in SOURCES]
    seen: dict[str, str] = {}
    for p, text in zip(SOURCES, body):
        for name in _top_level_names(text):
            if name in seen:
                raise SubmissionError(f"{p.name} and {seen[name]} both define {name!r}; "
                                      "rename one so the inlined file keeps both")
            seen[name] = p.name
    literals = (f"TABLE_DEVICE = {_literal(device.to_json())}\n"
                f"TABLE_STACKS = {_literal(stacks)}\n"
                f"TRITON_SPACES = {_literal(spaces)}\n"
                "TABLE_CHECKS = {\n" + "".join(f"    {_literal(k)}: {_literal(v)},\n"
                                               for k, v in sorted(checks.items())) + "}\n"
                "TABLE_WINNERS = {\n" + "".join(f"    {_literal(k)}: {_literal(v)},\n"
                                                for k, v in winners.items()) + "}\n")
    digest = hashlib.sha256(literals.encode()).hexdigest()[:16]
    header = _header(db_label, device_hash, device.to_json(), stacks, sources, winners,
                     left, shapes, digest, leaderboard, gpu, stand_ins)
    tail = ('\n\n_router = SubmissionRouter(TABLE_DEVICE, TABLE_WINNERS, TRITON_SPACES, '
            'TABLE_STACKS, TABLE_CHECKS)\n_routes = _router.routes\n\n\n'
            'def custom_kernel(data):\n'
            '    """The task\'s `(q, kv_data, qo_indptr, kv_indptr, config)` -> '
            '`(total_q, H, 512)`\n    bfloat16, by the tuned variant of this call\'s shape '
            '(its first call checked in full)."""\n'
            '    try:\n'
            '        c = data[4]\n'
            '        run = _routes[(c["batch_size"], c["q_seq_len"], c["kv_seq_len"], '
            'c["num_heads"])]\n'
            '    except (LookupError, TypeError):\n'
            '        return _router.first_call(data)\n'
            '    return run(data)\n')
    sep = "\n\n# " + "-" * 86 + "\n# {}\n\n"
    parts = [header, _FUTURE]
    for p, text in zip(SOURCES, body):
        parts.append(sep.format(f"copied from the file {_source_name(p)}") + text.strip("\n") + "\n")
    parts.append(sep.format(f"the table (sha256 {digest})") + literals + tail)
    return Submission("".join(parts), len(winners), left)


def _header(db_label: str, device_hash: str, device: dict[str, Any],
            stacks: dict[str, dict[str, str]], sources: dict[str, str],
            winners: dict[str, tuple], left: dict[str, int], shapes: Sequence[Shape],
            digest: str, leaderboard: str | None, gpu: str | None, stand_ins: int = 0) -> str:
    lines = []
    if leaderboard:
        lines.append(f"#!POPCORN leaderboard {leaderboard}")
    if gpu:
        lines.append(f"#!POPCORN gpu {gpu}")
    lines += [
        "# MLA decode submission generated by `mla-tune export --submission` from a tuning",
        "# DB; do not edit it: sweep and export again.",
        f"# DB: {db_label}",
        f"# Device: {device['name']} ({device['arch']}, {device['sm_count']} SMs, "
        f"fingerprint {device_hash}); other devices run the heuristic or PyTorch paths.",
        f"# Winners: {len(winners)} Triton (kernel sources {sources['triton']}), table "
        f"sha256 {digest}; tuned under:",
    ]
    for h in sorted(stacks):
        n = sum(w[8] == h for w in winners.values())
        lines.append(f"#   {', '.join(f'{k} {v}' for k, v in sorted(stacks[h].items()))} "
                     f"({n} winners)")
    for why in sorted(left):
        lines.append(f"# Left out: {left[why]} {why}.")
    if stand_ins:
        lines.append(f"# {stand_ins} shapes won by such a family carry their fastest Triton "
                     "trial instead.")
    if shapes:
        lines.append("# Expected per call (tuned median us, L2 flushed; the format is the "
                     "dispatcher's choice among all three):")
        lines += [f"#   {line}" for line in _expectations(shapes, winners)]
    return "\n".join(lines) + "\n"


def _expectations(shapes: Sequence[Shape], winners: dict[str, tuple]) -> list[str]:
    """Per requested shape: the route each format would take and the expected time."""
    from mla_tune.runtime.routing_rules import format_rank, nearest_distance

    out = []
    for s in sorted({s.with_format(KVFormat.BF16) for s in shapes},
                    key=lambda s: (s.heads, s.q_len, s.batch, s.kv_len)):
        ranks = []
        for f in KVFormat:
            key = s.with_format(f).key
            w = winners.get(key)
            if w is not None:
                ranks.append((format_rank("exact", w[7], s.total_kv, s.total_kv, f.value),
                              f"{f.value} exact {w[7]:.1f} us"))
                continue
            near = sorted((v for v in winners.values() if v[0] == f.value and
                           v[4] == s.heads and v[3] == s.q_len and isinstance(v[2], int)),
                          key=lambda v: nearest_distance(s.batch, s.kv_len, v[1], v[2]))
            if near:
                v = near[0]
                ranks.append((format_rank("nearest", v[7], s.total_kv, v[1] * v[2], f.value),
                              f"{f.value} nearest {v[1]}x{v[2]} ({v[7]:.1f} us there)"))
            else:
                ranks.append((format_rank(None, None, s.total_kv, None, f.value),
                              f"{f.value} heuristic"))
        best = min(ranks)[1].split()[0]
        out.append(f"{s.label().replace(' bf16', '')}: runs {best}; " +
                   "; ".join(text for _, text in ranks))
    return out


def triton_stand_ins(store: Any, records: Sequence[Winner], device_hash: str) -> list[Winner]:
    """For each contiguous shape of device `device_hash` whose winner is of a family that
    cannot travel in the file (a vendor library), the fastest 'ok' trial of the current
    Triton sources at that shape, as a winner record: the file then routes that shape to
    the best kernel it carries, where leaving it out would send it to a fallback."""
    from mla_tune.backends import get_backend
    from mla_tune.results.selection import fastest_correct

    source = get_backend("triton").source_hash()
    have = {r.shape.key for r in records if r.backend in EXPORTABLE
            and r.source_hash == source and r.device.hash == device_hash}
    wanted = [r for r in records if r.backend not in EXPORTABLE and r.device_id is not None
              and r.device.hash == device_hash and r.shape.page_size == 1
              and r.shape.key not in have]
    # One read of the Triton trials per (device, stack) those shapes were tuned under.
    trials: dict[tuple[int, int | None], dict[str, list]] = {}
    for stack in dict.fromkeys((r.device_id, r.software_id) for r in wanted):
        by_shape = trials[stack] = {}
        for t in store.trials(device_id=stack[0], software_id=stack[1], backend="triton",
                              source_hash=source, status="ok"):
            by_shape.setdefault(t.shape_key, []).append(t)
    out = []
    for r in wanted:
        best = fastest_correct(trials[(r.device_id, r.software_id)].get(r.shape.key, []))
        if best is None or r.shape.key in have:
            continue
        have.add(r.shape.key)
        out.append(replace(r, backend="triton", source_hash=source, config=dict(best.config),
                           median_us=float(best.median_us), trial_id=best.id, id=None))
    return out


def write_submission(store: Any, path: str | Path, *, device_hash: str | None, db_label: str,
                     shapes: Sequence[Shape] = (), leaderboard: str | None = None,
                     gpu: str | None = None) -> Submission:
    """Render the submission for one device of `store` and write it atomically to `path`.
    `device_hash` may be None when the store holds winners of one device only."""
    import os
    import tempfile

    from mla_tune.results.winners_file import records_from_store

    problems: list[str] = []
    records = records_from_store(store, device_hash, warn=problems.append,
                                 verified_for=device_hash)
    if problems:
        raise SubmissionError(f"{db_label}: {problems[0]}")
    devices = sorted({r.device.hash for r in records})
    if device_hash is None:
        if len(devices) != 1:
            raise SubmissionError(f"{db_label} has winners of {len(devices)} devices "
                                  f"({', '.join(devices) or 'none'}); pick one with --device")
        device_hash = devices[0]
    stand_ins = triton_stand_ins(store, records, device_hash)
    sub = render_submission(records + stand_ins, device_hash, db_label=db_label,
                            shapes=shapes, leaderboard=leaderboard, gpu=gpu,
                            stand_ins=len(stand_ins))
    p = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", dir=p.absolute().parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(sub.text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # a file to share, not mkstemp's owner-only mode
        os.replace(tmp, p)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return sub
