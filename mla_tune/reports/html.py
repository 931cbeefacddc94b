"""The report as one self-contained HTML file, and its charts as PNG files.

Charts are described once (`Chart`) and drawn twice: as inline SVG written here, so the HTML
needs no plotting library to build and nothing from the network to view (a Content Security
Policy forbids every fetch), and as PNG through matplotlib, the optional `report` extra.
PNG needs a real rasterizer with fonts; matplotlib is the standard one, and only `--png`
needs it (checked up front with an install hint), so CI and the H200 image do not.
"""

from __future__ import annotations

import html
import json
import math
import re
import zlib
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from mla_tune.db import DeviceRow, TuningStore
from mla_tune.problem.shapes import Shape
from mla_tune.reports.table import (
    ReportRow,
    baseline_sources,
    best_by_knob,
    config_text,
    latest_source_trials,
    suite_summaries,
    thin_sweeps,
)

FORMAT_COLORS = {"bf16": "#1f77b4", "fp8": "#d62728", "mxfp4": "#2ca02c"}
BACKEND_COLORS = {"triton": "#1f77b4", "flashinfer": "#ff7f0e", "aiter": "#d62728",
                  "torch": "#7f7f7f"}
PALETTE = ("#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
# Knobs charted per shape: split count and block size under the names backends use
# (num_splits, n_splits, num_kv_splits; BLOCK_N, block_size, chunk_size, tile_n, ...).
CHARTED_KNOB = re.compile(r"split|block|chunk|tile", re.IGNORECASE)
PNG_HINT = ("--png needs matplotlib: pip install 'mla-tune[report]' (or pip install "
            "matplotlib); --html needs nothing extra")


class MissingDependencyError(RuntimeError):
    """An optional package a requested output needs is not installed."""


@dataclass(frozen=True)
class Series:
    """Points of one legend entry; x is a category label on categorical charts."""

    name: str
    points: tuple[tuple[float | str, float, str], ...]  # (x, y, tooltip)
    color: str
    line: bool = False
    hollow: bool = False


@dataclass(frozen=True)
class RefLine:
    """A horizontal reference (the device's measured read bandwidth)."""

    y: float
    label: str


@dataclass(frozen=True)
class Chart:
    """One plot, independent of how it is drawn."""

    title: str
    x_label: str
    y_label: str
    series: tuple[Series, ...]
    x_log: bool = False
    y_log: bool = False
    categories: tuple[str, ...] | None = None
    ref_lines: tuple[RefLine, ...] = ()


@dataclass(frozen=True)
class Figure:
    """Charts shown side by side; one PNG file named `slug`.png."""

    slug: str
    charts: tuple[Chart, ...]


# ---------------------------------------------------------------- charts from report rows


def _group_tag(row: ReportRow, multi: bool) -> str:
    return f"-{row.device_hash[:8]}-{row.software_hash[:8]}" if multi else ""


def roofline_figures(rows: Sequence[ReportRow],
                     read_bw: dict[str, float | None]) -> list[Figure]:
    """Per device: achieved bandwidth of each winner (filled) and of its baseline (hollow)
    against the KV bytes the shape must read, per KV format, under the measured ceiling.
    Superseded winners are left out: they time code that no longer runs."""
    rows = [r for r in rows if not r.superseded]
    devices = list(dict.fromkeys(r.device_hash for r in rows))
    figures = []
    for dev in devices:
        drows = [r for r in rows if r.device_hash == dev]
        series = []
        for fmt, color in FORMAT_COLORS.items():
            frows = [r for r in drows if r.shape.kv_format.value == fmt]
            if not frows:
                continue
            series.append(Series(f"{fmt} winner", tuple(
                (r.shape.kv_bytes / 1e6, r.eff_gbps,
                 f"{r.shape.label()}: {r.backend} {r.median_us:.1f} us, {r.eff_gbps:.0f} GB/s")
                for r in frows), color))
            base = [r for r in frows if r.baseline_us]
            if base:
                series.append(Series(f"{fmt} baseline", tuple(
                    (r.shape.kv_bytes / 1e6, r.shape.kv_bytes / (r.baseline_us * 1e-6) / 1e9,
                     f"{r.shape.label()}: {r.baseline_backend} {r.baseline_us:.1f} us")
                    for r in base if r.baseline_us), color, hollow=True))
        bw = read_bw.get(dev)
        refs = (RefLine(bw, f"measured read bandwidth {bw:.0f} GB/s"),) if bw else ()
        note = "" if bw else " (read bandwidth not measured)"
        chart = Chart(f"Roofline: {drows[0].device}{note}", "KV bytes moved (MB)",
                      "achieved bandwidth (GB/s)", tuple(series), x_log=True, y_log=True,
                      ref_lines=refs)
        slug = "roofline" if len(devices) == 1 else f"roofline-{dev[:8]}"
        figures.append(Figure(slug, (chart,)))
    return figures


def backend_color(name: str) -> str:
    """One color per backend across every chart of a report (and across reports)."""
    return BACKEND_COLORS.get(name) or PALETTE[zlib.crc32(name.encode()) % len(PALETTE)]


def _knob_label(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def knob_figure(row: ReportRow, multi: bool = False) -> Figure | None:
    """Time vs split count and vs block size for one shape: per knob, one line per backend,
    each point the fastest ok config with that knob value. None when no such knob varied."""
    trials = latest_source_trials(row.trials)
    knobs = sorted({k for t in trials if t.status == "ok" for k in t.config
                    if CHARTED_KNOB.search(k)}, key=lambda k: ("split" not in k.lower(), k))
    backends = sorted({t.backend for t in trials if t.status == "ok"})
    charts = []
    for knob in knobs:
        curves = {b: best_by_knob(trials, b, knob) for b in backends}
        curves = {b: c for b, c in curves.items() if len(c) >= 2}
        if not curves:
            continue
        values = sorted({_knob_label(v) for c in curves.values() for v, _ in c},
                        key=lambda s: (0, float(s), "") if _is_number(s) else (1, 0.0, s))
        series = tuple(Series(b, tuple((_knob_label(v), us, f"{b} {knob}={v}: {us:.1f} us")
                                       for v, us in c), backend_color(b), line=True)
                       for b, c in curves.items())
        charts.append(Chart(f"{row.shape.label()}: time vs {knob}", knob,
                            "best time (us)", series, y_log=True, categories=tuple(values)))
    if not charts:
        return None
    return Figure(f"knobs-{row.shape.key}{_group_tag(row, multi)}", tuple(charts))


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _multi_group(rows: Sequence[ReportRow]) -> bool:
    return len({(r.device_hash, r.software_hash) for r in rows}) > 1


def figures(rows: Sequence[ReportRow], read_bw: dict[str, float | None]) -> list[Figure]:
    """Every figure of the report: rooflines first, then the per-shape knob charts."""
    multi = _multi_group(rows)
    knob_figs = [knob_figure(r, multi) for r in rows]
    return roofline_figures(rows, read_bw) + [f for f in knob_figs if f is not None]


# ---------------------------------------------------------------------------- SVG drawing

_W, _H = 480, 300
_ML, _MR, _MT, _MB = 64, 16, 28, 44
_LEGEND_ROW = 16


def _fmt(v: float) -> str:
    a = abs(v)
    if a and (a >= 1e6 or a < 1e-3):
        return f"{v:.0e}"
    return f"{v:.4g}"


def _linear_ticks(lo: float, hi: float, target: int = 5) -> list[float]:
    """Evenly spaced round values from the largest one <= lo to the smallest >= hi, so an
    axis drawn over them contains every value between lo and hi."""
    raw = (hi - lo) / target
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [_round(k * step) for k in range(first, last + 1)]


def _round(v: float) -> float:
    return float(f"{v:.12g}")  # 0.30000000000000004 -> 0.3


def _log_ticks(lo: float, hi: float) -> list[float]:
    """Round values from the largest one <= lo to the smallest >= hi on a log axis:
    decades, or denser mantissas (1-2-5, 1-2-3-5, every digit) while they stay few; even
    steps over a range of less than 4x, where a log axis has no decade to show."""
    if hi / lo < 4:
        ticks = _linear_ticks(lo, hi, 4)
        if ticks[0] > 0:
            return ticks
    e0, e1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    for mults in (tuple(range(1, 10)), (1, 2, 3, 5), (1, 2, 5), (1,)):
        vals = [_round(m * 10.0**e) for e in range(e0 - 1, e1 + 1) for m in mults]
        below = max(v for v in vals if v <= lo * (1 + 1e-9))
        above = min(v for v in vals if v >= hi * (1 - 1e-9))
        ticks = [v for v in vals if below <= v <= above]
        if len(ticks) <= 7 or mults == (1,):
            return ticks
    raise AssertionError("unreachable: decades always qualify")


class _Scale:
    """Maps data values to pixels along one axis (numeric, log or linear). Its first and
    last ticks enclose every value, and the axis ends a little beyond them."""

    def __init__(self, values: Iterable[float], log: bool, p0: float, p1: float) -> None:
        vals = [v for v in values if math.isfinite(v) and (v > 0 or not log)]
        lo, hi = (min(vals), max(vals)) if vals else (1.0, 10.0)
        if hi == lo:
            lo, hi = (lo / 1.5, hi * 1.5) if log else (lo - (abs(lo) * 0.1 or 1.0),
                                                         hi + (abs(hi) * 0.1 or 1.0))
        self.log = log
        self.ticks = _log_ticks(lo, hi) if log else _linear_ticks(lo, hi)
        lo, hi = self.ticks[0], self.ticks[-1]
        if log:
            pad = (math.log10(hi) - math.log10(lo)) * 0.04
            lo, hi = lo / 10**pad, hi * 10**pad
        else:
            pad = (hi - lo) * 0.04
            lo, hi = lo - pad, hi + pad
        self.lo, self.hi, self.p0, self.p1 = lo, hi, p0, p1

    def __call__(self, v: float) -> float:
        if self.log:
            f = (math.log10(v) - math.log10(self.lo)) / (math.log10(self.hi) - math.log10(self.lo))
        else:
            f = (v - self.lo) / (self.hi - self.lo)
        return self.p0 + f * (self.p1 - self.p0)


def _esc(text: str) -> str:
    return html.escape(text, quote=True)


def _marker(s: Series) -> str:
    if s.hollow:
        return f'r="6" fill="none" stroke="{s.color}" stroke-width="1.5"'
    return f'r="4" fill="{s.color}" stroke="{s.color}" stroke-width="1"'


def chart_svg(chart: Chart) -> str:
    """The chart as an inline <svg> element (no external references, tooltips as <title>)."""
    per_row = 3
    legend_rows = math.ceil(len(chart.series) / per_row)
    height = _H + legend_rows * _LEGEND_ROW
    x0, x1, y0, y1 = _ML, _W - _MR, _H - _MB, _MT
    ys = [p[1] for s in chart.series for p in s.points] + [r.y for r in chart.ref_lines]
    sy = _Scale(ys, chart.y_log, y0, y1)
    if chart.categories is not None:
        n = len(chart.categories)
        slot = (x1 - x0) / max(n, 1)
        index = {c: i for i, c in enumerate(chart.categories)}

        def px(x: float | str) -> float:
            return x0 + slot * (index[str(x)] + 0.5)

        xticks = [(px(c), c) for c in chart.categories]
    else:
        sx = _Scale([float(p[0]) for s in chart.series for p in s.points], chart.x_log, x0, x1)

        def px(x: float | str) -> float:
            return sx(float(x))

        xticks = [(sx(t), _fmt(t)) for t in sx.ticks]
    out = [f'<svg class="chart" viewBox="0 0 {_W} {height}" width="{_W}" height="{height}" '
           f'role="img" aria-label="{_esc(chart.title)}">',
           f'<rect x="0" y="0" width="{_W}" height="{height}" fill="#fff"/>',
           f'<text x="{_W / 2:.1f}" y="17" text-anchor="middle" class="t">'
           f'{_esc(chart.title)}</text>']
    for xp, label in xticks:
        out.append(f'<line x1="{xp:.1f}" y1="{y0}" x2="{xp:.1f}" y2="{y1}" class="g"/>'
                   f'<text x="{xp:.1f}" y="{y0 + 14}" text-anchor="middle">{_esc(label)}</text>')
    for t in sy.ticks:
        yp = sy(t)
        out.append(f'<line x1="{x0}" y1="{yp:.1f}" x2="{x1}" y2="{yp:.1f}" class="g"/>'
                   f'<text x="{x0 - 5}" y="{yp + 4:.1f}" text-anchor="end">{_fmt(t)}</text>')
    out.append(f'<rect x="{x0}" y="{y1}" width="{x1 - x0}" height="{y0 - y1}" class="frame"/>')
    out.append(f'<text x="{(x0 + x1) / 2:.1f}" y="{y0 + 32}" text-anchor="middle">'
               f'{_esc(chart.x_label)}</text>')
    out.append(f'<text transform="translate(14 {(y0 + y1) / 2:.1f}) rotate(-90)" '
               f'text-anchor="middle">{_esc(chart.y_label)}</text>')
    for ref in chart.ref_lines:
        yp = sy(ref.y)
        # Labelled below the line at the left, where small shapes sit far below the ceiling.
        out.append(f'<line x1="{x0}" y1="{yp:.1f}" x2="{x1}" y2="{yp:.1f}" class="ref"/>'
                   f'<text x="{x0 + 4}" y="{yp + 13:.1f}">{_esc(ref.label)}</text>')
    # Hollow (baseline) markers first and larger, so a winner on the same spot shows inside.
    for s in sorted(chart.series, key=lambda s: not s.hollow):
        pts = [(px(x), sy(y), tip) for x, y, tip in s.points]
        if s.line and len(pts) > 1:
            path = " ".join(f"{x:.1f},{y:.1f}" for x, y, _ in pts)
            out.append(f'<polyline points="{path}" fill="none" stroke="{s.color}" '
                       f'stroke-width="1.5"/>')
        for x, y, tip in pts:
            out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" {_marker(s)}>'
                       f'<title>{_esc(tip)}</title></circle>')
    for i, s in enumerate(chart.series):
        lx = _ML + (i % per_row) * ((_W - _ML) / per_row)
        ly = _H + (i // per_row) * _LEGEND_ROW
        out.append(f'<circle cx="{lx + 6:.1f}" cy="{ly - 4}" {_marker(s)}/>'
                   f'<text x="{lx + 15:.1f}" y="{ly}">{_esc(s.name)}</text>')
    out.append("</svg>")
    return "".join(out)


# ----------------------------------------------------------------------------- PNG drawing


def require_matplotlib() -> None:
    """Fail early, with the install command, when PNG output cannot be made."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingDependencyError(PNG_HINT) from None


def _mpl_axis(ax: Any, which: str, scale: _Scale) -> None:
    """The SVG's domain and ticks on a matplotlib axis, so both drawings agree."""
    from matplotlib.ticker import NullLocator

    if scale.log:
        getattr(ax, f"set_{which}scale")("log")
    getattr(ax, f"set_{which}lim")(scale.lo, scale.hi)
    getattr(ax, f"set_{which}ticks")(scale.ticks, [_fmt(t) for t in scale.ticks])
    getattr(ax, f"{which}axis").set_minor_locator(NullLocator())


def figure_png(fig: Figure, path: Path) -> None:
    """Draw `fig` with matplotlib's Agg renderer (no display or pyplot state needed)."""
    require_matplotlib()
    from matplotlib.figure import Figure as MplFigure

    mfig = MplFigure(figsize=(5.2 * len(fig.charts), 3.8), dpi=150, layout="constrained")
    axes = mfig.subplots(1, len(fig.charts), squeeze=False)[0]
    for ax, chart in zip(axes, fig.charts, strict=True):
        cats = {c: i for i, c in enumerate(chart.categories or ())}
        for s in chart.series:
            xs = [cats[str(x)] if chart.categories is not None else float(x)
                  for x, _, _ in s.points]
            ax.plot(xs, [y for _, y, _ in s.points], linestyle="-" if s.line else "none",
                    marker="o", color=s.color, label=s.name,
                    markerfacecolor="none" if s.hollow else s.color,
                    markersize=9 if s.hollow else 5, zorder=2 if s.hollow else 3)
        for ref in chart.ref_lines:
            ax.axhline(ref.y, linestyle="--", color="#555555", linewidth=1)
            ax.annotate(ref.label, (0.01, ref.y), xycoords=("axes fraction", "data"),
                        xytext=(0, -3), textcoords="offset points", ha="left", va="top",
                        fontsize=7, color="#333333")
        ys = [y for s in chart.series for _, y, _ in s.points] + [r.y for r in chart.ref_lines]
        _mpl_axis(ax, "y", _Scale(ys, chart.y_log, 0, 1))
        if chart.categories is not None:
            ax.set_xticks(range(len(chart.categories)), chart.categories)
            ax.set_xlim(-0.5, len(chart.categories) - 0.5)
        else:
            xs = [float(x) for s in chart.series for x, _, _ in s.points]
            _mpl_axis(ax, "x", _Scale(xs, chart.x_log, 0, 1))
        ax.set_title(chart.title, fontsize=9)
        ax.set_xlabel(chart.x_label)
        ax.set_ylabel(chart.y_label)
        ax.grid(True, which="major", alpha=0.3)
        if chart.series:
            ax.legend(fontsize=7)
    mfig.savefig(path)


def write_pngs(store: TuningStore, rows: Sequence[ReportRow], directory: Path) -> list[Path]:
    """Every figure of the report as `directory/<slug>.png`; returns the files written."""
    require_matplotlib()
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for fig in figures(rows, _read_bw(store.devices())):
        path = directory / f"{fig.slug}.png"
        figure_png(fig, path)
        written.append(path)
    return written


# ---------------------------------------------------------------------------- HTML page

_CSS = """
body{font:14px/1.4 system-ui,-apple-system,Segoe UI,Roboto,sans-serif;margin:24px;color:#222}
h1{font-size:22px}h2{font-size:18px;margin-top:28px}h3{font-size:15px;margin:18px 0 4px}
table{border-collapse:collapse;font-size:12px}td,th{border:1px solid #ddd;padding:3px 6px}
th{background:#f4f4f4;text-align:left}td.n{text-align:right;font-variant-numeric:tabular-nums}
.meta{color:#666}.figs{display:flex;flex-wrap:wrap;gap:12px}.bad{color:#b00}
svg.chart{font:11px system-ui,sans-serif;border:1px solid #eee}
svg .t{font-size:13px;font-weight:600}
svg .g{stroke:#eee}svg .frame{fill:none;stroke:#999}svg .ref{stroke:#555;stroke-dasharray:5 4}
code{font-size:11px}
nav ul{margin:4px 0;padding-left:20px}nav li.shapes{font-size:12px;line-height:1.7}
.scroll{max-width:100%;overflow-x:auto}
td.cfg{min-width:16em;max-width:30em;overflow-wrap:anywhere}
"""
# The page may use its own inline styles and nothing else: no script, image, font or
# stylesheet can be fetched, whoever opens it.
_CSP = "default-src 'none'; style-src 'unsafe-inline'"


def _num(v: float | None, spec: str, suffix: str = "") -> str:
    return "-" if v is None else f"{v:{spec}}{suffix}"


def _table(headers: Sequence[str], body: Iterable[Sequence[str]], numeric: set[int],
           wrapping: Collection[int] = ()) -> str:
    """A table in a container that scrolls sideways when the page is narrower than it;
    `wrapping` columns (configs) wrap inside a bounded width instead of widening it."""
    head = "".join(f"<th>{_esc(h)}</th>" for h in headers)
    rows = []
    for cells in body:
        tds = "".join(f'<td class="n">{c}</td>' if i in numeric else
                      f'<td class="cfg">{c}</td>' if i in wrapping else f"<td>{c}</td>"
                      for i, c in enumerate(cells))
        rows.append(f"<tr>{tds}</tr>")
    return f'<div class="scroll"><table><tr>{head}</tr>{"".join(rows)}</table></div>'


def _read_bw(devices: Iterable[DeviceRow]) -> dict[str, float | None]:
    """Measured read bandwidth (GB/s) per device hash: the roofline's ceiling."""
    return {d.hash: d.read_bw_gbps for d in devices}


def _spread_text(row: ReportRow) -> str:
    return ", ".join(f"{k} {v:.2f}x" for k, v in row.knob_spread.items()) or "-"


def _pct_cell(r: ReportRow) -> str:
    """% of the read ceiling, unclamped; above 100 % flagged (the ceiling is too low)."""
    if r.pct_of_read_bw is None:
        return "-"
    if r.above_ceiling:
        return (f'<span class="bad" title="above the stored read ceiling: it was measured '
                f'too low">{r.pct_of_read_bw:.1f}% !</span>')
    return f"{r.pct_of_read_bw:.1f}%"


def _winner_table(rows: Sequence[ReportRow], multi: bool) -> str:
    headers = ["device", *(["stack"] if multi else []), "shape", "winner", "config",
               "median µs", "±95% CI µs", "GB/s", "% read bw", "baseline", "vs baseline",
               "vs torch", "trials ok/wrong/failed/timeout", "knob spread (slowest/fastest)"]
    off = 1 if multi else 0
    body = []
    for r in rows:
        c = r.counts
        base = f"{_esc(r.baseline_backend or '')} {r.baseline_us:.1f}" if r.baseline_us else "-"
        body.append([
            _esc(r.device), *([f"<code>{r.software_hash[:8]}</code>"] if multi else []),
            _esc(r.shape.label()), _esc(r.winner_label),
            f"<code>{_esc(config_text(r.config))}</code>",
            f"{r.median_us:.1f}", _num(r.ci95_us, ".2f"), f"{r.eff_gbps:.0f}",
            _pct_cell(r), base, _num(r.speedup_vs_baseline, ".2f", "x"),
            _num(r.speedup_vs_torch, ".2f", "x"),
            f"{c.get('ok', 0)}/{c.get('wrong', 0)}/{c.get('failed', 0)}/{c.get('timeout', 0)}",
            _esc(_spread_text(r))])
    return _table(headers, body, {i + off for i in (4, 5, 6, 7, 9, 10)}, {off + 3})


def _summary_table(rows: Sequence[ReportRow], suite: Sequence[Shape] | None) -> str:
    def over(v: float | None, n: int, of: int) -> str:
        return "-" if v is None else f"{v:.2f}x ({n} of {of})"

    body = [[_esc(s.device), f"<code>{s.software_hash[:8]}</code>", _esc(s.kv_format),
             str(s.shapes), "-" if s.missing is None else str(s.missing),
             _num(s.geomean_us, ".2f"), over(s.speedup_vs_baseline, s.with_baseline, s.shapes),
             over(s.speedup_vs_torch, s.with_torch, s.shapes), str(s.superseded)]
            for s in suite_summaries(rows, suite)]
    return _table(["device", "stack", "kv format", "shapes", "missing from suite",
                   "geomean µs", "geomean vs baseline (shapes with one)",
                   "geomean vs torch (shapes with one)", "superseded (left out)"], body,
                  {3, 4, 5, 6, 7, 8})


def _contents(rows: Sequence[ReportRow], anchors: dict[int, str], multi: bool) -> str:
    """Links to every section, and to each shape's knob charts (the long part)."""
    shapes = " · ".join(
        f'<a href="#{_esc(anchors[id(r)])}">{_esc(r.shape.label())}'
        f"{' ' + r.software_hash[:8] if multi else ''}</a>" for r in rows)
    return ('<nav><h2 id="contents">Contents</h2><ul>'
            '<li><a href="#devices">Devices and software</a></li>'
            '<li><a href="#geomeans">Geometric means</a></li>'
            '<li><a href="#roofline">Roofline</a></li>'
            '<li><a href="#winners">Winners</a></li>'
            f'<li><a href="#knobs">Knobs per shape</a><ul><li class="shapes">{shapes}</li>'
            "</ul></li></ul></nav>")


def _baseline_note(rows: Sequence[ReportRow]) -> str:
    """Which baselines each stack has: a baseline is timed in the winner's own stack."""
    items = []
    for (device, sw), counts in baseline_sources(rows).items():
        current = sum(1 for r in rows if not r.superseded
                      and (r.device, r.software_hash) == (device, sw))
        have = ", ".join(f"{_esc(b)} at {n}" for b, n in counts.most_common()) or "none"
        items.append(f"<li>stack <code>{sw[:8]}</code> on {_esc(device)}: {have} of "
                     f"{current} current winners</li>")
    return ("<p>Baselines (the fastest library kernel timed, else torch) are always of the "
            "winner's own device and stack; a geomean vs baseline counts only the shapes "
            f"that have one.</p><ul>{''.join(items)}</ul>")


def _ceiling_note(rows: Sequence[ReportRow]) -> str:
    high = [r for r in rows if r.above_ceiling]
    if not high:
        return ""
    return (f'<p class="bad">{len(high)} winner(s) read faster than their device\'s stored '
            "read ceiling, shown unclamped and marked !: that ceiling was measured too low "
            "(<code>bench/read_ceiling.py</code> measures it as sweeps now do).</p>")


def _thin_note(rows: Sequence[ReportRow]) -> str:
    """The shapes a kernel family was barely swept at (thin_sweeps), as the table's notes."""
    lines = thin_sweeps(rows)
    if not lines:
        return ""
    return "<ul>" + "".join(f'<li class="bad">{_esc(line)}</li>' for line in lines) + "</ul>"


def render_html(store: TuningStore, rows: Sequence[ReportRow],
                suite: Sequence[Shape] | None = None, suite_name: str | None = None) -> str:
    """The whole report as one HTML document: summary, roofline, winners table, and the
    knob charts of every shape, all inline."""
    devices = store.devices()
    read_bw = _read_bw(devices)
    multi = _multi_group(rows)
    stacks = {w.software.hash: w.software for w in store.winners()}
    used_devices = {r.device_hash for r in rows}
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    scope = f"suite {_esc(suite_name)}, " if suite_name else ""
    parts = [
        "<!doctype html>", '<html lang="en"><head><meta charset="utf-8">',
        f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        "<title>mla-tune report</title>", f"<style>{_CSS}</style></head><body>",
        "<h1>mla-tune report</h1>",
        f'<p class="meta">{scope}{len(rows)} tuned shapes from <code>{_esc(store.url)}</code>, '
        f"generated {now}. Times are medians of cold-L2 runs; the CI is the 95% interval "
        "of the mean; effective bandwidth counts the KV bytes each shape must read.</p>",
    ]
    if not rows:
        parts.append("<p>No winners stored yet: run <code>mla-tune sweep</code> first.</p>")
        parts.append("</body></html>")
        return "\n".join(parts)
    dev_rows = [[_esc(d.fingerprint.name), f"<code>{d.hash}</code>", _esc(d.fingerprint.arch),
                 _num(d.read_bw_gbps, ".0f") if d.read_bw_gbps else "not measured"]
                for d in devices if d.hash in used_devices]
    stack_rows = [[f"<code>{h}</code>",
                   _esc(", ".join(f"{k} {v}" for k, v in stacks[h].versions))]
                  for h in dict.fromkeys(r.software_hash for r in rows) if h in stacks]
    anchors = {id(r): f"k-{r.shape.key}{_group_tag(r, True)}" for r in rows}
    parts += [_contents(rows, anchors, multi),
              '<h2 id="devices">Devices and software</h2>',
              _table(["device", "hash", "arch", "measured read GB/s"], dev_rows, {3}),
              "<p>The read ceiling is the fastest of several read-only kernels streaming "
              "4 GiB (<code>mla_tune.machine.bandwidth</code>), measured once per device by the "
              "first sweep; every % of read bandwidth here is against it.</p>",
              _table(["stack", "versions"], stack_rows, set()),
              '<h2 id="geomeans">Geometric means</h2>', _summary_table(rows, suite),
              _baseline_note(rows),
              '<h2 id="roofline">Roofline</h2>', '<div class="figs">']
    parts += [chart_svg(c) for f in roofline_figures(rows, read_bw) for c in f.charts]
    parts += ["</div>", '<h2 id="winners">Winners</h2>', _ceiling_note(rows), _thin_note(rows),
              _winner_table(rows, multi),
              '<h2 id="knobs">Knobs per shape</h2>',
              "<p>Each point is the fastest correct config with that knob value (every other "
              "knob at its best), per backend, for the latest sources of each backend.</p>"]
    for r in rows:
        fig = knob_figure(r, multi)
        stack = f" · stack {r.software_hash[:8]}" if multi else ""
        parts.append(f'<h3 id="{_esc(anchors[id(r)])}">{_esc(r.shape.label())} · '
                     f"{_esc(r.device)}{stack}</h3>"
                     f"<p>knob spread: {_esc(_spread_text(r))}</p>")
        if fig is not None:
            parts.append('<div class="figs">' + "".join(chart_svg(c) for c in fig.charts)
                         + "</div>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(store: TuningStore, rows: Sequence[ReportRow], path: Path,
               suite: Sequence[Shape] | None = None, suite_name: str | None = None) -> None:
    """Write `render_html` to `path`, creating its directory."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_html(store, rows, suite, suite_name), encoding="utf-8")
