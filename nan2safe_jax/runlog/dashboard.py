"""The one-picture dashboard: loss, risk score and gear timeline on one step axis."""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from nan2safe_jax.runlog.summary import GEAR_NAMES, _fmt, _incident_label, _load, _Run, _summarize
from nan2safe_jax.site import layer_name

DASHBOARD_FILE = "dashboard.png"
MAX_POINTS = 5000  # per plotted series; above this the series is decimated (extremes kept)

# Event type -> (colour, line width, legend label) of its vertical line on the dashboard.
_EVENT_STYLE = {
    "downshift": ("tab:orange", 1.2, "downshift"),
    "locate": ("tab:red", 1.6, "incident located"),
    "recover": ("tab:green", 1.2, "recover"),
    "checkpoint": ("0.7", 0.5, "checkpoint"),
    "resume": ("tab:blue", 1.4, "resume"),
    "transient": ("tab:purple", 1.0, "transient (not reproducible)"),
    "polluted_input": ("tab:brown", 1.2, "polluted input"),
    "error": ("black", 1.2, "error"),
    "damaged": ("tab:pink", 1.4, "damaged state"),
    "spike": ("tab:olive", 1.4, "loss spike"),
    "rollback": ("tab:cyan", 1.6, "rollback"),
}
_MAX_EVENT_LINES = {"checkpoint": 60}  # per type (default 400); more are thinned evenly
_MAX_SITE_ROWS = 12


def _max_gear(g: Any) -> int:
    """The highest gear in a ``site_gears`` value: an int or (nested) list of ints."""
    if isinstance(g, list):
        if not g:
            return 0
        if isinstance(g[0], list):
            return max(_max_gear(v) for v in g)
        try:
            m = max(g)
        except TypeError:  # mixed contents
            return max(_max_gear(v) for v in g)
        return _max_gear(m)
    if isinstance(g, (int, float)) and not isinstance(g, bool):
        return int(g) if math.isfinite(g) else 0
    return 0


def _site_rows(run: _Run) -> dict[str, list[tuple[float, float]]]:
    """Per site that entered SAFE: the ``(start, width)`` step intervals it spent in SAFE.

    Metrics are the source (``safe_sites``; ``site_gears`` when a record has no ``safe_sites``);
    sites known only from ``safe_enter`` / ``safe_exit`` events get intervals from those.
    """
    rows: dict[str, list[tuple[float, float]]] = {}
    steps = run.step
    open_: dict[str, int] = {}
    for i, rec in enumerate(run.records):
        in_safe = set()
        for s in rec.get("safe_sites") or ():
            in_safe.add(str(s))
        if "safe_sites" not in rec:  # the trainer's own list wins; else derive it
            for s, g in (rec.get("site_gears") or {}).items():
                if _max_gear(g) >= 2:
                    in_safe.add(str(s))
        for s in in_safe:
            open_.setdefault(s, i)
        for s in [s for s in open_ if s not in in_safe]:
            a = open_.pop(s)
            rows.setdefault(s, []).append((float(steps[a]), float(steps[i] - steps[a])))
    for s, a in open_.items():
        rows.setdefault(s, []).append((float(steps[a]), float(steps[-1] - steps[a] + 1)))

    last = float(steps[-1]) + 1 if len(steps) else None
    from_events: dict[str, list[tuple[float, float]]] = {}
    entered: dict[str, dict[str, Any]] = {}
    for ev in sorted(run.events, key=lambda e: e["step"]):
        site = ev.get("site")
        if site is None:
            continue
        site = str(site)
        if ev.get("type") == "safe_enter":
            entered[layer_name(site, ev.get("layer"))] = ev
        elif ev.get("type") == "safe_exit":  # an exit names the site: every layer of it leaves
            for name in [n for n, e in entered.items() if str(e["site"]) == site]:
                a = float(entered.pop(name)["step"])
                from_events.setdefault(name, []).append((a, max(float(ev["step"]) - a, 1.0)))
    for site, ev in entered.items():
        a = float(ev["step"])
        end = a + float(ev["steps"]) if isinstance(ev.get("steps"), (int, float)) else last
        end = a + 1.0 if end is None else end
        from_events.setdefault(site, []).append((a, max(end - a, 1.0)))
    for site, iv in from_events.items():
        rows.setdefault(site, iv)
    return rows


