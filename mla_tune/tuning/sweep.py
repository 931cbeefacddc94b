"""The sweep: for each shape, every available backend's candidates are built, verified
against the float32 reference, timed, and stored; then the shape's finalists are timed
again side by side (`mla_tune.tuning.runoff`) and the shape's winner is updated. The
shapes of one call in several KV formats run off together (the dispatcher picks a call's
format from its winners' times).

Candidates run in worker processes (`mla_tune.tuning.workers`), one per device slot, never in
this process: a variant that crashes, hangs or exhausts memory costs one recorded trial,
not the sweep. The candidates of each (shape, backend) are a queue in the tuning DB
(`TuningStore.enqueue` / `claim`), so several sweeps on one database — on one machine or
on many sharing a PostgreSQL server — measure each candidate once, and a sweep killed at
any moment leaves claims that the next run takes over (at once when the dead sweep ran on
the same machine, else when its heartbeats stop for `stale_after_s`).

Library baselines (FlashInfer, aiter) and the torch family are always timed when
available, so every winner can be compared with what users already have.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from typing import Any

import torch

from mla_tune.backends import (
    Backend,
    backend_names,
    get_backend,
    library_versions,
    source_hashes,
)
from mla_tune.db import ClaimRow, TrialGroup, TrialResult, TrialRow, TuningStore
from mla_tune.machine.fingerprint import (
    DeviceFingerprint,
    SoftwareFingerprint,
    current_software,
)
from mla_tune.problem.shapes import Shape
from mla_tune.results.selection import update_winner
from mla_tune.results.winner import Winner
from mla_tune.tuning.compile_ahead import CompileStage
from mla_tune.tuning.evaluate import TrialOutcome
from mla_tune.tuning.optuna_study import open_study, study_name
from mla_tune.tuning.owners import (
    _signals_held,
    owner_id,
    owner_is_dead,
)
from mla_tune.tuning.plan import available_backends, shape_candidates
from mla_tune.tuning.runoff import (
    call_finalists,
    call_of,
    timed_together,
    timed_with,
)
from mla_tune.tuning.search import SearchDriver, Strategy, make_sampler
from mla_tune.tuning.sweep_api import (
    BackendSummary,
    ShapeResult,
    SweepError,
    SweepInterrupted,
    SweepObserver,
    SweepOptions,
)
from mla_tune.tuning.workers import (
    BandwidthJob,
    Done,
    RunoffJob,
    TrialJob,
    WarmupJob,
    WorkerPool,
    WorkerPoolError,
)

log = logging.getLogger(__name__)
BASELINE_BACKENDS = ("flashinfer", "aiter", "torch")
# How often an idle sweep looks again for candidates other sweeps hold.
_POLL_S = 1.0


def resolve_backends(names: Sequence[str] | None, baselines: bool) -> list[Backend]:
    """The backends to sweep: the named ones (all when none named) plus the baselines."""
    chosen = list(names) if names else backend_names()
    if baselines:
        chosen += [b for b in BASELINE_BACKENDS if b in backend_names() and b not in chosen]
    return [get_backend(n) for n in dict.fromkeys(chosen)]












@dataclass
class _Group:
    """One (shape, backend): its queue key, search driver and progress."""

    shape: Shape
    backend: Backend
    key: TrialGroup
    driver: SearchDriver
    summary: BackendSummary
    running: int = 0
    done: bool = False


@dataclass
class _ShapeRun:
    shape: Shape
    summaries: list[BackendSummary]
    groups: list[_Group]
    result: ShapeResult | None = None
    runoff_pending: bool = False  # its finalists are queued for, or in, a run-off
    ready: bool = False  # every candidate stored and the first winner picked
    winner: Winner | None = None  # that first winner


@dataclass
class _Runoff:
    """The finalists of a call's shapes (one per KV format the sweep tunes it in) waiting
    for (or on) a worker to time them side by side."""

    runs: list[_ShapeRun]
    trials: list[TrialRow]


class _Sweep:
    """The driver loop: keeps every worker busy with claimed candidates, stores results,
    heartbeats its claims, and finishes each shape once all its candidates are stored."""

    def __init__(self, shapes: Sequence[Shape], usable: list[Backend],
                 skipped: dict[str, str], store: TuningStore, options: SweepOptions,
                 observer: SweepObserver | None, pool: WorkerPool,
                 dev_fp: DeviceFingerprint, sw_fp: SoftwareFingerprint) -> None:
        self.shapes, self.usable, self.skipped = list(shapes), usable, skipped
        self.store, self.options, self.observer, self.pool = store, options, observer, pool
        self.device = torch.device(options.devices[0])
        self.dev_hash, self.sw_hash = dev_fp.hash, sw_fp.hash
        self.device_id = store.device_id(dev_fp)
        self.software_id = store.software_id(sw_fp)
        self.sources = source_hashes()
        self.owner = owner_id()
        self.dead: set[str] = set()
        self.runs: list[_ShapeRun] = []
        # The shape keys of each call the sweep covers (its formats run off together).
        self.calls: dict[str, set[str]] = {}
        for shape in self.shapes:
            self.calls.setdefault(call_of(shape), set()).add(shape.key)
        self.out: dict[int, tuple[_Group, dict[str, Any]] | _Runoff] = {}
        self.runoffs: list[_Runoff] = []
        # Shape whose input and reference each worker slot holds (it regenerates them when
        # it moves to another shape, so each worker keeps to a shape of its own).
        self.holds: dict[int, str] = {}
        self.new_trials = 0
        self.storage = store.optuna_storage(heartbeat_s=max(1, round(options.heartbeat_s)),
                                            grace_s=max(1, round(options.stale_after_s)))
        self.next_beat = time.monotonic() + options.heartbeat_s

    def warm_up(self) -> None:
        """Work that needs no compiled kernel, sent while the compile stage finishes: the
        device's read bandwidth (once per device) on one worker; on each other, its first
        shape's input and reference and its backends' imports. Called once, before `run`."""
        self._measure_bandwidth()
        names = tuple(b.name for b in self.usable)
        for i, slot in enumerate(self.pool.idle()):
            shape = self.shapes[i % len(self.shapes)]
            self.pool.submit(slot, WarmupJob(shape.to_json(), names),
                             self.options.candidate_timeout_s)
            self.holds[slot] = shape.key

    def run(self) -> list[ShapeResult]:
        while not self._finished():
            self._fill()
            now = time.monotonic()
            wait_s = max(0.0, self.next_beat - now)
            if not self.pool.busy:
                wait_s = min(wait_s, _POLL_S)  # waiting on candidates other sweeps hold
            finished = [(done, self.out.pop(done.slot, None)) for done in self.pool.wait(wait_s)]
            # Freed workers get their next candidates before their results are stored, so
            # storing (DB and Optuna, tens of ms) overlaps the next measurement.
            t0 = time.perf_counter()
            self._fill()
            t1 = time.perf_counter()
            for done, job in finished:
                self._handle(done, job)
            self._settle([job[0] for _, job in finished if isinstance(job, tuple)])
            if finished:
                log.debug("next candidates out in %.0f ms; %d result(s) stored in %.0f ms",
                          (t1 - t0) * 1e3, len(finished), (time.perf_counter() - t1) * 1e3)
            if time.monotonic() >= self.next_beat:
                self._heartbeat()
            if not self.pool.alive:
                raise SweepError("every worker failed to restart; see the last trials' "
                                 "errors for the cause")
        return self.results()

    def stop(self) -> int:
        """Clean stop: end the workers, close asked Optuna trials, and put this sweep's
        running claims back in the queue. Returns how many were put back. When the DB
        fails meanwhile (the disk is full), the claims stay with this dead sweep, and the
        next sweep takes them over; the error that stopped the sweep is the one reported."""
        self.pool.close()
        try:
            for r in self.runs:
                for g in r.groups:
                    g.driver.abandon()
            return self.store.release(self.owner)
        except Exception as exc:
            log.warning("claims of the stopped sweep not put back (the next sweep takes them "
                        "over): %s", exc)
            return 0

    def results(self) -> list[ShapeResult]:
        return [r.result for r in self.runs if r.result is not None]

    def _finished(self) -> bool:
        return len(self.runs) == len(self.shapes) and all(r.result for r in self.runs)

    def _measure_bandwidth(self) -> None:
        """Measure the device's read bandwidth once (a GPU with no stored value), on a
        worker like any candidate, while the other workers start tuning."""
        if self.device.type != "cuda":
            return
        row = next(d for d in self.store.devices() if d.id == self.device_id)
        if row.read_bw_gbps is None:
            self.pool.submit(self.pool.idle()[0], BandwidthJob(),
                             self.options.candidate_timeout_s)

    def _fill(self) -> None:
        """Give every idle worker a job: a shape's run-off first (it finishes the shape),
        else its next candidate."""
        for slot in self.pool.idle():
            job = None if self.runoffs else self._next_job(slot)
            if job is None:
                if not self.runoffs:  # _next_job may have queued one
                    return
                self._submit_runoff(slot, self.runoffs.pop(0))
                continue
            group, config = job
            self.pool.submit(slot, TrialJob(group.shape.to_json(), group.backend.name, config),
                             self.options.candidate_timeout_s)
            self.out[slot] = (group, config)
            self.holds[slot] = group.shape.key
            group.running += 1

    def _submit_runoff(self, slot: int, task: _Runoff) -> None:
        cands = tuple((t.backend, t.config) for t in task.trials)
        shape = task.runs[0].shape
        formats = tuple(t.kv_format for t in task.trials) if len(task.runs) > 1 else ()
        self.pool.submit(slot, RunoffJob(shape.to_json(), cands, formats),
                         self.options.candidate_timeout_s * len(cands))
        self.out[slot] = task
        self.holds[slot] = shape.key

    def _next_job(self, slot: int) -> tuple[_Group, dict[str, Any]] | None:
        """A claimed candidate for `slot`: of the shape it holds inputs for, else of an
        open shape no other worker holds, else of a newly opened shape, else of any open
        shape. Workers thus keep to shapes of their own (each shape's input and reference
        made once, not once per worker) until the last shapes, which they share."""
        mine = self.holds.get(slot)
        others = {key for s, key in self.holds.items() if s != slot}
        while True:
            open_runs = [r for r in self.runs if r.result is None]
            ranked = ([r for r in open_runs if r.shape.key == mine]
                      + [r for r in open_runs if r.shape.key != mine and r.shape.key not in others])
            job = self._claim_from(ranked)
            if job is not None:
                return job
            if len(self.runs) < len(self.shapes):
                self._open(self.shapes[len(self.runs)])
                continue
            return self._claim_from([r for r in self.runs if r.result is None])

    def _claim_from(self, runs: list[_ShapeRun]) -> tuple[_Group, dict[str, Any]] | None:
        """A claimed candidate of the first of `runs` that has one; finishes the shapes
        found to have none left."""
        for r in runs:
            if r.result is not None:
                continue
            for g in r.groups:
                if not g.done:
                    config = self._claim(g)
                    if config is not None:
                        return g, config
            self._maybe_finish(r)
        return None

    def _claim(self, g: _Group) -> dict[str, Any] | None:
        config = self._take(g)
        if config is None and g.running == 0:
            left = self._claims_left(g)
            if not left:
                g.done = True
            elif self._note_dead(left):
                config = self._take(g)
        return config

    def _claims_left(self, g: _Group) -> list[ClaimRow]:
        """The claims of `g`'s candidates this sweep still waits for."""
        left = self.store.claims(g.key)
        if not g.driver.has_room():
            # The budget is spent, so this sweep takes nothing more: it waits only for
            # candidates other live sweeps are measuring now, not for queued or abandoned
            # ones (a later sweep takes those).
            left = [c for c in left if self._held_by_live_sweep(c)]
        return left

    def _settle(self, groups: list[_Group]) -> None:
        """Finish the shapes of `groups` (whose results were just stored) that have nothing
        left to measure. A freed worker takes its next candidate, often of the next shape,
        before its last result here is stored, and _claim_from may not look at this shape
        again until that one runs out: a sweep stopped meanwhile would leave a fully
        measured shape without its winner."""
        for g in groups:
            if not (g.done or g.running or g.driver.remaining() or self._claims_left(g)):
                g.done = True
        for r in self.runs:
            self._maybe_finish(r)

    def _take(self, g: _Group) -> dict[str, Any] | None:
        """Claim a queued (or abandoned) candidate of `g` while the budget allows; for
        sampled strategies, ask the sampler for new ones and claim those. The budget counts
        what every sweep on the DB spent on the group (`TuningStore.spent`), checked again
        in each claim's transaction."""
        budget, stale = self.options.budget, self.options.stale_after_s
        if budget is not None:
            g.driver.note_spent(self.store.spent(g.key, stale_after_s=stale,
                                                 dead_owners=self.dead))
        if g.driver.has_room():
            config = self.store.claim(g.key, self.owner, stale_after_s=stale,
                                      dead_owners=self.dead, budget=budget)
            if config is not None:
                g.driver.taken(config)  # counts against the budget while it runs
                return config
        if self.options.strategy is Strategy.GRID:
            return None
        while (proposal := g.driver.ask()) is not None:
            config = self.store.claim(g.key, self.owner, stale_after_s=stale,
                                      dead_owners=self.dead, config=proposal, budget=budget)
            if config is not None:
                return config
            if budget is not None:
                spent = self.store.spent(g.key, stale_after_s=stale, dead_owners=self.dead)
                if spent >= budget:  # other sweeps spent the rest meanwhile
                    g.driver.note_spent(spent)
                    g.driver.withdraw(proposal)
                    return None
            g.driver.measured_elsewhere(proposal)  # another sweep holds it: not a failure
        return None

    def _held_by_live_sweep(self, claim: ClaimRow) -> bool:
        """Whether another sweep is measuring `claim` now (it is running, its holder is
        not known dead and its heartbeats are fresh)."""
        return (claim.state == "running" and claim.claimed_by not in self.dead
                and claim.heartbeat_age_s is not None
                and claim.heartbeat_age_s < self.options.stale_after_s)

    def _note_dead(self, claims: Collection[ClaimRow]) -> bool:
        """Remember holders of `claims` that died on this machine; True if any is new."""
        owners = {c.claimed_by for c in claims if c.state == "running" and c.claimed_by}
        new = {o for o in owners - self.dead - {self.owner} if owner_is_dead(o)}
        self.dead |= new
        return bool(new)

    def _open(self, shape: Shape) -> None:
        if self.observer:
            self.observer.shape_started(shape, [b.name for b in self.usable]
                                        + list(self.skipped))
        summaries = [BackendSummary(n, skipped=r) for n, r in self.skipped.items()]
        run = _ShapeRun(shape, summaries, [])
        self.runs.append(run)
        for backend in self.usable:
            summary = BackendSummary(backend.name)
            summaries.append(summary)
            cands = shape_candidates(backend, shape, self.device, self.options.pins)
            if isinstance(cands, str):
                summary.skipped = cands
                continue
            source = self.sources[backend.name]
            key = TrialGroup(self.device_id, self.software_id, shape.key, backend.name, source)
            if self.options.retry:
                self.store.delete_trials(key, self.options.retry)
            prior = self.store.measured(key)
            measured = {k: (t.median_us if t.status == "ok" else None) for k, t in prior.items()}
            summary.reused_trials = len(measured)
            oks = [v for v in measured.values() if v is not None]
            summary.best_us = min(oks) if oks else None
            study = open_study(self.storage, study_name(self.dev_hash, self.sw_hash, shape.key,
                                                        backend.name, source),
                               make_sampler(self.options.strategy, self.options.seed))
            driver = SearchDriver(study, backend.declared_space(self.device), cands,
                                  self.options.strategy, self.options.budget, measured)
            if self.options.strategy is not Strategy.GRID:  # the sampler learns from the study
                # Stored results it lacks (a sweep killed between storing and telling),
                # except those a live sweep may be telling now.
                settled = (datetime.now(timezone.utc)
                           - timedelta(seconds=self.options.stale_after_s))
                driver.reconcile({k: measured[k] for k, t in prior.items()
                                  if t.created_at < settled})
            if self.observer:
                self.observer.backend_started(shape, backend.name, driver.remaining())
            if self.options.strategy is Strategy.GRID:
                self.store.enqueue(key, driver.grid_todo())
            run.groups.append(_Group(shape, backend, key, driver, summary))
        self._maybe_finish(run)

    def _maybe_finish(self, run: _ShapeRun) -> None:
        """Store the shape's winner once every candidate of it is stored (by any sweep),
        then queue its finalists' side-by-side run-off, which picks the final winner. The
        first winner is stored before that, so a sweep stopped during the run-off leaves
        one. A call the sweep tunes in several KV formats waits for all of them and runs
        off the finalists of every format together: the dispatcher picks a call's format
        from its winners' times, which then come from one moment of the device."""
        if (run.result is not None or run.runoff_pending
                or not all(g.done for g in run.groups)):
            return
        if not run.ready:
            run.winner = update_winner(self.store, self.device_id, self.software_id,
                                       run.shape.key, self.sources)
            run.ready = True
        runs = self._call_runs(run)
        if runs is None:
            return  # another format of this call is still being tuned
        trials = [self._trials(r) for r in runs]
        chosen = call_finalists(trials, self.options.runoff)
        if len(chosen) >= 2 and not timed_together(chosen):
            for r in runs:
                r.runoff_pending = True
            self.runoffs.append(_Runoff(runs, chosen))
            return
        for r, ts in zip(runs, trials):
            self._finish(r, r.winner, timed_with(ts, None if r.winner is None
                                                 else r.winner.trial_id))

    def _call_runs(self, run: _ShapeRun) -> list[_ShapeRun] | None:
        """The runs of `run`'s call in each KV format the sweep tunes it in (`run` alone
        when it is the only one, or when run-offs are off), None while any is not ready."""
        if self.options.runoff < 2:
            return [run]
        keys = self.calls[call_of(run.shape)]
        runs = [r for r in self.runs if r.shape.key in keys]
        if len(runs) < len(keys) or not all(r.ready and r.result is None for r in runs):
            return None
        return runs

    def _trials(self, run: _ShapeRun) -> list[TrialRow]:
        return [t for g in run.groups for t in self.store.trials(
            device_id=self.device_id, software_id=self.software_id, shape_key=run.shape.key,
            backend=g.backend.name, source_hash=g.key.source_hash)]

    def _finish(self, run: _ShapeRun, winner: Winner | None, side_by_side: int) -> None:
        run.result = ShapeResult(run.shape, winner, run.summaries, side_by_side)
        if self.observer:
            self.observer.shape_done(run.result)

    def _runoff_done(self, task: _Runoff, outcomes: Sequence[TrialOutcome]) -> None:
        """Store the finalists' side-by-side times and update the winners. A finalist
        that is wrong this time is stored as wrong, so it never wins; when none was timed
        (the worker died), the first times stand."""
        timed = {t.id: o.stats.to_dict() for t, o in zip(task.trials, outcomes)
                 if o.status == "ok" and o.stats is not None}
        where = task.runs[0].shape.key
        try:
            for t, o in zip(task.trials, outcomes):
                if o.status != "ok":
                    log.warning("%s: finalist %s %s was %s when timed again: %s",
                                t.shape_key, t.backend, t.config_key, o.status, o.error)
                if o.status == "wrong":  # not reliably correct: never a winner
                    self.store.mark_wrong(t.id, f"wrong when built again to be timed side "
                                                f"by side: {o.error}", o.max_abs_err,
                                          o.mismatch_frac)
            if timed:
                self.store.record_remeasure(timed)
        except ValueError as exc:  # another sweep changed these trials meanwhile
            log.warning("%s: side-by-side times not stored: %s", where, exc)
            timed = {}
        for run in task.runs:
            winner = update_winner(self.store, self.device_id, self.software_id,
                                   run.shape.key, self.sources)
            run.runoff_pending = False
            self._finish(run, winner, sum(1 for t in task.trials
                                          if t.id in timed and t.shape_key == run.shape.key))

    def _handle(self, done: Done, job: tuple[_Group, dict[str, Any]] | _Runoff | None) -> None:
        """Store a finished job: `job` is the group and config the slot was running, or the
        run-off it was timing."""
        if isinstance(done.job, WarmupJob):
            return
        if isinstance(job, _Runoff):
            self._runoff_done(job, done.result)
            return
        if isinstance(done.job, BandwidthJob):
            if done.result:
                self.store.set_read_bandwidth(self.device_id, done.result)
            return
        assert job is not None, "a trial result from a slot that was not running one"
        g, config = job
        outcome: TrialOutcome = done.result
        if log.isEnabledFor(logging.DEBUG):
            phases = " ".join(f"{k} {v:.2f}" for k, v in (outcome.phases or {}).items())
            log.debug("%s %s on %s: %s (%s s)", g.shape.key, g.backend.name,
                      self.pool.label(done.slot), outcome.status, phases)
        value = outcome.stats.median_us if outcome.stats else None
        with _signals_held():
            self.store.record_trial(g.key, TrialResult(
                shape_json=g.shape.to_json(), kv_format=g.shape.kv_format.value,
                config=config, status=outcome.status,
                stats=outcome.stats.to_dict() if outcome.stats else None,
                max_abs_err=outcome.max_abs_err, mismatch_frac=outcome.mismatch_frac,
                error=outcome.error, worker=self.pool.label(done.slot)))
            g.driver.tell(config, value)
            self.new_trials += 1
            g.running -= 1
            g.summary.new_trials += 1
        if value is not None and (g.summary.best_us is None or value < g.summary.best_us):
            g.summary.best_us = value
        if self.observer:
            self.observer.trial_done(g.shape, g.backend.name, config, outcome,
                                     g.summary.best_us)

    def _heartbeat(self) -> None:
        self.store.heartbeat(self.owner)
        for r in self.runs:
            for g in r.groups:
                if not g.done:
                    g.driver.keep_alive()
        self.next_beat = time.monotonic() + self.options.heartbeat_s


