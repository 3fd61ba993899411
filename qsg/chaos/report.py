"""The chaos run's report: summary (JSON and a terminal table), fault timeline, recovery times, throughput over
time with the faults marked (an SVG written here: no plotting dependency), and the checker's findings.

A report directory holds: history.jsonl, summary.json, findings.json (every finding with its message ids),
faults.json (the timeline), throughput.svg and report.md (all of it, readable). A soak writes soak.json and
soak.md beside the per-seed directories.
"""

from __future__ import annotations

import html
import json
import platform
import statistics
from collections import Counter
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from rich import box
from rich.table import Table

from qsg.chaos.checker import FINDING_KINDS, MUST_BE_ZERO, CheckResult
from qsg.chaos.options import ChaosOptions

BUCKET_S = 1.0
TIMING_KEYS = ("peer_recovery_s", "fenced_exit_s", "restart_s", "restore_s", "serve_again_s", "service_s")


def commit_times(events: list[dict[str, Any]]) -> list[float]:
    """Completion times of committed work: commits, out-of-syncpoint puts and resolves that returned ok."""
    invoked = {e["id"]: e for e in events if e.get("type") == "invoke"}
    out = []
    for e in events:
        if e.get("type") != "ok":
            continue
        inv = invoked.get(e["id"])
        if inv is None:
            continue
        if inv["op"] in ("commit", "resolve") or (inv["op"] == "put" and not inv.get("syncpoint", True)):
            out.append(float(e["t"]))
    return sorted(out)


def workload_span(events: list[dict[str, Any]]) -> tuple[float, float]:
    start = next((e["t"] for e in events if e.get("what") == "workload start"), 0.0)
    stop = next((e["t"] for e in events if e.get("what") == "workload stop"), None)
    if stop is None:
        stop = max((e.get("t", 0.0) for e in events), default=0.0)
    return float(start), float(stop)


def _rate(times: list[float], a: float, b: float) -> float:
    return sum(1 for t in times if a <= t < b) / (b - a) if b > a else 0.0


