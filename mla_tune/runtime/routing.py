"""The routing table: which variant a call of each shape runs, and why, decided from the
loaded winners alone (no kernel is built or run here). The policy, step by step, is in
mla_tune/runtime/dispatcher.py's module docstring; the Dispatcher adds the calls (input
checks, built runners, ragged buckets) on top of this table, and the bucket router reads
it the same way.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mla_tune.backends import Backend, get_backend
from mla_tune.machine.fingerprint import (
    CORE_PACKAGES,
    current_device,
    current_software,
    software_diff,
)
from mla_tune.problem.shapes import KVFormat, Shape, ShapeError
from mla_tune.results.winner import Winner
from mla_tune.runtime.input_checks import (
    check_config,
    check_sizes,
)
from mla_tune.runtime.routing_rules import (
    ROW_BLOCK_KNOB,
    TRANSFER_TRIES,
    format_rank,
    library_preferred,
    nearest_distance,
    row_model_note,
    row_model_picks,
    transfer_distance,
    transfer_order,
    trust_tier,
    tuned_route_order,
)
from mla_tune.tuning.space import ConfigError, ParamSpace, config_key

# Routing decisions log under the dispatcher's name, where users and tests set its level.
log = logging.getLogger("mla_tune.runtime.dispatcher")


FORCE_ENV = "MLA_TUNE_FORCE"


HEURISTIC_BACKENDS = ("triton", "torch")


LAST_RESORT = "torch"


FORMAT_ORDER = (KVFormat.BF16, KVFormat.FP8, KVFormat.MXFP4)



@dataclass(frozen=True)
class Decision:
    """One routing choice and why: what `mla-tune route` prints and the trace logs."""

    shape: Shape
    backend: str
    config: dict[str, Any]
    reason: str  # forced | exact | nearest | transfer | heuristic | fallback
    detail: str
    tuned_us: float | None = None
    tuned_shape: Shape | None = None

    def describe(self) -> str:
        return (f"{self.shape.key} -> {self.backend} {config_key(self.config)} "
                f"[{self.reason}] {self.detail}")


@dataclass(frozen=True)
class _Loaded:
    """A winner as the dispatcher holds it: the record, its config as its backend's space
    validated it, and how its stack differs from this one."""

    winner: Winner
    config: dict[str, Any]
    stack_diff: tuple[str, ...]


@dataclass
class _Checks:
    """Where one config of one backend (installed sources, this device) was checked
    against the reference: shape keys it matched at, shapes it was stored wrong at, and one
    wrong shape per shape family (format, heads, q_len, page size)."""

    ok: set[str]
    wrong: set[str]
    wrong_family: dict[tuple[KVFormat, int, int, int], Shape]


def _shape_family(s: Shape) -> tuple[KVFormat, int, int, int]:
    return (s.kv_format, s.heads, s.q_len, s.page_size)


@dataclass(frozen=True)
class _Family:
    backend: Backend
    sources: frozenset[str]
    """The installed sources' hashes: code hash, and the bytes hash winners files written
    before it carry (the same files)."""
    space: ParamSpace


def _default_device(device: str | torch.device | None) -> torch.device:
    """The dispatcher's device with an explicit index, so it compares equal to tensors'."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def _parse_force(spec: str) -> tuple[str, dict[str, str]] | None:
    """`backend:key=value,...` -> (backend, raw values); values are typed per shape
    against the backend's space."""
    spec = spec.strip()
    if not spec:
        return None
    name, _, rest = spec.partition(":")
    pairs: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{FORCE_ENV}: expected key=value, got {part!r} in {spec!r}")
        pairs[key.strip()] = value.strip()
    return name.strip(), pairs


def _typed_force(space: ParamSpace, raw: Mapping[str, str]) -> dict[str, Any]:
    """Match each forced text value against the declared choices' text."""
    out: dict[str, Any] = {}
    for key, text in raw.items():
        if key not in space.names:
            raise ValueError(f"{FORCE_ENV}: unknown parameter {key!r}; space has {space.names}")
        for choice in space.choices(key):
            if str(choice).lower() == text.lower():
                out[key] = choice
                break
        else:
            raise ValueError(f"{FORCE_ENV}: {key}={text} is not one of "
                             f"{list(space.choices(key))}")
    return out