def _pooled_fingerprint(started: Sequence[tuple[str, DeviceFingerprint]]) -> DeviceFingerprint:
    """The one fingerprint of all workers' devices: timings are pooled only across
    identical devices, so mixed GPUs are refused."""
    fingerprints = {fp for _, fp in started}
    if len(fingerprints) > 1:
        seen = ", ".join(f"{d}: {fp.name} ({fp.arch}, {fp.sm_count} SMs, "
                         f"{fp.memory_bytes / 2**30:.0f} GiB)" for d, fp in started)
        raise SweepError(f"the GPUs differ ({seen}); their timings cannot be pooled. Run one "
                         "sweep per GPU model, e.g. --device cuda:0")
    return started[0][1]


def run_sweep(shapes: Sequence[Shape], backends: Sequence[Backend], store: TuningStore,
              options: SweepOptions, observer: SweepObserver | None = None) -> list[ShapeResult]:
    """Tune every shape; trials already stored for the same key are reused, never re-run.

    Raises SweepInterrupted on Ctrl-C/SIGTERM (after a clean stop) and SweepError when no
    worker can run or the devices differ."""
    if not options.devices:
        raise SweepError("no device to sweep on")
    device = torch.device(options.devices[0])
    # Workers import each backend by path, so backends registered at run time reach them.
    paths = {b.name: f"{type(b).__module__}:{type(b).__qualname__}" for b in backends}
    with WorkerPool(options.devices, paths, options.policy, options.seed) as pool:
        sweep: _Sweep | None = None
        stage: CompileStage | None = None
        try:
            pool.launch()  # workers start up (seconds each) while this process goes on
            log.debug("workers launched")
            usable, skipped = available_backends(backends, device)
            if options.compile_ahead:
                gpu_workers = sum(1 for d in options.devices if torch.device(d).type == "cuda")
                stage = CompileStage(shapes, usable, device, options.pins, paths, gpu_workers,
                                     options.candidate_timeout_s)
                stage.start()
            versions = library_versions(device)
            log.debug("backends and library versions checked")
            dev_fp = _pooled_fingerprint(pool.start())
            log.debug("workers ready")
            sweep = _Sweep(shapes, usable, skipped, store, options, observer, pool, dev_fp,
                           current_software(versions))
            sweep.warm_up()
            if stage is not None:
                summary = stage.join()
                stage = None
                if observer and summary.kernels:
                    observer.compile_done(summary)
            log.debug("timing starts")
            return sweep.run()
        except WorkerPoolError as exc:
            raise SweepError(str(exc)) from None
        except KeyboardInterrupt:
            if sweep is None:
                raise SweepInterrupted([], 0, 0) from None
            requeued = sweep.stop()
            raise SweepInterrupted(sweep.results(), sweep.new_trials, requeued) from None
        except BaseException:
            if sweep is not None:
                sweep.stop()
            raise
        finally:
            if stage is not None:
                stage.cancel()
            if sweep is not None:
                sweep.storage.engine.dispose()


__all__ = ["BackendSummary", "ShapeResult", "SweepError", "SweepInterrupted",
           "SweepObserver", "SweepOptions", "resolve_backends",
           "run_sweep"]