def throughput(events: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """Committed work per second: overall, outside every fault window (the fault-free rate of this run) and
    within each fault's window (injection to full service)."""
    times = commit_times(events)
    start, stop = workload_span(events)
    windows = [(f["started"], f["recovered"] if f["recovered"] is not None else stop) for f in faults]
    calm_time = stop - start - sum(max(0.0, min(b, stop) - max(a, start)) for a, b in windows)
    calm_count = sum(1 for t in times if start <= t < stop and not any(a <= t < b for a, b in windows))
    per_fault = [{"fault": f["fault"], "kind": f["kind"], "rate": round(_rate(times, a, b), 1),
                  "window_s": round(b - a, 2)} for f, (a, b) in zip(faults, windows)]
    return {"overall": round(_rate(times, start, stop), 1),
            "fault_free": round(calm_count / calm_time, 1) if calm_time > 1 else None,
            "per_fault": per_fault}


def summarize(opts: ChaosOptions, events: list[dict[str, Any]], result: CheckResult, faults: list[dict[str, Any]],
              phases: dict[str, float], extra: dict[str, Any], *, disk_unavailable: str = "") -> dict[str, Any]:
    findings = result.summary()
    recovery: dict[str, list[float]] = {k: [] for k in TIMING_KEYS}
    for f in faults:
        for k in TIMING_KEYS:
            v = f["service_s"] if k == "service_s" else f["timings"].get(k)
            if isinstance(v, int | float):
                recovery[k].append(float(v))
    return {
        "seed": opts.seed, "duration": opts.duration, "kinds": list(opts.kinds), "clients": opts.clients,
        "managers": opts.managers, "lease_ms": opts.lease_ms, "report_dir": str(opts.report_dir),
        "operations": result.counts.get("operations", 0),
        "committed_uows": result.counts.get("committed units of work", 0),
        "messages_put": result.counts.get("messages put", 0),
        "throughput": throughput(events, faults),
        "faults": faults,
        "fault_errors": [f"{f['fault']} {f['kind']}: {f['error']}" for f in faults if f["error"]],
        "unavailable": sorted({f"{f['kind']}: {f['unavailable']}" for f in faults if f["unavailable"]}
                              | ({f"disk-full: {disk_unavailable}"} if disk_unavailable else set())),
        "recovery": {k: v for k, v in recovery.items() if v},
        "findings": findings,
        "ok": not any(findings[k] for k in FINDING_KINDS),
        "counts": result.counts,
        "phases": phases,
        "extra": extra,
        "finding_details": [f.to_json() for f in result.findings[:200]],
    }


# --- files -------------------------------------------------------------------------------------------------------
def write_report(rdir: Path, summary: dict[str, Any], result: CheckResult, events: list[dict[str, Any]]) -> None:
    rdir.mkdir(parents=True, exist_ok=True)
    (rdir / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    (rdir / "findings.json").write_text(json.dumps([f.to_json() for f in result.findings], indent=2) + "\n")
    timeline = [e for e in events if e.get("type") in ("fault", "note")]
    (rdir / "faults.json").write_text(json.dumps(timeline, indent=2) + "\n")
    (rdir / "throughput.svg").write_text(throughput_svg(events, summary["faults"], f"seed {summary['seed']}"))
    (rdir / "report.md").write_text(markdown(summary, timeline))


def throughput_svg(events: list[dict[str, Any]], faults: list[dict[str, Any]], title: str) -> str:
    """Committed work per second over the run, fault windows shaded and labelled."""
    times = commit_times(events)
    start, stop = workload_span(events)
    end = max([stop, *times]) if times else stop
    n = max(1, int((end - start) / BUCKET_S) + 1)
    buckets = [0] * n
    for t in times:
        i = int((t - start) / BUCKET_S)
        if 0 <= i < n:
            buckets[i] += 1
    w, h, left, bottom, top = 960, 320, 60, 40, 30
    ymax = max(max(buckets) / BUCKET_S, 1.0) * 1.1
    span = max(end - start, 1.0)

    def x(t: float) -> float:
        return left + (t - start) / span * (w - left - 20)

    def y(v: float) -> float:
        return h - bottom - v / ymax * (h - bottom - top)

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="11">', f'<rect width="{w}" height="{h}" fill="white"/>',
             f'<text x="{left}" y="18" font-size="13">{html.escape(title)}: committed work per second '
             f'(shaded: fault, injection to full service)</text>']
    for f in faults:
        a = f["started"]
        b = f["recovered"] if f["recovered"] is not None else stop
        color = "#f4c7c3" if f["error"] else "#fde9b8"
        parts.append(f'<rect x="{x(a):.1f}" y="{top}" width="{max(1.0, x(b) - x(a)):.1f}" '
                     f'height="{h - bottom - top}" fill="{color}"/>')
        parts.append(f'<text x="{x(a) + 2:.1f}" y="{top + 12}" fill="#7a4b00">{f["fault"]}: '
                     f'{html.escape(f["kind"])}</text>')
    for i in range(5):
        v = ymax * i / 4
        parts.append(f'<line x1="{left}" x2="{w - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="#ddd"/>')
        parts.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.0f}</text>')
    for s in range(0, int(span) + 1, max(1, int(span) // 10)):
        parts.append(f'<text x="{x(start + s):.1f}" y="{h - bottom + 16}" text-anchor="middle">{s}s</text>')
    pts = " ".join(f"{x(start + (i + 0.5) * BUCKET_S):.1f},{y(c / BUCKET_S):.1f}" for i, c in enumerate(buckets))
    parts.append(f'<polyline points="{pts}" fill="none" stroke="#1f5fa8" stroke-width="1.5"/>')
    parts.append(f'<line x1="{left}" x2="{left}" y1="{top}" y2="{h - bottom}" stroke="black"/>')
    parts.append(f'<line x1="{left}" x2="{w - 20}" y1="{h - bottom}" y2="{h - bottom}" stroke="black"/>')
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def markdown(summary: dict[str, Any], timeline: list[dict[str, Any]]) -> str:
    s = summary
    out = [f"# Chaos run: seed {s['seed']}", "",
           f"{s['duration']:g} s of workload, {s['clients']} clients, {s['managers']} SQMs, lease {s['lease_ms']} ms; "
           f"fault kinds: {', '.join(s['kinds']) or 'none'}.", "",
           "![throughput](throughput.svg)", "", "## Summary", "", "| what | value |", "|---|---|"]
    for k, v in summary_rows(s):
        out.append(f"| {k} | {v} |")
    out += ["", "## Faults", "", "| # | kind | target | at (s) | to full service (s) | serving again after the heal "
            "(s; bound) | timings | error |", "|---|---|---|---|---|---|---|---|"]
    for f in s["faults"]:
        timings = ", ".join(f"{k}={v}" for k, v in f["timings"].items())
        serving = ", ".join(f"{m} {v}" for m, v in (f.get("serving") or {}).items())
        out.append(f"| {f['fault']} | {f['kind']} | {f['target']} | {f['started']} | {f['service_s']} | "
                   f"{serving}; {f.get('serve_bound_s')} | {timings} | {f['error'] or f['unavailable']} |")
    out += ["", "## Timeline", "", "| t (s) | event |", "|---|---|"]
    for e in timeline:
        detail = {k: v for k, v in e.items() if k not in ("type", "t")}
        out.append(f"| {e['t']} | {html.escape(json.dumps(detail))[:300]} |")
    out += ["", "## Findings", ""]
    if not s["finding_details"]:
        out.append("None.")
    for f in s["finding_details"]:
        out.append(f"- **{f['kind']}** {', '.join(f['msgs'])} {f['uow']}: {html.escape(f['detail'])}")
    out += ["", "## Counts", "", "| what | count |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in sorted(s["counts"].items())]
    return "\n".join(out) + "\n"


def summary_rows(s: dict[str, Any]) -> list[tuple[str, str]]:
    t = s["throughput"]
    rows = [("operations", str(s["operations"])), ("committed units of work", str(s["committed_uows"])),
            ("messages put", str(s["messages_put"])),
            ("throughput, committed/s (overall / fault-free)", f"{t['overall']} / {t['fault_free']}"),
            ("faults", ", ".join(f"{f['kind']}@{f['target']}" for f in s["faults"]) or "none")]
    for k, v in s["recovery"].items():
        rows.append((f"{k.removesuffix('_s').replace('_', ' ')} (s, median / max)",
                     f"{statistics.median(v):.2f} / {max(v):.2f}"))
    for k in ("unknown outcomes", "redeliveries after backout", "non-persistent lost (allowed)",
              "expired, never delivered (allowed)", "purged (allowed)"):
        rows.append((k, str(s["counts"].get(k, 0))))
    for k in FINDING_KINDS:
        rows.append((k.upper(), str(s["findings"][k])))
    if s["fault_errors"]:
        rows.append(("fault errors", "; ".join(s["fault_errors"])))
    if s["unavailable"]:
        rows.append(("unavailable here", "; ".join(s["unavailable"])))
    return rows


def summary_table(s: dict[str, Any]) -> Table:
    table = Table(title=f"cfemu chaos: seed {s['seed']}", box=box.SIMPLE_HEAVY)
    table.add_column("what")
    table.add_column("value", justify="right")
    for k, v in summary_rows(s):
        bad = k.lower() in FINDING_KINDS and v != "0"
        table.add_row(k, v, style="bold red" if bad or k == "fault errors" else None)
    return table


# --- soak --------------------------------------------------------------------------------------------------------
def summarize_soak(base: ChaosOptions, runs: list[dict[str, Any]]) -> dict[str, Any]:
    kinds_by_seed = {r["seed"]: Counter(f["kind"] for f in r["faults"]) for r in runs}
    findings = {k: sum(r["findings"][k] for r in runs) for k in FINDING_KINDS}
    recovery: dict[str, dict[str, list[float]]] = {}
    for r in runs:
        for f in r["faults"]:
            for k in TIMING_KEYS:
                v = f["service_s"] if k == "service_s" else f["timings"].get(k)
                if isinstance(v, int | float):
                    recovery.setdefault(f["kind"], {}).setdefault(k, []).append(float(v))
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": machine(),
        "seeds": [r["seed"] for r in runs], "duration": base.duration, "clients": base.clients,
        "managers": base.managers, "kinds": list(base.kinds),
        "kinds_by_seed": {str(k): dict(v) for k, v in kinds_by_seed.items()},
        "operations": sum(r["operations"] for r in runs),
        "committed_uows": sum(r["committed_uows"] for r in runs),
        "findings": findings, "must_be_zero_ok": not any(findings[k] for k in MUST_BE_ZERO),
        "fault_errors": [f"seed {r['seed']}: {e}" for r in runs for e in r["fault_errors"]],
        "unavailable": sorted({u for r in runs for u in r["unavailable"]}),
        "recovery": recovery,
        "runs": [{k: r[k] for k in ("seed", "operations", "committed_uows", "findings", "throughput",
                                    "report_dir")} for r in runs],
    }


def machine() -> str:
    import os

    return f"{platform.node()}: {platform.system()} {platform.release()}, {os.cpu_count()} CPUs, " \
           f"Python {platform.python_version()}"


def write_soak(base_dir: Path, soak: dict[str, Any]) -> None:
    base_dir.mkdir(parents=True, exist_ok=True)
    (base_dir / "soak.json").write_text(json.dumps(soak, indent=2) + "\n")
    (base_dir / "soak.md").write_text(soak_markdown(soak))


def soak_markdown(soak: dict[str, Any]) -> str:
    kinds = sorted({k for v in soak["kinds_by_seed"].values() for k in v} | set(soak["kinds"]))
    seeds = soak["seeds"]
    out = [f"Soak of {soak['date']} on {soak['machine']}: {len(seeds)} seeds x {soak['duration']:g} s, "
           f"{soak['clients']} clients, {soak['managers']} SQMs; {soak['operations']} operations, "
           f"{soak['committed_uows']} committed units of work.", "",
           "Fault kinds by seed (how many times each kind was injected):", "",
           "| kind | " + " | ".join(str(s) for s in seeds) + " | total |",
           "|---|" + "---|" * (len(seeds) + 1)]
    for k in kinds:
        row = [soak["kinds_by_seed"][str(s)].get(k, 0) for s in seeds]
        out.append(f"| {k} | " + " | ".join(str(c or "") for c in row) + f" | {sum(row)} |")
    out += ["", "| finding | count |", "|---|---|"]
    out += [f"| {k} | {v} |" for k, v in soak["findings"].items()]
    out += ["", "Recovery times per kind (seconds, median / max):", "",
            "| kind | " + " | ".join(k.removesuffix("_s").replace("_", " ") for k in TIMING_KEYS) + " |",
            "|---|" + "---|" * len(TIMING_KEYS)]
    for kind, t in sorted(soak["recovery"].items()):
        cells = [f"{statistics.median(t[k]):.2f} / {max(t[k]):.2f}" if k in t else "" for k in TIMING_KEYS]
        out.append(f"| {kind} | " + " | ".join(cells) + " |")
    if soak["fault_errors"]:
        out += ["", "Faults that did not go as planned:", ""] + [f"- {e}" for e in soak["fault_errors"]]
    if soak["unavailable"]:
        out += ["", "Unavailable on this machine:", ""] + [f"- {u}" for u in soak["unavailable"]]
    return "\n".join(out) + "\n"


def soak_table(soak: dict[str, Any]) -> Table:
    table = Table(title=f"cfemu chaos soak: {len(soak['seeds'])} seeds", box=box.SIMPLE_HEAVY)
    table.add_column("what")
    table.add_column("value", justify="right")
    table.add_row("operations", str(soak["operations"]))
    table.add_row("committed units of work", str(soak["committed_uows"]))
    kinds = Counter[str]()
    for v in soak["kinds_by_seed"].values():
        kinds.update(v)
    for k, n in sorted(kinds.items()):
        table.add_row(f"  {k}", str(n))
    for k, v in soak["findings"].items():
        table.add_row(k.upper(), str(v), style="bold red" if v else None)
    if soak["fault_errors"]:
        table.add_row("fault errors", str(len(soak["fault_errors"])), style="bold red")
    return table


__all__ = ["summarize", "summarize_soak", "summary_table", "soak_table", "throughput", "throughput_svg",
           "write_report", "write_soak"]
