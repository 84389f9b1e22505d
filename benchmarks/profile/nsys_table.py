"""Turn an Nsight Systems report into a per-range time table (markdown), and find host-sync gaps.

    python benchmarks/profile/nsys_table.py build/profile/demo.sqlite
    python benchmarks/profile/nsys_table.py --nvtx nvtx_sum.csv [--gpu-trace cuda_gpu_trace.csv]

Inputs, from ``nsys export --type sqlite report.nsys-rep`` (everything below)
or from ``nsys stats --report nvtx_sum --format csv`` (range times only),
optionally with ``--report cuda_gpu_trace`` (GPU idle gaps, unattributed).

The ranges are gpusolver's NVTX ranges (``GPUSOLVER_NVTX=1``), named
``<category>/<what>``: ``solve`` (areas, assignment, metas, routes),
``comm`` (group-cast and group-reduce), ``attn`` (attention stages),
``layer`` (a whole DynamicCPAttention call). From the sqlite export the table
gives, per range name: calls, host time (the time the host spent inside the
range: launch time when the layer runs ahead of the GPU), the GPU time of the
kernels and copies launched inside it, and the synchronising CUDA calls made inside it
(``cudaStreamSynchronize``, ``cudaDeviceSynchronize``, ``cudaEventSynchronize``,
blocking ``cudaMemcpy``: each one a host read on the hot path). Then the
category totals (nested ranges of the same category counted once), and the
GPU's idle gaps longer than ``--gap-us`` while a range was open on the host,
each with the innermost open range and whether a synchronising call overlaps
it: a sync-free layer shows none of those.
"""
from __future__ import annotations

import argparse
import csv
import io
import sqlite3
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

CATEGORIES = ("solve", "comm", "attn", "layer")
SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy_",
              "cudaMemcpy2D_", "cudaStreamWaitEvent_host")  # cudaMemcpy_vNNNN is the blocking copy
NVTX_RANGE_TYPES = (59, 60)  # push/pop and start/end ranges
DOMAIN_PREFIX = "gpusolver"


@dataclass
class Range:
    name: str
    start: int
    end: int
    tid: int
    depth: int = 0

    @property
    def category(self) -> str:
        return category(self.name)


@dataclass
class RangeStats:
    calls: int = 0
    host_ns: int = 0
    gpu_ns: int = 0
    kernels: int = 0
    syncs: int = 0
    sync_names: set = field(default_factory=set)


@dataclass
class Gap:
    start: int
    ns: int
    range_name: str
    sync: str


def category(name: str) -> str:
    head = name.lstrip(":").split("/", 1)[0]
    return head if head in CATEGORIES else "other"


def _is_sync(api: str) -> bool:
    return any(api.startswith(s) for s in SYNC_CALLS)


# -- sqlite export ---------------------------------------------------------------------------------


def _tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type='table'")}


def _columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def read_sqlite(path: str | Path):
    """(ranges, launches, gpu_ops, api_calls) from an nsys sqlite export.

    ranges:   [Range] gpusolver NVTX ranges (any name when none starts with a category).
    launches: {correlationId: (tid, start)} of CUDA runtime calls.
    gpu_ops:  [(start, end, correlationId, kind)] kernels, copies and memsets.
    api:      [(start, end, tid, name)] runtime calls.
    """
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        tables = _tables(db)
        if "NVTX_EVENTS" not in tables:
            raise ValueError(f"{path}: no NVTX_EVENTS table; profile with -t nvtx and GPUSOLVER_NVTX=1")
        strings = dict(db.execute("SELECT id, value FROM StringIds")) if "StringIds" in tables else {}
        cols = _columns(db, "NVTX_EVENTS")
        text_id = "textId" if "textId" in cols else "NULL"
        ranges = []
        for start, end, text, tid_text, tid in db.execute(
                f"SELECT start, end, text, {text_id}, globalTid FROM NVTX_EVENTS "
                f"WHERE eventType IN {NVTX_RANGE_TYPES} AND end IS NOT NULL"):
            name = text if text is not None else strings.get(tid_text, "")
            if name:
                ranges.append(Range(name, int(start), int(end), int(tid or 0)))
        ours = [r for r in ranges if category(r.name) != "other"]
        ranges = ours or ranges

        api, launches = [], {}
        if "CUPTI_ACTIVITY_KIND_RUNTIME" in tables:
            for start, end, tid, corr, name_id in db.execute(
                    "SELECT start, end, globalTid, correlationId, nameId FROM CUPTI_ACTIVITY_KIND_RUNTIME"):
                name = strings.get(name_id, str(name_id))
                api.append((int(start), int(end), int(tid or 0), name))
                launches[corr] = (int(tid or 0), int(start))
        gpu_ops = []
        for table, kind in (("CUPTI_ACTIVITY_KIND_KERNEL", "kernel"), ("CUPTI_ACTIVITY_KIND_MEMCPY", "memcpy"),
                            ("CUPTI_ACTIVITY_KIND_MEMSET", "memset")):
            if table in tables:
                gpu_ops += [(int(s), int(e), c, kind) for s, e, c in
                            db.execute(f"SELECT start, end, correlationId FROM {table}")]
    finally:
        db.close()
    return ranges, launches, gpu_ops, api


