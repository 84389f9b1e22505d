"""Device error flags: value errors found on the sync-free path, read once by ``check_errors()``.

Two modes (docs/design/layers.md, "Validation: two modes"):

- Validation mode (``validate=True``, the default for CPU tensors): every
  entry point checks values on the host at once and raises a ``ValueError``
  naming the argument, the row and the value.
- Sync-free mode (``validate=False``, the default on GPU and under
  ``torch.compile``): nothing is read on the host. The same checks run as
  device ops and write into a small per-device table of flags; the layer
  goes on (every kernel bounds its loads and stores, so a bad value drops
  work, never corrupts memory). ``check_errors()``, called where the user
  chooses (the end of a step), reads the table once and raises a
  ``ValueError`` naming the first error: the op, the argument and, where it
  is known, the row and its values.

The table (``[MAX_KINDS, 7]`` int64 per device) has one row per kind of
error, ``(op, argument, message)``, registered on first use:
``(clock, hits, row, v0 .. v4)``. ``clock`` is a device counter taken
when the kind first fired (so "first" means first in time, also across
CUDA-graph replays), ``hits`` counts the checks that found it, ``row`` is
the first offending row (-1 when the check has no rows), ``v*`` its values.
Updates are in-place ops on a tensor made once per device, so they run
under CUDA-graph capture and ``torch.compile(fullgraph=True)``.

Lower packages (``attn_kernels``, ``groupcomm``) import nothing of
``gpusolver``: they report to a sink that importing this module installs.
"""
from __future__ import annotations

import torch

MAX_KINDS = 64                 # kinds of error one process can register (the last row is the clock)
_CLOCK = MAX_KINDS - 1
_COLS = 8                      # clock, hits, row, v0 .. v4
_NVALS = _COLS - 3
_NONE = torch.iinfo(torch.int64).max

_kinds: dict[tuple[str, str, str], int] = {}
_names: list[tuple[str, str, str]] = []
_state: dict[torch.device, torch.Tensor] = {}


def register(op: str, argument: str, message) -> int:
    """Register a kind of error ahead of its first ``record`` (at import time): a kind first
    seen while ``torch.compile`` traces would change the registry inside the trace and cost
    a recompile. Returns its slot; registering twice is harmless."""
    return _slot(op, argument, message)


def arm(device) -> None:
    """Make the flag table of ``device`` now (an eager call does it on first use). A table
    first made while ``torch.compile`` traces costs one recompile; the CPU one exists at import.
    Meta tensors hold no values, so they get no table."""
    if torch.device(device).type != "meta":
        _table(torch.device(device))


def _slot(op: str, argument: str, message) -> int:
    key = (op, argument, message)
    slot = _kinds.get(key)
    if slot is None:
        if len(_names) >= _CLOCK:
            raise RuntimeError(f"gpusolver.errors: more than {_CLOCK} kinds of error registered")
        slot = _kinds[key] = len(_names)
        _names.append(key)
    return slot


def _empty(device) -> torch.Tensor:
    t = torch.zeros(MAX_KINDS, _COLS, dtype=torch.int64, device=device)
    t[:, 0] = _NONE
    t[_CLOCK, 0] = 0
    return t


def _table(device: torch.device) -> torch.Tensor:
    t = _state.get(device)
    if t is None:
        t = _state[device] = _empty(device)
    return t


def _skip(t: torch.Tensor) -> bool:
    """Meta and fake tensors hold no values: nothing to flag (the shapes were checked)."""
    if t.device.type == "meta":
        return True
    if torch.compiler.is_compiling():
        return False
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t)