def _config_shape(config: Any, kv_lens: Sequence[int] | None,
                  kv_format: KVFormat, data: Any = None) -> Shape:
    """The Shape of a call, from its config (and host kv lengths when ragged), checked
    against the call's tensor sizes first when `data` is given."""
    vals = check_config(config)
    if data is not None:
        check_sizes(data, vals)
    batch, kv_max = vals["batch_size"], vals["kv_seq_len"]
    try:
        if kv_lens is None:
            return Shape.uniform(batch, kv_max, q_len=vals["q_seq_len"],
                                 heads=vals["num_heads"], kv_format=kv_format)
        lens = tuple(kv_lens)
        if any(type(k) is not int for k in lens):
            raise ValueError(f"kv_lens must be ints, got {lens[:8]!r}...")
        if len(lens) != batch:
            raise ValueError(f"kv_lens has {len(lens)} lengths for batch_size {batch}")
        if lens and max(lens) > kv_max:
            raise ValueError(f"kv_lens max {max(lens)} exceeds config kv_seq_len {kv_max}")
        return Shape(batch, lens, q_len=vals["q_seq_len"], heads=vals["num_heads"],
                     kv_format=kv_format)
    except ShapeError as e:
        raise ValueError(f"config/kv_lens: {e}") from None



class RoutingTable:
    """Loaded winners and the routing steps over them (exact, moved, heuristic, last resort)."""

    def __init__(self, winners: Iterable[Winner] = (),
                 device: str | torch.device | None = None, *,
                 kv_format: KVFormat | str | None = None, strict: bool = False,
                 origin: str = "an in-memory table") -> None:
        self.device = _default_device(device)
        self.fingerprint = current_device(self.device)
        self.kv_format = KVFormat.parse(kv_format) if kv_format is not None else None
        self.strict = strict
        self.origin = origin
        self.ignored: dict[str, int] = {}
        self._families: dict[str, _Family | str] = {}
        self._table = self._load(list(winners))
        self._uniform: dict[tuple[KVFormat, int, int, int], list[_Loaded]] = {}
        for w in self._table.values():
            s = w.winner.shape
            if not s.is_ragged:
                self._uniform.setdefault((s.kv_format, s.heads, s.q_len, s.page_size),
                                         []).append(w)
        # The forced variant, checked and typed once: (family name, knob values).
        self._force_spec = os.environ.get(FORCE_ENV, "")
        self._force: tuple[str, dict[str, Any]] | None = None
        parsed = _parse_force(self._force_spec)
        if parsed is not None:
            fam = self._family(parsed[0])
            if isinstance(fam, str):
                raise ValueError(f"{FORCE_ENV}: {fam}")
            self._force = (parsed[0], _typed_force(fam.space, parsed[1]))

    def _family(self, name: str) -> _Family | str:
        """The backend `name` if it can run here, else why not (cached)."""
        if name not in self._families:
            try:
                b = get_backend(name)
                avail = b.available(self.device)
                self._families[name] = (
                    _Family(b, frozenset({b.source_hash(), b.source_bytes_hash()}),
                            b.declared_space(self.device)) if avail
                    else f"backend {name!r} is not available here: {avail.reason}")
            except Exception as e:  # noqa: BLE001 - an unusable backend is data, not a crash
                self._families[name] = f"backend {name!r} cannot be loaded: {e}"
        return self._families[name]

    def _ignore(self, why: str) -> None:
        self.ignored[why] = self.ignored.get(why, 0) + 1

    def _load(self, records: list[Winner]) -> dict[str, _Loaded]:
        here = self.fingerprint.hash
        usable: list[tuple[Winner, _Family]] = []
        for r in records:
            if r.device.hash != here:
                self._ignore("tuned on another device")
                continue
            fam = self._family(r.backend)
            if isinstance(fam, str):
                log.warning("mla-tune: skipping winner for %s: %s", r.shape.key, fam)
                self._ignore("backend unknown or unavailable")
            elif r.source_hash not in fam.sources:
                self._ignore("kernel sources changed since tuning")
            else:
                usable.append((r, fam))
        off_source = self.ignored.get("kernel sources changed since tuning", 0)
        if off_source:
            # Tuned routes that silently went missing: say so once per load.
            log.warning("mla-tune: ignoring %d winner(s) tuned on this device for other kernel "
                        "code than this installation's (`mla-tune doctor` names them)",
                        off_source)
        extra: dict[str, str] = {}
        own: dict[str, set[str]] = {}
        for fam in {id(f): f for _, f in usable}.values():
            try:
                versions = fam.backend.versions()
            except Exception as e:  # noqa: BLE001
                log.warning("mla-tune: cannot read %s versions: %s", fam.backend.name, e)
                versions = {}
            extra.update(versions)
            own[fam.backend.name] = set(versions)
        self._checks = self._index_checks(usable)
        here_sw = current_software(extra)
        table: dict[str, _Loaded] = {}
        warned: set[str] = set()
        for r, fam in usable:
            try:
                config = fam.space.validate(r.config)
            except ConfigError as e:
                log.warning("mla-tune: skipping winner for %s: config outside the %s space "
                            "(%s)", r.shape.key, r.backend, e)
                self._ignore("config outside its backend's space")
                continue
            # A winner depends on the core stack and on its own backend's libraries only
            # (a FlashInfer upgrade says nothing about a Triton winner).
            relevant = set(CORE_PACKAGES) | own.get(r.backend, set())
            changed = {k: v for k, v in software_diff(r.software, here_sw).items()
                       if k in relevant and v[0] is not None}
            diff = tuple(changed)
            if diff:
                if self.strict:
                    self._ignore("tuned under other library versions (strict)")
                    continue
                if r.software.hash not in warned:
                    warned.add(r.software.hash)
                    log.warning("mla-tune: using winners tuned under other versions (%s); "
                                "pass strict=True to ignore them",
                                ", ".join(f"{k} {a} here {b or 'absent'}"
                                          for k, (a, b) in changed.items()))
            w = _Loaded(r, config, diff)
            prev = table.get(r.shape.key)
            if prev is None or self._rank(w) < self._rank(prev):
                table[r.shape.key] = w
        return table

    @staticmethod
    def _index_checks(usable: list[tuple[Winner, _Family]]
                      ) -> dict[tuple[str, str], _Checks]:
        """(backend, config key) -> where it was verified, from every usable record (a
        winner is verified at its own shape), built once at load."""
        out: dict[tuple[str, str], _Checks] = {}
        for r, fam in usable:
            try:
                key = (r.backend, config_key(fam.space.validate(r.config)))
            except ConfigError:
                continue
            c = out.setdefault(key, _Checks(set(), set(), {}))
            c.ok.update(s.key for s in r.verified_ok)
            c.ok.add(r.shape.key)
            for s in r.verified_wrong:
                c.wrong.add(s.key)
                c.wrong_family.setdefault(_shape_family(s), s)
        return out

    def trust(self, backend: str, config: Mapping[str, Any], shape: Shape
              ) -> tuple[int, str] | None:
        """None if `config` of `backend` was stored wrong at `shape` (never run it there),
        else (tier, why): 0 verified at this shape, 1 never verified here, 2 suspect (wrong
        at another shape of its family)."""
        c = self._checks.get((backend, config_key(config)))
        if c is None:
            return 1, "never verified at this shape"
        return trust_tier(shape.key, _shape_family(shape), c.ok, c.wrong, c.wrong_family)

    @staticmethod
    def _rank(w: _Loaded) -> tuple[Any, ...]:
        return (len(w.stack_diff), w.winner.median_us, w.winner.backend, config_key(w.config))

    @property
    def loaded(self) -> int:
        """Number of shapes with a usable tuned winner."""
        return len(self._table)

    def summary(self) -> str:
        """One line on where the table came from and what was left out, and why."""
        fp = self.fingerprint
        text = (f"{self.loaded} tuned shape(s) from {self.origin} for {fp.name} "
                f"({fp.arch}, fingerprint {fp.hash})")
        if self.ignored:
            text += "; ignored: " + ", ".join(f"{n} {why}" for why, n in
                                              sorted(self.ignored.items()))
        return text

    def _forced(self, shape: Shape,
                fits: Callable[[Backend, Mapping[str, Any]], bool] | None = None
                ) -> Decision | None:
        """`MLA_TUNE_FORCE`'s variant for `shape`: the first point of the forced family's
        space that matches and runs the shape (`fits`, default the family's feasibility;
        a length bucket passes its runner's, whose knobs differ)."""
        if self._force is None:
            return None
        name, want = self._force
        fam = self._family(name)
        assert not isinstance(fam, str)  # checked in __init__
        if fam.backend.supports(shape) is None:
            runs = fits or (lambda backend, c: backend.feasible(shape, c))
            for c in fam.space.grid():
                if all(c[k] == v for k, v in want.items()) and runs(fam.backend, c):
                    return Decision(shape, name, c, "forced", f"by {FORCE_ENV}")
        log.warning("mla-tune: %s=%s is not feasible for %s; routing as usual", FORCE_ENV,
                    self._force_spec, shape.key)
        return None

    def _tuned(self, shape: Shape) -> Decision | None:
        """The exact winner, else the first variant moved from or copied off a nearby
        tuned shape (module docstring, steps 1-3)."""
        found = self._tuned_all(shape)
        return found[0] if found else None

    def _tuned_all(self, shape: Shape) -> list[Decision]:
        """The exact winner; else, in the order tried: a variant of the call's family
        verified at this very shape (as tuned), the nearest tuned shape's variant moved by
        the row model ("nearest" when that shape is of the call's family, else
        "transfer"), then the nearest tuned shape of the call's family's variant as tuned
        (the only step for families the row model does not describe)."""
        w = self._table.get(shape.key)
        if w is not None:
            note = f" (tuned under other {'/'.join(w.stack_diff)})" if w.stack_diff else ""
            return [Decision(shape, w.winner.backend, w.config, "exact",
                             f"tuned winner of this shape, {w.winner.median_us:.1f} us{note}",
                             w.winner.median_us, w.winner.shape)]
        return tuned_route_order(self._nearest_as_tuned(shape), self._moved(shape))

    def _nearest_as_tuned(self, shape: Shape) -> list[tuple[int, Decision]]:
        """(trust tier, decision) of the nearest feasible tuned uniform shapes of the call's
        family, their variants as tuned: the first verified at this shape, if any, and the
        first by distance over (log batch, log kv length). Never a variant stored wrong
        here, nor one wrong elsewhere in the family (suspect: the heuristic comes first)."""
        def distance(w: _Loaded) -> tuple[float, int, int]:
            s = w.winner.shape
            return nearest_distance(shape.batch, shape.kv_len, s.batch, s.kv_len)

        ranked = []
        for w in self._uniform.get(_shape_family(shape), ()):
            t = self.trust(w.winner.backend, w.config, shape)
            if t is not None and t[0] < 2:
                ranked.append((t[0], distance(w), t[1], w))
        out: list[tuple[int, Decision]] = []
        for tier, dist, why, w in sorted(ranked, key=lambda x: x[:2]):
            fam = self._family(w.winner.backend)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None \
                    or not fam.backend.feasible(shape, w.config) \
                    or any(t == tier for t, _ in out):
                continue
            s = w.winner.shape
            kind = "ragged call: variant of" if shape.is_ragged else "no winner here; variant of"
            out.append((tier, Decision(
                shape, w.winner.backend, w.config, "nearest",
                f"{kind} nearest tuned shape {s.label()} as tuned (log distance "
                f"{dist[0]:.2f}, {w.winner.median_us:.1f} us there; {why})",
                w.winner.median_us, s)))
        return out

    def _moved(self, shape: Shape) -> list[Decision]:
        """The nearest tuned uniform shape of any q_len/heads family (same format and page
        size) by `transfer_distance` (the call's own family first on ties), its variant
        moved by the row model: block and splits re-derived, other knobs kept where the
        call's feasible candidates allow; a few alternatives, in case the first fails its
        precheck. Row-blocked variants (a `block_m` knob) move so; a library that plans
        its own rows (`Backend.plans_own_rows`) may serve a call with at least its source's
        rows per sequence with its config as tuned, the nearest such source, and comes
        before the moved variants only where the tuned shapes around the call say the
        library wins there (`library_preferred`); of other families nothing says how a
        config tuned for other rows behaves."""
        rows = shape.q_len * shape.heads
        own = _shape_family(shape)
        loaded, sources, evidence = [], [], []
        for fam_key, winners in self._uniform.items():
            if (fam_key[0], fam_key[3]) != (shape.kv_format, shape.page_size):
                continue
            for w in winners:
                s = w.winner.shape
                row_blocked = ROW_BLOCK_KNOB in w.config
                library = not row_blocked and self._plans_rows(w.winner.backend)
                if row_blocked or library:
                    evidence.append((s.batch, s.kv_len, s.q_len * s.heads, library))
                if not (row_blocked or (library and s.q_len * s.heads <= rows)):
                    continue  # nothing says how its config behaves at these rows
                loaded.append(w)
                sources.append((s.batch, s.kv_len, s.q_len * s.heads, s.q_len, fam_key != own,
                                (w.winner.backend, config_key(w.config))))
        blocked: list[Decision] = []
        library: list[Decision] = []
        for i in transfer_order(shape.batch, shape.kv_len, rows, shape.q_len, sources):
            w, other = loaded[i], sources[i][4]
            row_blocked = ROW_BLOCK_KNOB in w.config
            if (blocked if row_blocked else library):
                continue  # the nearest source of each kind only
            fam = self._family(w.winner.backend)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None:
                continue
            moved = self._row_model(w.winner.backend, fam, shape, w, TRANSFER_TRIES) \
                if row_blocked else self._as_tuned(w.winner.backend, fam, shape, w.config)
            if not moved:
                continue
            s = w.winner.shape
            dist = transfer_distance(shape.batch, shape.kv_len, rows, shape.q_len, s.batch,
                                     s.kv_len, s.q_len * s.heads, s.q_len)
            what = ("a tuned shape of another q_len/heads family" if other
                    else "ragged call: nearest tuned shape" if shape.is_ragged
                    else "no winner here; nearest tuned shape")
            head = (f"{what} {s.label()} (distance {dist[0]:.2f} over log batch, kv, "
                    f"rows; {w.winner.median_us:.1f} us there)")
            (blocked if row_blocked else library).extend(
                Decision(shape, w.winner.backend, config, "transfer" if other else "nearest",
                         f"{head}; {note}; {trust[1]}", w.winner.median_us, s)
                for config, trust, note in moved)
            if blocked and library:
                break
        if library and library_preferred(shape.batch, shape.kv_len, rows, evidence):
            return library + blocked
        return blocked + library

    def _plans_rows(self, name: str) -> bool:
        """Whether backend `name` runs here and plans its own rows (Backend.plans_own_rows)."""
        fam = self._family(name)
        return not isinstance(fam, str) and fam.backend.plans_own_rows

    def _as_tuned(self, name: str, fam: _Family, shape: Shape, config: Mapping[str, Any]
                  ) -> list[tuple[dict[str, Any], tuple[int, str], str]]:
        """A tuned config of a library that plans its own rows, for `shape` as it is: if
        feasible there and not stored wrong (or suspect) there."""
        trust = self.trust(name, config, shape)
        if trust is None or trust[0] >= 2 or not fam.backend.feasible(shape, config):
            return []
        return [(dict(config), trust, f"{name} plans its own rows: config as tuned")]

    def _row_model(self, name: str, fam: _Family, shape: Shape, source: _Loaded | None,
                   limit: int) -> list[tuple[dict[str, Any], tuple[int, str], str]]:
        """Up to `limit` feasible configs of family `name` for `shape`, best first, by the
        row model (`routing_rules.model_knobs`): moved from `source`'s tuned variant, or
        the heuristic's when None; none stored wrong here. Each with its trust and a note
        on what the model wanted."""
        cands = fam.backend.candidates(shape, self.device)
        trusted = [(c, t) for c in cands if (t := self.trust(name, c, shape)) is not None]
        if not trusted:
            return []
        rows = shape.q_len * shape.heads
        src = None
        if source is not None:
            s = source.winner.shape
            src = (source.config, s.batch, s.q_len * s.heads, s.kv_len)
        units = self.fingerprint.sm_count
        picked, block_m, want = row_model_picks(
            shape.batch, rows, shape.kv_len, units, [c for c, _ in trusted],
            [t[0] for _, t in trusted], dict(fam.space.params), src, limit)
        note = row_model_note(rows, block_m, want, units,
                              "cores" if self.fingerprint.vendor == "cpu" else "SMs")
        return [(trusted[i][0], trusted[i][1], note) for i in picked]

    def _heuristic(self, shape: Shape) -> Decision | None:
        """The row model without a tuned shape on the first available family of
        `HEURISTIC_BACKENDS`: the block the rows fill, the occupancy model's splits."""
        for name in HEURISTIC_BACKENDS:
            fam = self._family(name)
            if isinstance(fam, str) or fam.backend.supports(shape) is not None:
                continue
            for config, trust, note in self._row_model(name, fam, shape, None, 1):
                return Decision(shape, name, config, "heuristic",
                                f"no tuned shape to move here; {note}; {trust[1]}")
        return None

    def _last_resort(self, shape: Shape) -> Decision | None:
        fam = self._family(LAST_RESORT)
        if isinstance(fam, str):
            raise RuntimeError(f"mla-tune: no kernel can run here: {fam}")
        cands = fam.backend.candidates(shape, self.device) or [next(fam.space.grid())]
        trust = {i: t for i, c in enumerate(cands)
                 if (t := self.trust(LAST_RESORT, c, shape)) is not None}
        if not trust:
            return None
        best = min(trust, key=lambda i: (trust[i][0] == 2, i))
        return Decision(shape, LAST_RESORT, cands[best], "fallback",
                        "last resort: torch family, first feasible config of its space not "
                        f"stored wrong here; {trust[best][1]}")

    def decisions(self, shape: Shape) -> list[Decision]:
        """Every variant a call of `shape` may run, in the order they are tried."""
        out: list[Decision] = []
        seen: set[tuple[str, str]] = set()
        for d in (self._forced(shape), *self._tuned_all(shape), self._heuristic(shape),
                  self._last_resort(shape)):
            if d is None or (d.backend, config_key(d.config)) in seen:
                continue
            seen.add((d.backend, config_key(d.config)))
            if self.trust(d.backend, d.config, shape) is None:
                log.warning("mla-tune: not running %s %s for %s: stored wrong for this "
                            "shape", d.backend, config_key(d.config), shape.key)
                continue
            out.append(d)
        return out

    def decide(self, shape: Shape) -> Decision:
        """What a call of `shape` runs (if it builds), and why."""
        out = self.decisions(shape)
        if not out:
            raise RuntimeError(f"mla-tune: every variant that could run {shape.key} was "
                               "stored wrong for it")
        return out[0]

    def choose_format(self, shape: Shape, present: Iterable[str]) -> KVFormat:
        """The KV format a call of `shape` (its own format ignored) runs in, among the
        `present` ones (module docstring: the policy)."""
        have = [f for f in FORMAT_ORDER if f.value in set(present)]
        if self.kv_format is not None:
            if self.kv_format not in have:
                raise ValueError(f"kv_data lacks {self.kv_format.value!r}, the pinned format")
            return self.kv_format
        if not have:
            raise ValueError(f"kv_data holds none of {[f.value for f in FORMAT_ORDER]}")

        def estimate(f: KVFormat) -> tuple[int, float, int]:
            s = shape.with_format(f)
            d = self._tuned(s)
            if d is None or d.tuned_shape is None:
                return format_rank(None, None, s.total_kv, None, f.value)
            return format_rank(d.reason, d.tuned_us, s.total_kv, d.tuned_shape.total_kv,
                               f.value)

        return min(have, key=estimate)
