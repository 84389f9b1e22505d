"""benchmarks/profile/nsys_table.py on a small nsys report made here: a sqlite export with the tables
nsys writes (StringIds, NVTX_EVENTS, CUPTI_ACTIVITY_KIND_RUNTIME / KERNEL / MEMCPY), and the two
``nsys stats`` CSV reports."""
from __future__ import annotations

import importlib.util
import sqlite3
import sys
from pathlib import Path

import pytest

_SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "profile" / "nsys_table.py"
TID = 1001

# one layer on one thread (ns): (name, start, end)
RANGES = [
    ("layer/default", 0, 1_000_000),
    ("solve/areas", 10_000, 60_000),
    ("solve/assign", 60_000, 300_000),
    ("solve/metas", 300_000, 400_000),
    ("comm/cast fwd.qo fwd.kv", 400_000, 450_000),
    ("attn/fwd stage0", 450_000, 600_000),
    ("comm/reduce fwd.o", 600_000, 900_000),
    ("comm/wait", 650_000, 700_000),  # nested in the reduce: counted once in the comm total
]
# (correlation id, runtime call, call start, call end, GPU table or None, GPU start, GPU end)
CALLS = [
    (1, "cudaLaunchKernel_v7000", 20_000, 25_000, "KERNEL", 30_000, 50_000),
    (2, "cudaLaunchKernel_v7000", 70_000, 75_000, "KERNEL", 80_000, 200_000),
    (9, "cudaStreamSynchronize_v3020", 210_000, 290_000, None, 0, 0),  # a host read in the assignment
    (3, "cudaLaunchKernel_v7000", 310_000, 315_000, "KERNEL", 320_000, 380_000),
    (4, "cudaLaunchKernel_v7000", 410_000, 414_000, "KERNEL", 415_000, 500_000),
    (5, "cudaLaunchKernel_v7000", 460_000, 465_000, "KERNEL", 500_000, 700_000),
    (6, "cudaMemcpyAsync_v3020", 620_000, 625_000, "MEMCPY", 700_000, 720_000),
    (7, "cudaLaunchKernel_v7000", 800_000, 805_000, "KERNEL", 850_000, 900_000),
    (8, "cudaLaunchKernel_v7000", 1_050_000, 1_055_000, "KERNEL", 1_100_000, 1_200_000),  # outside any range
]