def record(op: str, argument: str, message, bad: torch.Tensor, values: torch.Tensor | None = None) -> None:
    """Flag an error on the device where ``bad`` is true (no host read).

    op, argument: what the error names (``"flex_attn"``, ``"k_ranges"``).
    message:      a template over ``{row}``, ``{v0}`` .. ``{v4}`` (``str.format``),
                  e.g. ``"row {row}: [{v0}, {v1}) is outside [0, {v2}]"``, or a
                  function ``(row, values) -> str`` that names the argument itself
                  (one check covering several arguments).
    bad:          bool ``[N]`` (one flag per row; the first true row is kept)
                  or 0-dim (a check without rows; row -1).
    values:       ``[N, k]`` (or ``[k]`` for a 0-dim flag) integers, k <= 5,
                  the offending row's values for the message.
    """
    if _skip(bad):
        return
    slot = _slot(op, argument, message)
    table = _table(bad.device)
    flat = bad.reshape(-1)
    n = flat.numel()
    if n == 0:
        return
    idx = torch.arange(n, device=bad.device)
    first = torch.where(flat, idx, n).amin().reshape(1)
    hit = first < n
    row = first.clamp(max=n - 1)
    if values is None:
        vals = row.new_zeros(_NVALS)
    else:
        v = values.reshape(n if bad.dim() else 1, -1).to(torch.int64)
        vals = torch.nn.functional.pad(v.index_select(0, row)[0, :_NVALS], (0, max(0, _NVALS - v.shape[1])))
    cur = table[slot]
    clock = table[_CLOCK, :1] + 1
    table[_CLOCK, :1] = clock
    new = torch.cat([clock, cur[1:2], row if bad.dim() else row.new_full((1,), -1), vals])
    upd = torch.where(hit & (cur[:1] == _NONE), new, cur)
    upd[1:2] += hit
    cur.copy_(upd)


def reset() -> None:
    """Clear every flag (in place: a captured CUDA graph keeps writing to the same table)."""
    for t in _state.values():
        t.copy_(_empty(t.device))


def pending() -> list[dict]:
    """Every flagged error, first first (reads each device's table once; no reset)."""
    found = []
    for device, t in _state.items():
        if t.device.type == "meta":  # a table traced on meta holds no values (and flags nothing)
            continue
        host = t.cpu()  # the one device-to-host read per device
        for slot, (op, argument, message) in enumerate(_names):
            clock, hits, row, *vals = host[slot].tolist()
            if clock == _NONE:
                continue
            if callable(message):
                text = f"{op}: {message(row, vals)}"
            else:
                text = f"{op}: {argument} " + message.format(row=row, **{f"v{i}": x for i, x in enumerate(vals)})
            found.append({"clock": clock, "hits": hits, "op": op, "argument": argument, "row": row,
                          "values": vals, "device": str(device), "message": text})
    return sorted(found, key=lambda e: e["clock"])


def check_errors(*plans, reset_flags: bool = True) -> None:
    """Read the device error flags once and raise ``ValueError`` naming the first error.

    plans: ``Plan`` objects to check too (their ``status`` bits, except
    IMBALANCED, which is slow, not wrong; ``dist_attn`` checks its plan itself). Call it at a point of your choosing
    (the end of a training step): it is the only host read of the sync-free
    path. The flags are cleared after the read (``reset_flags=False`` keeps them).
    """
    for plan in plans:
        record_plan(plan, "check_errors")
    found = pending()
    if reset_flags:
        reset()
    if not found:
        return
    first = found[0]
    more = "" if len(found) == 1 else "; also: " + "; ".join(e["message"] for e in found[1:4]) + \
        (f" (+{len(found) - 4} more)" if len(found) > 4 else "")
    hits = f" ({first['hits']} checks found it)" if first["hits"] > 1 else ""
    raise ValueError(f"{first['message']}{hits} [device error flag on {first['device']}]{more}")


_SLICE_ARGS = ("q_ranges", "k_ranges", "attn_type")


def _slices_message(row: int, values: list[int]) -> str:
    """A flagged mask row: values = (argument, start or code, end, S, rows per group or 0)."""
    which, a, b, limit, rows_per_group = values
    where = f"[group {row // rows_per_group}] row {row % rows_per_group}" if rows_per_group else f"row {row}"
    if which == 2:
        return f"attn_type {where}: code {a} is not one of 0 FULL, 1 CAUSAL, 2 INV_CAUSAL, 3 BI_CAUSAL"
    total = "total_seqlen_q" if which == 0 else "total_seqlen_k"
    if a > b:
        return f"{_SLICE_ARGS[which]} {where}: start {a} > end {b}"
    return f"{_SLICE_ARGS[which]} {where}: [{a}, {b}) is outside [0, {total}={limit})"


