"""Compile captured Triton launches for an H100/H200 (sm_90) without a GPU.

The Triton interpreter runs kernels as Python and accepts code the GPU
compiler rejects (int/tensor mixes, dtype mismatches in ``tl.where``, loop
types). ``capture_launches`` records what each launch passes (argument types,
constexpr values, compile options) while the interpreter runs; ``compile_sm90``
then compiles each recorded signature to a cubin in a fresh process without
``TRITON_INTERPRET``, with the ``ptxas`` that ships in the Triton wheel.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import os
import subprocess
import sys

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
def capture_launches():
    """Record every interpreted launch as a JSON-able dict: module, name, signature, constexprs, options."""
    from triton.runtime.interpreter import InterpretedFunction

    records, seen = [], set()
    run = InterpretedFunction.run

    def recording_run(self, *args, grid, warmup, **kwargs):
        names = self.arg_names
        values = dict(zip(names, args))
        values.update({k: v for k, v in kwargs.items() if k in names})
        constexpr_names = {p.name for p in inspect.signature(self.fn).parameters.values()
                           if "constexpr" in str(p.annotation)}
        sig, const = {}, {}
        for name in names:
            if name in constexpr_names:
                sig[name] = "constexpr"
                const[name] = values[name]
            else:
                sig[name] = _arg_type(values[name])
                if values[name] is None:
                    const[name] = None
        fn = self.fn
        record = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": const,
                  "options": {k: kwargs[k] for k in _OPTIONS if k in kwargs}}
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
import importlib, json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
results = []
for rec in json.load(sys.stdin):
    kernel = getattr(importlib.import_module(rec["module"]), rec["name"])
    result = {"name": rec["name"], "error": None, "ptx": {}}
    try:
        src = ASTSource(kernel, rec["signature"], constexprs=rec["constexprs"])
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=rec["options"])
        assert compiled.asm["cubin"], "no cubin"
        result["ptx"] = {text: text in compiled.asm["ptx"] for text in rec.get("expect_ptx", [])}
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"[-2000:]
    results.append(result)
print(json.dumps(results))
"""


def compile_sm90(records: list[dict], timeout: float = 600.0) -> list[dict]:
    """Compile every record for sm_90 in a subprocess.

    A record may list ``expect_ptx`` strings. Returns one dict per record:
    name, error (None when it compiled to a cubin) and ptx ({string: found}).
    """
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", _COMPILER], input=json.dumps(records), env=env,
                         capture_output=True, text=True, timeout=timeout, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"compiler process failed ({out.returncode}): {out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
