"""Prometheus conventions, checked on what an endpoint really exposes (the members', the scheduler's, the
supervisor's /metrics), and the metric names a PromQL expression refers to (the dashboard's and the rules').

``convention_problems`` parses the text with prometheus_client's own parser (always there) and checks the naming
rules of https://prometheus.io/docs/practices/naming/ the project keeps; ``promtool_problems`` runs ``promtool
check metrics`` (Prometheus's own linter) when promtool is installed (Debian: ``apt-get install prometheus``).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

NAME = re.compile(r"^[a-z][a-z0-9_]*$")  # snake_case; no colons (those are recording rules')
BAD_UNITS = re.compile(r"_(milliseconds|microseconds|ms|us|minutes|hours|days|kilobytes|megabytes|percent)(_|$)")


def scrape(port: int, host: str = "127.0.0.1") -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=15) as r:
        return r.read().decode()


def families(text: str) -> dict[str, object]:
    return {f.name: f for f in text_string_to_metric_families(text)}


def exposed_names(text: str) -> set[str]:
    """Every series name the text exposes or announces: each family's samples' names, and for a family without
    samples yet the names its type gives it (a histogram's _bucket, _sum and _count; a counter's _total)."""
    names: set[str] = set()
    for f in text_string_to_metric_families(text):
        names.update(s.name for s in f.samples)
        names.update({"counter": [f"{f.name}_total"], "histogram": [f"{f.name}_bucket", f"{f.name}_sum",
                      f"{f.name}_count"], "summary": [f"{f.name}_sum", f"{f.name}_count", f.name]}
                     .get(f.type, [f.name]))
    return names


def convention_problems(text: str, prefixes: tuple[str, ...]) -> list[str]:
    """What in ``text`` breaks the naming conventions; ``prefixes``: the namespaces the endpoint's own families
    may use (the client library's ``process_`` and ``python_`` are allowed besides)."""
    problems: list[str] = []
    seen: set[str] = set()
    for f in text_string_to_metric_families(text):
        name = f.name
        if name in seen:
            problems.append(f"{name}: exposed twice")
        seen.add(name)
        if not NAME.match(name):
            problems.append(f"{name}: not snake_case")
        if not name.startswith((*prefixes, "process_", "python_")):
            problems.append(f"{name}: not in a namespace of {prefixes}")
        if not f.documentation.strip():
            problems.append(f"{name}: no HELP")
        if BAD_UNITS.search(name):
            problems.append(f"{name}: not in a base unit (seconds, bytes, ratio)")
        if re.search(r"(^|_)age(_|$)", name):
            problems.append(f"{name}: an age goes stale with its scrape: expose a _timestamp_seconds")
        if "timestamp" in name and not name.endswith("_timestamp_seconds"):
            problems.append(f"{name}: a point in time is a _timestamp_seconds")
        if f.type == "counter":
            bad = [s.name for s in f.samples if not s.name.endswith(("_total", "_created"))]
            if bad:
                problems.append(f"{name}: counter samples without _total: {bad}")
        elif name.endswith(("_total", "_count", "_sum", "_bucket")):
            problems.append(f"{name}: a {f.type} named like a counter or a histogram's series")
        if f.type == "histogram" and not name.endswith(("_seconds", "_bytes")):
            problems.append(f"{name}: a histogram without its unit (_seconds, _bytes)")
        if f.type == "gauge" and name.endswith("_info"):
            problems += [f"{name}: an _info sample of {s.value}, not 1" for s in f.samples if s.value != 1]
        for s in f.samples:
            problems += [f"{name}: label {k!r} not snake_case" for k in s.labels if not NAME.match(k)]
    return problems


def promtool() -> str | None:
    return shutil.which("promtool")


def promtool_problems(text: str) -> str:
    """``promtool check metrics``'s complaints about ``text`` ('' when it has none)."""
    tool = promtool()
    assert tool is not None
    r = subprocess.run([tool, "check", "metrics"], input=text.encode(), capture_output=True, timeout=60)
    return "" if r.returncode == 0 else (r.stdout + r.stderr).decode()


# --- PromQL: the metric names an expression refers to ----------------------------------------------------------
PROMQL_WORDS = {
    # aggregations, their modifiers, binary operators and keywords
    "sum", "min", "max", "avg", "group", "stddev", "stdvar", "count", "count_values", "bottomk", "topk", "quantile",
    "by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
    "atan2", "inf", "nan",
}


def promql_metric_names(expr: str) -> set[str]:
    """The metric names ``expr`` selects: identifiers that are neither a function (followed by '('), nor a
    keyword, nor inside braces or after by/without/on/ignoring (label names), nor in a string or a duration."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # strings (label values, regexes)
    text = re.sub(r"\{[^}]*\}", "{}", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "[]", text)  # ranges and subqueries
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", r"\1()", text)
    names = set()
    for m in re.finditer(r"[a-zA-Z_:][a-zA-Z0-9_:]*", text):
        word = m.group(0)
        rest = text[m.end():].lstrip()
        if rest.startswith("(") or word.lower() in PROMQL_WORDS:
            continue
        if re.match(r"^\d", word) or (m.start() > 0 and text[m.start() - 1].isdigit()):
            continue  # 5m, 1e3
        names.add(word)
    return names