# Slices overlap-checked on the device when asked (pairwise, O(G * R^2) elementwise work) up to
# this many rows per group
OVERLAP_FLAG_MAX_SLICES = 512


def _overlap_message(row: int, values: list[int]) -> str:
    """values = (q, k of a shared entry, the earlier row, rows per group or 0)."""
    qq, kk, first, rows_per_group = values[:4]
    where = f"[group {row // rows_per_group}] row {row % rows_per_group}" if rows_per_group else f"row {row}"
    return (f"q_ranges/k_ranges {where} covers entry (q={qq}, k={kk}) already covered by row {first}; "
            "slices must not overlap")


def record_slices(op: str, mask, *, overlap: bool = False, impl: str = "auto") -> None:
    """Flag the first reversed or out-of-range slice row, or bad type code, of an ``AttnSlices``;
    with ``overlap``, also (up to ``OVERLAP_FLAG_MAX_SLICES`` rows per group) a row that shares an
    entry with an earlier one.

    The device twin of ``AttnSlices.validate``, no host read. The range check is one Triton
    launch on CUDA (``impl="triton"``; torch ops elsewhere); the overlap check is O(G * R^2)
    torch ops, a debug option (``DynamicCPAttention(debug_digest=True)`` turns it on).
    """
    rows = mask.q_ranges.shape[-2] if mask.grouped else 0
    record_slice_table(op, "mask", _slices_message, mask.q_ranges, mask.k_ranges, mask.attn_type,
                       mask.total_seqlen_q, mask.total_seqlen_k, rows, impl=impl)
    R = mask.num_slices
    if overlap and 0 < R <= OVERLAP_FLAG_MAX_SLICES and not _skip(mask.q_ranges):
        from gpusolver.masks.validation import overlap_witness

        shape = (-1, R)
        gq, gk = mask.q_ranges.to(torch.int64).reshape(*shape, 2), mask.k_ranges.to(torch.int64).reshape(*shape, 2)
        idx = torch.arange(R, device=gq.device)
        clash, wq, wk = overlap_witness(gq, gk, mask.attn_type.to(torch.int64).reshape(shape), idx, idx)
        clash &= idx[None, :] < idx[:, None]                               # [G, R, R]: earlier rows only
        first = torch.where(clash, idx, R).amin(-1, keepdim=True)          # [G, R, 1]
        at = first.clamp(max=R - 1)
        values = torch.cat([wq.gather(-1, at), wk.gather(-1, at), at, torch.full_like(at, rows), at], -1)
        record(op, "mask", _overlap_message, clash.any(-1).reshape(-1), values.reshape(-1, 5))


def record_slice_table(op: str, argument: str, message, q_ranges: torch.Tensor, k_ranges: torch.Tensor,
                       attn_type: torch.Tensor, seqlen_q: int, seqlen_k: int, rows_per_group: int = 0,
                       *, impl: str = "auto") -> None:
    """Flag the first slice row whose q range leaves ``[0, seqlen_q]``, k range ``[0, seqlen_k]``
    (or is reversed), or whose type is not 0..3. Values for ``message``: (0 q / 1 k / 2 type,
    start or code, end, the limit, ``rows_per_group``). ``impl``: "triton" (one launch),
    "torch", or "auto" (Triton on CUDA)."""
    if _skip(q_ranges):
        return
    if impl == "auto":
        impl = "triton" if q_ranges.is_cuda else "torch"
    slot = _slot(op, argument, message)
    if impl == "triton" and q_ranges.numel():
        from gpusolver._flag_kernel import flag_slices

        flag_slices(_table(q_ranges.device), slot, _CLOCK, _NONE, q_ranges, k_ranges, attn_type,
                    seqlen_q, seqlen_k, rows_per_group)
        return
    q, k, t = q_ranges.to(torch.int64).reshape(-1, 2), k_ranges.to(torch.int64).reshape(-1, 2), \
        attn_type.to(torch.int64).reshape(-1)
    bad_q = (q[:, 0] < 0) | (q[:, 0] > q[:, 1]) | (q[:, 1] > seqlen_q)
    bad_k = (k[:, 0] < 0) | (k[:, 0] > k[:, 1]) | (k[:, 1] > seqlen_k)
    bad_t = (t < 0) | (t > 3)
    which = torch.where(bad_q, 0, torch.where(bad_k, 1, 2))
    a = torch.where(bad_q, q[:, 0], torch.where(bad_k, k[:, 0], t))
    b = torch.where(bad_q, q[:, 1], k[:, 1])
    limit = torch.where(bad_q, seqlen_q, seqlen_k)
    record(op, argument, message, bad_q | bad_k | bad_t,
           torch.stack([which, a, b, limit, torch.full_like(a, rows_per_group)], 1))