def _nest(ranges: list[Range]) -> None:
    """Set each range's depth on its thread (ranges of one thread nest)."""
    by_tid = defaultdict(list)
    for r in ranges:
        by_tid[r.tid].append(r)
    for rs in by_tid.values():
        rs.sort(key=lambda r: (r.start, -r.end))
        stack: list[Range] = []
        for r in rs:
            while stack and stack[-1].end <= r.start:
                stack.pop()
            r.depth = len(stack)
            stack.append(r)


def _innermost(ranges_by_tid: dict, t: int) -> str:
    """The innermost range open at time t on any thread (deepest first)."""
    best = None
    for rs in ranges_by_tid.values():
        for r in rs:
            if r.start <= t < r.end and (best is None or r.depth > best.depth):
                best = r
    return best.name if best else "-"


def analyse(ranges: list[Range], launches: dict, gpu_ops: list, api: list, gap_ns: int):
    """Per-name stats, per-category totals (ns) and GPU gaps longer than ``gap_ns`` inside ranges."""
    _nest(ranges)
    stats: dict[str, RangeStats] = defaultdict(RangeStats)
    by_tid = defaultdict(list)
    for r in ranges:
        by_tid[r.tid].append(r)
        s = stats[r.name]
        s.calls += 1
        s.host_ns += r.end - r.start
    # GPU work launched inside a range: the launching runtime call's thread and start time
    for start, end, corr, _ in gpu_ops:
        if corr not in launches:
            continue
        tid, t = launches[corr]
        for r in by_tid.get(tid, ()):
            if r.start <= t <= r.end:
                stats[r.name].gpu_ns += end - start
                stats[r.name].kernels += 1
    syncs = [(s, e, tid, name) for s, e, tid, name in api if _is_sync(name)]
    for s, e, tid, name in syncs:
        for r in by_tid.get(tid, ()):
            if r.start <= s <= r.end:
                stats[r.name].syncs += 1
                stats[r.name].sync_names.add(name.split("_v")[0])

    totals = {c: 0 for c in (*CATEGORIES, "other")}
    for tid, rs in by_tid.items():
        for r in rs:
            # count a range unless an enclosing range of the same category already counts it
            outer = [o for o in rs if o is not r and o.start <= r.start and r.end <= o.end
                     and o.depth < r.depth and o.category == r.category]
            if not outer:
                totals[r.category] += r.end - r.start

    gaps = []
    ops = sorted((s, e) for s, e, _, _ in gpu_ops)
    open_spans = [(r.start, r.end) for r in ranges if r.depth == 0]
    busy_end = None
    for s, e in ops:
        if busy_end is not None and s - busy_end > gap_ns and any(a <= busy_end and s <= b for a, b in open_spans):
            during = [x[3] for x in syncs if x[0] < s and x[1] > busy_end]  # a sync call spanning the idle time
            gaps.append(Gap(busy_end, s - busy_end, _innermost(by_tid, busy_end), during[0].split("_v")[0]
                            if during else ""))
        busy_end = e if busy_end is None else max(busy_end, e)
    return stats, totals, gaps


# -- nsys stats CSV --------------------------------------------------------------------------------


def _csv_rows(path: str | Path, must_have: str) -> list[dict]:
    """Rows of an ``nsys stats`` CSV, skipping any lines before the header."""
    text = Path(path).read_text()
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if must_have in line and "," in line:
            return list(csv.DictReader(io.StringIO("\n".join(lines[i:]))))
    raise ValueError(f"{path}: no CSV header with a '{must_have}' column")


def _col(row: dict, *keys: str) -> str:
    for want in keys:
        for k in row:
            if k and k.replace(" ", "").lower().startswith(want.replace(" ", "").lower()):
                return k
    raise ValueError(f"no column like {keys} in {list(row)}")


def read_nvtx_sum(path: str | Path) -> dict[str, RangeStats]:
    """Per-range stats from ``nsys stats --report nvtx_sum --format csv`` (host time only)."""
    rows = _csv_rows(path, "Range")
    out: dict[str, RangeStats] = defaultdict(RangeStats)
    if not rows:
        return out
    k_name, k_total, k_calls = _col(rows[0], "Range", "Name"), _col(rows[0], "Total Time"), _col(rows[0], "Instances")
    for row in rows:
        name = row[k_name].lstrip(":")
        s = out[name]
        s.calls += int(float(row[k_calls]))
        s.host_ns += int(float(row[k_total]))
    return out


def read_gpu_trace(path: str | Path) -> list[tuple[int, int]]:
    """(start, end) ns of each GPU operation in ``nsys stats --report cuda_gpu_trace --format csv``."""
    rows = _csv_rows(path, "Duration")
    if not rows:
        return []
    k_start, k_dur = _col(rows[0], "Start"), _col(rows[0], "Duration")
    return sorted((int(float(r[k_start])), int(float(r[k_start])) + int(float(r[k_dur]))) for r in rows)


