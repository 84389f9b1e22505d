"""Compile captured Triton launches for an H100/H200 (sm_90) without a GPU.

The Triton interpreter runs kernels as Python and accepts code the GPU
compiler rejects (int/tensor mixes, dtype mismatches in ``tl.where``, loop
types). ``capture_launches`` records what each launch passes (argument types,
constexpr values, compile options) while the interpreter runs; ``compile_sm90``
then compiles each recorded signature to a cubin in a fresh process without
``TRITON_INTERPRET``, with the ``ptxas`` that ships in the Triton wheel.

A record may carry ``expect_ptx`` (strings: whether each is in the PTX) and ``ptx_between``
(``[before, middle, after]``: whether ``middle`` appears in the PTX text after the last
``before`` and before the first ``after``, e.g. a barrier between a kernel's loads and stores).

A record may carry ``attrs`` (argument name -> Triton attributes, e.g. the
16-byte divisibility hint a real launch puts on aligned pointers and on ints
that are multiples of 16), so the compile describes the kernel that really
runs. With ``stats=True`` each result also gives the cubin's registers, stack
bytes, spill instructions (``STL``/``LDL`` in the SASS) and the instruction
count of every innermost SASS loop that holds a matrix multiply.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile

import torch

_DTYPES = {torch.int64: "i64", torch.int32: "i32", torch.int8: "i8", torch.bool: "i1", torch.float64: "fp64",
           torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.uint8: "u8"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion", "launch_cooperative_grid")


def _arg_type(value) -> str:
    """The signature type of one non-constexpr argument (None is passed as a constexpr)."""
    if isinstance(value, torch.Tensor):
        return "*" + _DTYPES[value.dtype]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -2**31 <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    if value is None:
        return "constexpr"
    raise TypeError(f"unsupported kernel argument {value!r}")


@contextlib.contextmanager
def capture_launches(specialize: bool = False):
    """Record every interpreted launch as a JSON-able dict: module, name, signature, constexprs, options.

    specialize: also specialise as a launch on a GPU does: ``attrs`` gets the
    16-byte divisibility hint for every tensor (CUDA allocations are aligned)
    and every int that is a multiple of 16, and ints equal to 1 become
    constexprs.
    """
    from triton.runtime.interpreter import InterpretedFunction

    records, seen = [], set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        values = dict(zip(names, args))
        values.update({k: v for k, v in kwargs.items() if k in names})
        constexpr_names = {p.name for p in inspect.signature(self.fn).parameters.values()
                           if "constexpr" in str(p.annotation)}
        sig, const, attrs = {}, {}, {}
        for name in names:
            value = values[name]
            if name in constexpr_names or (specialize and type(value) is int and value == 1):
                sig[name] = "constexpr"
                const[name] = value
            else:
                sig[name] = _arg_type(value)
                if value is None:
                    const[name] = None
                elif specialize and (isinstance(value, torch.Tensor) or (type(value) is int and value % 16 == 0)):
                    attrs[name] = [["tt.divisibility", 16]]
        fn = self.fn
        record = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": const,
                  "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}
        if specialize:
            record["attrs"] = attrs
        key = json.dumps(record, sort_keys=True)
        if key not in seen:
            seen.add(key)
            records.append(record)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = recording_run
    try:
        yield records
    finally:
        InterpretedFunction.run = run


_COMPILER = r"""
import importlib, json, re, subprocess, sys, tempfile
import triton
from triton import knobs
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.tools.disasm import get_sass

def cubin_stats(cubin):
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        usage = subprocess.check_output([knobs.nvidia.cuobjdump.path, "-res-usage", f.name], text=True)
    regs = int(re.search(r"REG:(\d+)", usage).group(1))
    stack = int(re.search(r"STACK:(\d+)", usage).group(1))
    lines = [l.split("\t")[-1].strip() for l in get_sass(cubin).splitlines()]
    labels = {l[:-1]: i for i, l in enumerate(lines) if re.fullmatch(r"\w+:", l)}
    loops = []  # (first line, branch line) of every backward branch
    for i, l in enumerate(lines):
        m = re.search(r"\bBRA\s+(\w+)", l)
        if m and labels.get(m.group(1), i) < i:
            loops.append((labels[m.group(1)], i))
    inner = [(a, b) for a, b in loops if not any(a <= c and d <= b and (c, d) != (a, b) for c, d in loops)]
    body = lambda a, b: [l for l in lines[a:b + 1] if l and not l.endswith(":")]
    mma = [len(body(a, b)) for a, b in inner if any(re.match(r"(@\S+ )?H[G]?MMA", l) for l in body(a, b))]
    count = lambda op: sum(bool(re.match(r"(@!?\w+\s+)?" + op + r"\b", l)) for l in lines)
    return dict(regs=regs, stack=stack, spill_stores=count("STL"), spill_loads=count("LDL"), mma_loops=mma)

results = []
payload = json.load(sys.stdin)
for rec in payload["records"]:
    kernel = getattr(importlib.import_module(rec["module"]), rec["name"])
    result = {"name": rec["name"], "error": None, "ptx": {}}
    try:
        attrs = {(kernel.arg_names.index(n),): a for n, a in rec.get("attrs", {}).items()}
        src = ASTSource(kernel, rec["signature"], constexprs=rec["constexprs"], attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rec["options"])
        assert compiled.asm["cubin"], "no cubin"
        result["ptx"] = {text: text in compiled.asm["ptx"] for text in rec.get("expect_ptx", [])}
        if "ptx_between" in rec:  # [before, middle, after]: a middle past the last before, ahead of the first after
            before, middle, after = rec["ptx_between"]
            ptx = compiled.asm["ptx"]
            last, first = ptx.rfind(before), ptx.find(after)
            result["ptx_between"] = 0 <= last < ptx.find(middle, last) < first
        if payload["stats"]:
            result.update(cubin_stats(compiled.asm["cubin"]))
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[-2000:]
    results.append(result)
print(json.dumps(results))
"""


def compile_sm90(records: list[dict], timeout: float = 600.0, stats: bool = False, jobs: int = 1,
                 python_path: list[str] | None = None) -> list[dict]:
    """Compile every record for sm_90 in subprocesses (``jobs`` of them, records split between them).

    A record may list ``expect_ptx`` strings and carry ``attrs``. Returns one
    dict per record: name, error (None when it compiled to a cubin), ptx
    ({string: found}) and, with ``stats``, regs, stack, spill_stores,
    spill_loads (instructions) and mma_loops (instructions per innermost loop
    that holds an MMA, in SASS order). ``python_path``: folders the compiler
    processes import kernel modules from, before the inherited path.
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if python_path:
        env["PYTHONPATH"] = os.pathsep.join(list(python_path) + [env.get("PYTHONPATH", "")])
    jobs = max(1, min(jobs, len(records)))
    parts = [records[i::jobs] for i in range(jobs)]
    procs = []
    for part in parts:  # all start compiling before any is awaited
        with tempfile.TemporaryFile("w+") as job:
            json.dump({"records": part, "stats": stats}, job)
            job.seek(0)
            procs.append(subprocess.Popen([sys.executable, "-c", _COMPILER], env=env, stdin=job,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    for proc in procs:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        if proc.returncode != 0:
            raise RuntimeError(f"compiler process failed ({proc.returncode}): {stderr[-3000:]}")
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    results = [None] * len(records)
    for j, out in enumerate(outs):
        results[j::jobs] = out
    return results