def _plan_message(row: int, values: list[int]) -> str:
    """values = (status, most slice rows a stage needs, most rows a rank receives, its capacity)."""
    from gpusolver.plan.meta import BUFFER_OVERFLOW, CALC_OVERFLOW, INVALID_MASK, NEED_MISMATCH, UNASSIGNED

    status, need, recv, cap = values[:4]
    parts = []
    if status & CALC_OVERFLOW:
        parts.append(f"CALC_OVERFLOW: a rank's stage needs {need} slice rows, more than its capacity "
                     "(raise SolverConfig.max_stage_slices)")
    if status & BUFFER_OVERFLOW:
        parts.append(f"BUFFER_OVERFLOW: a rank receives {recv} rows (receive capacity {cap}) or sends more "
                     "than its send capacity (raise SolverConfig.max_recv_rows)")
    if status & UNASSIGNED:
        parts.append("UNASSIGNED: a non-empty task has no rank")
    if status & NEED_MISMATCH:
        parts.append("NEED_MISMATCH: the block areas do not match the mask")
    if status & INVALID_MASK:
        parts.append("INVALID_MASK: a slice range is reversed or outside [0, S], or a type code is not 0..3 "
                     "(mask.validate() names the row)")
    return "plan status " + "; ".join(parts) + " (plan.validate() names the rank)"


def record_plan(plan, op: str) -> None:
    """Flag a ``Plan`` whose status has a bit other than IMBALANCED (slow, not wrong) set.

    One device check; the message lists the bits and the counts behind them.
    """
    from gpusolver.plan.meta import IMBALANCED

    status = getattr(plan, "status", None)
    if status is None or _skip(status):
        return
    status = status.to(torch.int64).reshape(1)
    zero = status.new_zeros(1)
    calc, comm = getattr(plan, "calc", None), getattr(plan, "comm", None)
    need = calc.needed_rows.to(torch.int64).amax().reshape(1) if hasattr(calc, "needed_rows") else zero
    if hasattr(comm, "qo_recv_rows"):
        # the kind past its buffer by the most rows (QO on a tie)
        # one buffer per kind, shared by the sub-stages: a rank's whole fill
        q_fill, k_fill = comm.qo_recv_rows.amax().to(torch.int64), comm.kv_recv_rows.amax().to(torch.int64)
        q_cap, k_cap = comm.qo_recv_capacity, comm.kv_recv_capacity
        qo_first = q_fill - q_cap >= k_fill - k_cap
        recv = torch.where(qo_first, q_fill, k_fill).reshape(1)
        cap = torch.where(qo_first, torch.full_like(zero, q_cap), torch.full_like(zero, k_cap))
    else:
        recv = cap = zero
    record(op, "plan", _plan_message, ((status & ~IMBALANCED) != 0)[0], torch.cat([status, need, recv, cap]))


def _install_sinks() -> None:
    """Let the lower packages (which import nothing of gpusolver) report to this table, and
    register the kinds known now."""
    import groupcomm._base as comm_base
    from attn_kernels.flex_attn import op as flex_op

    flex_op.set_error_sink(record, record_slice_table)
    comm_base.set_error_sink(record)
    for kind in flex_op.ERROR_KINDS + [("block_areas", "mask", _slices_message), ("block_areas", "mask", _overlap_message),
                                       ("dist_attn", "plan", _plan_message),
                                       ("sparse_dist_attn", "plan", _plan_message),
                                       ("check_errors", "plan", _plan_message)]:
        register(*kind)
    arm("cpu")


_install_sinks()