def gaps_unattributed(ops: list[tuple[int, int]], gap_ns: int) -> list[Gap]:
    gaps, busy_end = [], None
    for s, e in ops:
        if busy_end is not None and s - busy_end > gap_ns:
            gaps.append(Gap(busy_end, s - busy_end, "?", "?"))
        busy_end = e if busy_end is None else max(busy_end, e)
    return gaps


# -- report ----------------------------------------------------------------------------------------


def _ms(ns: int) -> str:
    return f"{ns / 1e6:.3f}"


def render(stats: dict[str, RangeStats], totals: dict[str, int] | None, gaps: list[Gap] | None, *,
           gap_ns: int, source: str, detailed: bool, top: int = 10) -> str:
    lines = [f"# NVTX ranges of {source}", ""]
    if detailed:
        lines += ["| range | category | calls | host ms | host ms / call | GPU ms | GPU ops | sync calls |",
                  "|---|---|---:|---:|---:|---:|---:|---|"]
    else:
        lines += ["| range | category | calls | host ms | host ms / call |", "|---|---|---:|---:|---:|"]
    order = sorted(stats.items(), key=lambda kv: (CATEGORIES.index(category(kv[0])) if category(kv[0]) in CATEGORIES
                                                   else len(CATEGORIES), -kv[1].host_ns))
    for name, s in order:
        per = _ms(s.host_ns // max(s.calls, 1))
        row = f"| {name} | {category(name)} | {s.calls} | {_ms(s.host_ns)} | {per} |"
        if detailed:
            sync = f"{s.syncs} ({', '.join(sorted(s.sync_names))})" if s.syncs else "0"
            row += f" {_ms(s.gpu_ns)} | {s.kernels} | {sync} |"
        lines.append(row)
    if totals is None:  # from the summary CSV: nesting is unknown, so sum the top level of each category
        totals = defaultdict(int)
        for name, s in stats.items():
            totals[category(name)] += s.host_ns
        lines += ["", "Category totals sum every range of the category (a CSV summary does not say which nest)."]
    lines += ["", "| category | host ms |", "|---|---:|"]
    lines += [f"| {c} | {_ms(totals.get(c, 0))} |" for c in (*CATEGORIES, "other") if totals.get(c, 0)]
    if gaps is not None:
        total = sum(g.ns for g in gaps)
        with_sync = [g for g in gaps if g.sync not in ("", "?")]
        lines += ["", f"GPU idle gaps longer than {gap_ns / 1e3:g} us while a range was open: {len(gaps)}, "
                      f"{_ms(total)} ms in all" + (f"; {len(with_sync)} overlap a synchronising CUDA call"
                                                  if detailed else "")]
        if gaps:
            lines += ["", "| gap start (ms) | idle us | open range | synchronising call |", "|---:|---:|---|---|"]
            for g in sorted(gaps, key=lambda g: -g.ns)[:top]:
                lines.append(f"| {_ms(g.start)} | {g.ns / 1e3:.1f} | {g.range_name} | {g.sync or '-'} |")
    syncing = [n for n, s in stats.items() if s.syncs]
    if detailed:
        lines += ["", ("Host syncs inside ranges: " + ", ".join(sorted(syncing))) if syncing else
                  "No synchronising CUDA call inside any range: the profiled layers are sync-free."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", nargs="?", help="an nsys sqlite export (nsys export --type sqlite)")
    parser.add_argument("--nvtx", help="nsys stats --report nvtx_sum --format csv output")
    parser.add_argument("--gpu-trace", help="nsys stats --report cuda_gpu_trace --format csv output")
    parser.add_argument("--gap-us", type=float, default=20.0, help="GPU idle gaps longer than this count "
                                                                   "(default 20 us)")
    parser.add_argument("--top", type=int, default=10, help="gaps listed (default 10)")
    parser.add_argument("--out", help="also write the markdown here")
    parser.add_argument("--fail-on-sync", action="store_true",
                        help="exit 1 when a synchronising CUDA call happens inside a range")
    args = parser.parse_args(argv)
    if bool(args.report) == bool(args.nvtx):
        parser.error("give either a sqlite report or --nvtx CSV")
    gap_ns = int(args.gap_us * 1e3)
    if args.report:
        if not Path(args.report).exists():
            parser.error(f"{args.report}: no such file")
        stats, totals, gaps = analyse(*read_sqlite(args.report), gap_ns=gap_ns)
        text = render(stats, totals, gaps, gap_ns=gap_ns, source=args.report, detailed=True, top=args.top)
    else:
        stats = read_nvtx_sum(args.nvtx)
        gaps = gaps_unattributed(read_gpu_trace(args.gpu_trace), gap_ns) if args.gpu_trace else None
        text = render(stats, None, gaps, gap_ns=gap_ns, source=args.nvtx, detailed=False, top=args.top)
    print(text, end="")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    if args.fail_on_sync and any(s.syncs for s in stats.values()):
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