def make_sqlite(path: Path) -> Path:
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE StringIds (id INTEGER PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE NVTX_EVENTS (start INTEGER NOT NULL, end INTEGER, eventType INTEGER NOT NULL,
            rangeId INTEGER, category INTEGER, color INTEGER, text TEXT, globalTid INTEGER,
            endGlobalTid INTEGER, textId INTEGER, domainId INTEGER, uint64Value INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_RUNTIME (start INTEGER NOT NULL, end INTEGER NOT NULL,
            eventClass INTEGER, globalTid INTEGER, correlationId INTEGER, nameId INTEGER,
            returnValue INTEGER, callchainId INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_KERNEL (start INTEGER NOT NULL, end INTEGER NOT NULL,
            deviceId INTEGER, contextId INTEGER, streamId INTEGER, correlationId INTEGER,
            globalPid INTEGER, demangledName INTEGER, shortName INTEGER);
        CREATE TABLE CUPTI_ACTIVITY_KIND_MEMCPY (start INTEGER NOT NULL, end INTEGER NOT NULL,
            deviceId INTEGER, contextId INTEGER, streamId INTEGER, correlationId INTEGER,
            globalPid INTEGER, bytes INTEGER, copyKind INTEGER);
    """)
    names = {}

    def sid(text):
        if text not in names:
            names[text] = len(names) + 1
            db.execute("INSERT INTO StringIds VALUES (?, ?)", (names[text], text))
        return names[text]

    for i, (name, start, end) in enumerate(RANGES):
        # nsys stores short texts inline and registered strings by id: use both
        text, text_id = (name, None) if i % 2 else (None, sid(name))
        db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid, textId) VALUES (?,?,?,?,?,?)",
                   (start, end, 59, text, TID, text_id))
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (?,?,?,?,?)",
               (5_000, 7_000, 59, "ncclGroupStart", TID))  # someone else's range: left out
    db.execute("INSERT INTO NVTX_EVENTS (start, end, eventType, text, globalTid) VALUES (?,?,?,?,?)",
               (1, None, 34, "a mark", TID))
    for corr, api, s, e, table, gs, ge in CALLS:
        db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_RUNTIME VALUES (?,?,?,?,?,?,?,?)",
                   (s, e, 1, TID, corr, sid(api), 0, None))
        if table == "KERNEL":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_KERNEL VALUES (?,?,?,?,?,?,?,?,?)",
                       (gs, ge, 0, 1, 7, corr, 1, sid(f"kernel{corr}"), sid(f"k{corr}")))
        elif table == "MEMCPY":
            db.execute("INSERT INTO CUPTI_ACTIVITY_KIND_MEMCPY VALUES (?,?,?,?,?,?,?,?,?)",
                       (gs, ge, 0, 1, 7, corr, 1, 4096, 2))
    db.commit()
    db.close()
    return path


NVTX_SUM_CSV = """\
Generating SQLite file report.sqlite from report.nsys-rep
Processing [report.sqlite] with [/opt/nvidia/nsight-systems/reports/nvtx_sum.py]...
Time (%),Total Time (ns),Instances,Avg (ns),Med (ns),Min (ns),Max (ns),StdDev (ns),Style,Range
40.0,2000000,2,1000000.0,1000000.0,1000000,1000000,0.0,PushPop,:layer/default
20.0,480000,2,240000.0,240000.0,240000,240000,0.0,PushPop,:solve/assign
10.0,100000,2,50000.0,50000.0,50000,50000,0.0,PushPop,solve/areas
8.0,600000,2,300000.0,300000.0,300000,300000,0.0,PushPop,:comm/reduce fwd.o
5.0,300000,2,150000.0,150000.0,150000,150000,0.0,PushPop,:attn/fwd stage0
"""

GPU_TRACE_CSV = """\
Start (ns),Duration (ns),CorrId,GrdX,GrdY,GrdZ,BlkX,BlkY,BlkZ,Reg/Trd,StcSMem (MB),DymSMem (MB),Bytes (MB),\
Throughput (MBps),SrcMemKd,DstMemKd,Device,Ctx,GreenCtx,Strm,Name
30000,20000,1,1,1,1,128,1,1,32,0.0,0.0,,,,,NVIDIA H200 (0),1,,7,kernel1
80000,120000,2,1,1,1,128,1,1,32,0.0,0.0,,,,,NVIDIA H200 (0),1,,7,kernel2
320000,60000,3,1,1,1,128,1,1,32,0.0,0.0,,,,,NVIDIA H200 (0),1,,7,kernel3
"""


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("_nsys_table", _SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)


def _row(text: str, name: str) -> list[str]:
    line = next(ln for ln in text.splitlines() if ln.startswith(f"| {name} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def test_sqlite_report_table(table, tmp_path, capsys):
    db = make_sqlite(tmp_path / "report.sqlite")
    out_md = tmp_path / "out" / "table.md"
    assert table.main([str(db), "--out", str(out_md)]) == 0
    text = capsys.readouterr().out
    assert out_md.read_text() == text
    assert "ncclGroupStart" not in text  # only gpusolver's ranges
    # range, category, calls, host ms, host ms / call, GPU ms, GPU ops, sync calls
    assert _row(text, "solve/assign") == ["solve/assign", "solve", "1", "0.240", "0.240", "0.120", "1",
                                          "1 (cudaStreamSynchronize)"]
    assert _row(text, "comm/reduce fwd.o")[5:7] == ["0.070", "2"]  # the copy and the kernel launched inside
    assert _row(text, "layer/default")[5:7] == ["0.555", "7"]  # everything but the launch outside
    # category totals: nested comm/wait is inside comm/reduce, so comm = 0.05 + 0.3 ms
    assert _row(text, "comm") == ["comm", "0.350"] and _row(text, "solve") == ["solve", "0.390"]
    assert _row(text, "attn") == ["attn", "0.150"] and _row(text, "layer") == ["layer", "1.000"]
    # idle gaps > 20 us inside the layer: 50->80, 200->320 (the sync), 380->415, 720->850 us
    assert "GPU idle gaps longer than 20 us while a range was open: 4, 0.315 ms in all; " \
           "1 overlap a synchronising CUDA call" in text
    assert _row(text, "0.200") == ["0.200", "120.0", "solve/assign", "cudaStreamSynchronize"]
    assert _row(text, "0.720") == ["0.720", "130.0", "comm/reduce fwd.o", "-"]
    assert "Host syncs inside ranges: layer/default, solve/assign" in text


def test_gap_threshold_and_fail_on_sync(table, tmp_path, capsys):
    db = make_sqlite(tmp_path / "report.sqlite")
    assert table.main([str(db), "--gap-us", "100", "--fail-on-sync"]) == 1
    assert "longer than 100 us while a range was open: 2, 0.250 ms" in capsys.readouterr().out


def test_csv_reports(table, tmp_path, capsys):
    nvtx, trace = tmp_path / "nvtx_sum.csv", tmp_path / "gpu_trace.csv"
    nvtx.write_text(NVTX_SUM_CSV)
    trace.write_text(GPU_TRACE_CSV)
    assert table.main(["--nvtx", str(nvtx), "--gpu-trace", str(trace)]) == 0
    text = capsys.readouterr().out
    assert _row(text, "solve/assign") == ["solve/assign", "solve", "2", "0.480", "0.240"]
    assert _row(text, "layer/default")[2:4] == ["2", "2.000"]
    assert _row(text, "solve") == ["solve", "0.580"]
    assert "longer than 20 us while a range was open: 2, 0.150 ms" in text  # 50->80 and 200->320 us


def test_bad_inputs(table, tmp_path, capsys):
    with pytest.raises(SystemExit):
        table.main([])
    empty = tmp_path / "empty.sqlite"
    sqlite3.connect(empty).close()
    with pytest.raises(ValueError, match="NVTX_EVENTS"):
        table.main([str(empty)])