def _decimate(y: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices of ``y`` to plot: all when short, else each bucket's min and max (spikes kept)."""
    n = len(y)
    if n <= max_points:
        return np.arange(n)
    edges = np.linspace(0, n, max_points // 2 + 1).astype(np.int64)
    keep = [0, n - 1]
    yf = np.where(np.isfinite(y), y, np.nan)
    for a, b in zip(edges[:-1], edges[1:], strict=True):
        seg = yf[a:b]
        ok = ~np.isnan(seg)
        if not ok.any():
            keep.append(a)
            continue
        idx = np.flatnonzero(ok)
        keep.append(a + idx[np.argmin(seg[ok])])
        keep.append(a + idx[np.argmax(seg[ok])])
    return np.unique(np.asarray(keep, np.int64))


def _decimate_steps(g: np.ndarray, max_points: int = MAX_POINTS) -> np.ndarray:
    """Indices of a step signal to plot: every change point, plus an even stride."""
    n = len(g)
    if n <= max_points:
        return np.arange(n)
    change = np.flatnonzero(np.diff(g) != 0) + 1
    stride = np.linspace(0, n - 1, max_points // 2).astype(np.int64)
    return np.unique(np.concatenate([[0, n - 1], change, change - 1, stride]))


def _plural(n: int, one: str, many: str | None = None) -> str:
    return f"{n} {one if n == 1 else (many or one + 's')}"


def _summary_line(s: Mapping[str, Any]) -> str:
    parts = [_plural(s["steps"], "step")]
    if s["final_loss"] is not None:
        parts.append(f"final loss {_fmt(s['final_loss'])}")
    parts.append(f"{s['skipped']} skipped")
    parts.append(_plural(s["downshifts"], "downshift"))
    parts.append(_plural(s["incidents_located"], "incident") + " located")
    parts.append(_plural(s["safe_entries"], "SAFE entry", "SAFE entries"))
    parts.append(_plural(s["recoveries"], "recovery", "recoveries"))
    if s["seconds_per_step"] is not None:
        parts.append(f"{s['seconds_per_step'] * 1e3:.1f} ms/step")
    return " · ".join(parts)


def _event_steps(events: Iterable[Mapping[str, Any]], type_: str) -> np.ndarray:
    x = np.asarray([float(e["step"]) for e in events if e.get("type") == type_], np.float64)
    most = _MAX_EVENT_LINES.get(type_, 400)
    if len(x) > most:
        x = x[np.linspace(0, len(x) - 1, most).astype(np.int64)]
    return x


def _plain_log_formatter(**kwargs):
    """A ``LogFormatter`` that keeps matplotlib's choice of labelled ticks, printed with ``%g``."""
    from matplotlib.ticker import LogFormatter

    class PlainLogFormatter(LogFormatter):
        def __call__(self, x, pos=None):
            return f"{x:g}" if super().__call__(x, pos) else ""

    return PlainLogFormatter(**kwargs)


def _loss_panel(ax, run: _Run, step: np.ndarray) -> None:
    """Loss over steps (log scale when every finite loss is positive); non-finite losses as red
    crosses at the top, skipped updates as ticks at the bottom."""
    n = len(step)
    finite = np.isfinite(run.loss)
    positive = bool(finite.any() and (run.loss[finite] > 0).all())
    if n:
        idx = _decimate(run.loss)
        y = np.where(finite, run.loss, np.nan)[idx]
        ax.plot(step[idx], y, color="tab:blue", lw=1.0, marker="." if n == 1 else None)
        if positive:
            ax.set_yscale("log")
            # plain numbers ("0.6", "3") instead of 6e-01 / 3x10^0 on a 1-2 decade loss range
            ax.yaxis.set_major_formatter(_plain_log_formatter())
            ax.yaxis.set_minor_formatter(
                _plain_log_formatter(labelOnlyBase=False, minor_thresholds=(2, 0.5))
            )
        bad = step[~finite]
        if len(bad):
            ax.plot(
                bad,
                np.full(len(bad), 0.96),
                "x",
                color="red",
                ms=7,
                mew=1.8,
                transform=ax.get_xaxis_transform(),
                clip_on=False,
                label="non-finite loss",
                zorder=5,
            )
        skipped_ok = step[run.skipped & finite]
        if len(skipped_ok):
            ax.plot(
                skipped_ok,
                np.full(len(skipped_ok), 0.03),
                "|",
                color="0.35",
                ms=8,
                transform=ax.get_xaxis_transform(),
                label="skipped update",
                zorder=4,
            )
    else:
        ax.text(0.5, 0.5, "no metrics logged", ha="center", va="center", transform=ax.transAxes)
    ax.set_ylabel("loss" + (" (log)" if positive else ""))


def _risk_panel(ax, run: _Run, step: np.ndarray) -> None:
    """The tier-1 risk score with the trigger line at 1.0."""
    n = len(step)
    if n:
        idx = _decimate(run.risk)
        ax.plot(step[idx], run.risk[idx], color="tab:purple", lw=1.0, drawstyle="steps-post")
        if n == 1:
            ax.plot(step, run.risk, ".", color="tab:purple")
    ax.axhline(1.0, color="red", ls="--", lw=0.9)
    ax.text(
        0.002, 1.0, " trigger", color="red", fontsize=8, va="bottom",
        transform=ax.get_yaxis_transform(),
    )  # fmt: skip
    ax.set_ylim(-0.05, 1.15)
    ax.set_yticks([0.0, 0.5, 1.0])
    ax.set_ylabel("risk")


def _gear_panel(
    ax,
    run: _Run,
    step: np.ndarray,
    sites: dict[str, list[tuple[float, float]]],
    site_names: list[str],
    hidden_sites: int,
) -> None:
    """Gear timeline: the global gear at y = 0..2, one row per site in SAFE below it."""
    if len(step):
        idx = _decimate_steps(run.gear)
        xs, gs = step[idx], run.gear[idx].astype(np.float64)
        xs, gs = np.append(xs, xs[-1] + 1), np.append(gs, gs[-1])  # step s spans [s, s + 1)
        ax.fill_between(xs, 0, gs, step="post", color="tab:orange", alpha=0.15, lw=0)
        ax.step(xs, gs, where="post", color="tab:orange", lw=1.6, label="global gear")
    yticks, ylabels = [0, 1, 2], list(GEAR_NAMES)
    for j, site in enumerate(site_names):
        y = -1.0 - j
        ax.broken_barh(sites[site], (y - 0.35, 0.7), facecolors="tab:red", alpha=0.8)
        # a marker at each entry, so a stay of a few steps in a long run still shows
        starts = [a for a, _ in sites[site]]
        ax.plot(starts, [y] * len(starts), "|", color="tab:red", ms=12, mew=2.0)
        yticks.append(y)
        ylabels.append(site)
    if hidden_sites:
        ylabels[-1] += f" (+{hidden_sites} more)"
    if site_names:
        ax.axhline(-0.5, color="0.5", lw=0.6)
        ax.text(
            0.002, -0.5, " sites in SAFE", fontsize=8, color="0.3", va="top",
            transform=ax.get_yaxis_transform(),
        )  # fmt: skip
    ax.set_yticks(yticks, ylabels, fontsize=8)
    ax.set_ylim(-0.6 - len(site_names), 2.5)
    ax.set_ylabel("gear")
    ax.set_xlabel("step")


def _event_lines(axes, events: list[dict[str, Any]]) -> list:
    """Events as vertical lines across ``axes``; returns one legend handle per event type."""
    from matplotlib.lines import Line2D

    handles = []
    for type_, (color, lw, label) in _EVENT_STYLE.items():
        x = _event_steps(events, type_)
        if not len(x):
            continue
        for ax in axes:
            ax.vlines(x, 0, 1, transform=ax.get_xaxis_transform(), colors=color, lw=lw, alpha=0.75)
        handles.append(Line2D([], [], color=color, lw=max(lw, 1.0), label=label))
    return handles


def _incident_labels(ax, events: list[dict[str, Any]]) -> None:
    """The culprit ``site: primitive (diagnosis)`` written beside each ``locate`` line."""
    for e in events:
        if e.get("type") != "locate":
            continue
        ax.annotate(
            _incident_label(e),
            xy=(float(e["step"]), 0.9),
            xycoords=ax.get_xaxis_transform(),
            xytext=(-3, 0),
            textcoords="offset points",
            rotation=90,
            ha="right",
            va="top",
            fontsize=8,
            color="darkred",
            bbox={"boxstyle": "round,pad=0.15", "fc": "white", "ec": "none", "alpha": 0.75},
            zorder=6,
        )


def _step_limits(ax, step: np.ndarray, events: list[dict[str, Any]]) -> None:
    """The shared x range: every logged step and every event, padded by 1%."""
    from matplotlib.ticker import MaxNLocator

    if len(step):
        lo, hi = float(step[0]), float(step[-1]) + 1
    else:
        ev = [float(e["step"]) for e in events]
        lo, hi = (min(ev), max(ev) + 1) if ev else (0.0, 1.0)
    ev_steps = [float(e["step"]) for e in events]
    if ev_steps:
        lo, hi = min(lo, min(ev_steps)), max(hi, max(ev_steps) + 1)
    pad = max((hi - lo) * 0.01, 0.5)
    ax.set_xlim(lo - pad, hi + pad)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _figure(workdir: str | os.PathLike):
    """The dashboard as a ``matplotlib.figure.Figure`` (not saved; no pyplot, no display).

    Three panels on one shared step axis: loss, risk score, gear timeline (global gear plus one
    row per site that entered SAFE). Events are vertical lines across all panels.
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    run = _load(workdir)
    s = _summarize(run)
    sites = _site_rows(run)
    site_names = sorted(sites, key=lambda k: (min(a for a, _ in sites[k]), k))
    hidden_sites = max(len(site_names) - _MAX_SITE_ROWS, 0)
    site_names = site_names[:_MAX_SITE_ROWS]

    gear_h = 1.6 + 0.28 * len(site_names)
    fig = Figure(figsize=(13.5, 7.0 + 0.28 * len(site_names)), layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_risk, ax_gear = fig.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [3.0, 1.6, gear_h]}
    )
    title = f"nan2safe — {run.workdir.resolve().name or run.workdir}"
    fig.suptitle(f"{title}\n{_summary_line(s)}", fontsize=11)

    step = run.step.astype(np.float64)
    _loss_panel(ax_loss, run, step)
    _risk_panel(ax_risk, run, step)
    _gear_panel(ax_gear, run, step, sites, site_names, hidden_sites)
    handles = _event_lines((ax_loss, ax_risk, ax_gear), run.events)
    _incident_labels(ax_loss, run.events)
    _step_limits(ax_gear, step, run.events)

    own, own_labels = ax_loss.get_legend_handles_labels()
    if own or handles:
        fig.legend(
            own + handles,
            own_labels + [h.get_label() for h in handles],
            loc="outside right upper",
            fontsize=8,
            frameon=False,
        )
    for ax in (ax_loss, ax_risk, ax_gear):
        ax.grid(True, axis="y", alpha=0.25)
    return fig


def dashboard(workdir: str | os.PathLike, path: str | os.PathLike | None = None) -> Path:
    """Draws the run's dashboard to ``path`` (default ``workdir/dashboard.png``).

    Three panels on a shared step axis: (1) loss, log scale when every finite loss is positive,
    non-finite losses as red crosses at the top; (2) the tier-1 risk score with the trigger line
    at 1.0; (3) the global gear (FAST / STABLE / SAFE) and one row per site that entered SAFE.
    Events are vertical lines across all panels (downshift orange, locate red with the culprit
    ``site: primitive (diagnosis)``, recover green, checkpoint grey, resume blue). Series longer
    than 5000 points are decimated keeping each bucket's extremes and every gear change.

    Raises:
      FileNotFoundError: when ``workdir`` does not exist.
    """
    wd = Path(workdir)
    if not wd.is_dir():
        raise FileNotFoundError(
            f"run directory {str(wd)!r} does not exist; pass the Trainer's workdir"
        )
    out = Path(path) if path is not None else wd / DASHBOARD_FILE
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = _figure(wd)
    fig.savefig(out, dpi=110)
    return out
