"""``plan.memory()`` of a relay plan equals what the relay executors receive into, return into and keep.

On CPU with a ``LocalGroup``, P = 16 in nodes of 4 (the egress pre-hop acts): wrappers around the
group record every buffer a cast receives into (the out-of-place casts' fresh buffers with one
remote stage, the ``out=`` buffers the S casts share with sub-stages) and every buffer a reduce
returns into, forward and backward apart; saved-tensor hooks count what the layer keeps. Every
capacity differs from every other (and a Q row from a K+V row), so a term with the wrong rows
or the wrong row width fails. Per-rank figures are the batched totals over P.
"""
import weakref
from dataclasses import replace

import pytest
import torch

from gpusolver.areas import block_areas
from gpusolver.capacity import relay_rows
from gpusolver.plan import IMBALANCED
from gpusolver.plan.build import build_plan
from gpusolver.plan.relay import build_relay_meta
from gpusolver.runtime import dist_attn
from groupcomm import LocalGroup
from tests.gpusolver.runtime._cases import D, make_config, make_mask, tight_plan
from tests.gpusolver.runtime.test_layer_memory import _saved
from tests.gpusolver.runtime.test_relay import _topology

P, c, L, Hq, Hkv = 16, 16, 4, 8, 2  # G = 2 head groups: hq = 4, hkv = 1
CAPS = dict(max_qo_recv_rows=90, max_kv_recv_rows=130, max_qo_send_rows=110, max_kv_send_rows=150)
RELAY = dict(qo_relay=40, kv_relay=72, qo_fan=48, kv_fan=88, qo_egress=24, kv_egress=56)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Buffers:
    """Bytes of the buffers ``group``'s casts receive into and its reduces return into.

    cast:   one entry per out-of-place cast (``_cast``: its fresh buffer, all tensors);
    into:   the distinct ``out=`` buffers (``_cast_into``), by storage, offset and shape;
    ret:    per reduce's byte counter (``"fwd.o:hop2"``, ``"bwd.dkv.3"``: phase, sub-stage, hop), the
            bytes of the buffers ``_move`` makes inside it (one per returned tensor).
    alive:  per reduce, how many of the pass's receive buffers (the tensors the casts returned or
            wrote into) were still alive when it started.
    """

    def __init__(self, group):
        self.cast, self.into, self.ret, self.alive, self._refs = [], {}, {}, [], []
        self._reducing = None
        cast, into, reduce, move = group._cast, group._cast_into, group._reduce, group._move

        def cast_(*args):
            work = cast(*args)
            self.cast.append(_nbytes(work.wait()))
            self._refs += [weakref.ref(t) for t in work.wait()]
            return work

        def into_(tensors, send_index, split, out, *args):
            for o in out:
                self.into[(o.untyped_storage().data_ptr(), o.storage_offset(), tuple(o.shape))] = _nbytes([o])
                self._refs.append(weakref.ref(o))
            return into(tensors, send_index, split, out, *args)

        def reduce_(*args, **kwargs):  # (partials, send_index, split, acc, op, phase, ...)
            self.alive.append(sum(r() is not None for r in self._refs))
            self._reducing = kwargs.get("phase", args[5] if len(args) > 5 else None)
            try:
                return reduce(*args, **kwargs)
            finally:
                self._reducing = None

        def move_(*args):
            out = move(*args)
            if self._reducing is not None:
                self.ret.setdefault(self._reducing, []).append(_nbytes([out]))
            return out

        group._cast, group._cast_into, group._reduce, group._move = cast_, into_, reduce_, move_

    def take(self) -> tuple[list[int], dict, list[int]]:
        """(receive buffers, return buffers, alive) recorded since the last call."""
        got = (self.cast + list(self.into.values()), self.ret, self.alive)
        self.cast, self.into, self.ret, self.alive, self._refs = [], {}, {}, [], []
        return got


def _relay_plan(S: int, egress: bool, keep):
    """The reference solver's assignment of a packed causal mask, rebuilt with relay transport at the
    capacities above (S sub-stages; ``egress=False``: every crossing leaves from its host's NIC)."""
    mask = make_mask("docs-causal", P * c, seed=P)
    direct, tight = tight_plan(mask, make_config(P, Hq, Hkv, num_stages=S, local_tail=0))  # relay takes no tail
    config = replace(tight, topology=_topology(L), ib_relay=True, max_recv_rows=None, keep_forward_buffers=keep,
                     memory_budget=None, **CAPS)
    areas = block_areas(mask, P, config.head_groups, impl="torch")
    rows = relay_rows(config, c, L, **RELAY)
    plan = build_plan(mask, areas, direct.assignment, config, relay_rows=rows).validate(ignore=IMBALANCED)
    if not egress:
        plan = replace(plan, relay=build_relay_meta(plan.comm, L, rows, config.cost(), egress=False))
    return plan, config


@pytest.mark.parametrize("S,egress,keep", [(1, True, True), (1, True, False), (1, False, True),
                                           (4, True, True), (4, True, False), (4, False, False)])
def test_relay_plan_memory_equals_the_runtime(S, egress, keep):
    plan, config = _relay_plan(S, egress, keep)
    assert plan.relay is not None and plan.relay.num_stages == plan.num_stages == S
    assert plan.relay.egress == egress and plan.comm.buffers.as_tuple() == (90, 130, 110, 150)
    for kind in ("qo", "kv"):  # every hop moves rows (hop 3 only with an egress)
        route = plan.relay.stage(kind, 1)
        assert all(int(route.split(h).sum()) > 0 for h in (0, 1, 2)) and (int(route.split(3).sum()) > 0) == egress
    m = plan.memory(config)

    # the formula, by hand from the capacities: rows of a Q row (hq D fp32), a K+V row, an lse or delta
    q, kv, lse = 4 * D * 4, 2 * D * 4, 4 * 4
    e_q, e_kv = (24, 56) if egress else (0, 0)
    # hop 1's list: the send rows plus an egress slot per remote node an egress serves (3 nodes, 4 rails: 1)
    h1_q, h1_kv = 110 + e_q, 150 + e_kv
    hops_q, hops_kv = 2 * 90 + 40 + e_q, 2 * 130 + 72 + e_kv        # direct, fan-out, relay, egress buffers
    back_q = 48 + 110 + h1_q + (110 if egress else 0)                 # hops 2, 0, 1, 3 of one reduce
    back_kv = 88 + 150 + h1_kv + (150 if egress else 0)
    layout = 90 * q + 130 * kv                                        # Q, K, V in the plan's layout
    kept = layout if keep else 0
    assert m.kept == kept
    cast_again = 0 if keep else hops_q * q + hops_kv * kv
    hops_fwd, hops_bwd = hops_q * q + hops_kv * kv, hops_q * (q + 2 * lse) + cast_again
    layout_bwd = 90 * (q + 2 * lse) + layout
    if S == 1:  # the hop buffers go before the reduces, whose hops return one at a time
        one_q, one_kv = max(48, 110, h1_q), max(88, 150, h1_kv)
        assert m.fwd_peak == layout + max(hops_fwd, one_q * (q + lse))
        assert m.bwd_peak == layout_bwd + max(hops_bwd, one_q * q, one_kv * kv)
    else:  # the shared hop buffers live beside the reduces, each reduce's four hops counted together
        assert m.fwd_peak == layout + hops_fwd + back_q * (q + lse)
        assert m.bwd_peak == layout_bwd + hops_bwd + back_q * q + back_kv * kv

    # the runtime: every hop's receive buffers, S reduces each returning into its hops' buffers
    g = torch.Generator().manual_seed(0)
    qs = torch.randn(P, c, Hq, D, generator=g, requires_grad=True)
    ks = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    vs = torch.randn(P, c, Hkv, D, generator=g, requires_grad=True)
    group = LocalGroup(P)
    bufs = _Buffers(group)
    (out, lse_), sizes, held = _saved(lambda: dist_attn(qs, ks, vs, plan, group, keep_forward_buffers=keep))
    fwd_recv, fwd_ret, fwd_alive = bufs.take()
    (out.sum() + lse_.sum()).backward()
    bwd_recv, bwd_ret, bwd_alive = bufs.take()
    # one remote stage: no receive buffer of a hop outlives its cast's gather into the plan's layout;
    # sub-stages: the shared ones live beside the reduces issued before the last sub-stage's casts
    # are gathered (those of the earlier sub-stages), and go then: none beside the later ones
    hops = 4 if egress else 3
    assert len(fwd_alive) == S * hops and len(bwd_alive) == S * 2 * hops  # one reduce per hop
    for alive in (fwd_alive, bwd_alive):
        if S == 1:
            assert max(alive) == 0
        else:
            k = next(i for i, a in enumerate(alive) if a == 0)
            assert k >= hops and min(alive[:k]) > 0 and max(alive[k:]) == 0, alive
    # each hop's return buffers: its send list's rows (hop 2's on the relays, hop 1's on the egresses),
    # one buffer per returned tensor, in every sub-stage alike
    rows = {"": (110, 150), ":hop1": (h1_q, h1_kv), ":hop2": (48, 88), ":hop3": (110, 150)}
    tags = list(rows)[:hops]
    for phase, ret, kind, width in (("fwd.o", fwd_ret, 0, (q, lse)), ("bwd.dq", bwd_ret, 0, (q,)),
                                    ("bwd.dkv", bwd_ret, 1, (kv // 2, kv // 2))):
        for s in range(1, S + 1):
            for tag in tags:
                label = (phase if S == 1 else f"{phase}.{s}") + tag
                assert ret[label] == [P * rows[tag][kind] * w for w in width], label
    assert torch.isfinite(qs.grad).all() and torch.isfinite(ks.grad).all()
    # what the layer holds for its backward: its own activations (group-major q, k, v, and out, lse)
    # and the kept buffers in the plan's layout (with sub-stages the operands [local | buffer], whose
    # local rows are the saved q, k, v: their storages count once), within the scratch row the
    # reduce's merge gives out (groupcomm._reduce: one per rank, dropped by a view)
    own = P * c * (2 * Hq * D + 2 * Hkv * D + Hq) * 4
    assert 0 <= held - own - P * m.kept <= P * (q + lse)
    # forward: Q over each hop (one buffer, 1 tensor), K and V (one packed buffer at S = 1, two at S > 1);
    # O and lse back over each hop of each sub-stage's reduce
    assert len(fwd_recv) == hops * (2 if S == 1 else 3) and len(fwd_ret) == S * hops
    assert sum(fwd_recv) == P * hops_fwd
    # one remote stage: the largest hop's return buffers; sub-stages: one reduce's, all its hops
    if S == 1:
        assert P * layout + max(sum(fwd_recv), max(map(sum, fwd_ret.values()))) == P * m.fwd_peak
    else:
        assert P * layout + sum(fwd_recv) + sum(map(sum, fwd_ret.values())) // S == P * m.fwd_peak
    # backward: dO, lse, delta (and Q, K, V unless kept) over each hop; dQ, dK, dV back
    assert sum(bwd_recv) == P * hops_bwd and len(bwd_ret) == S * 2 * hops
    if S == 1:
        assert P * layout_bwd + max(sum(bwd_recv), max(map(sum, bwd_ret.values()))) == P * m.bwd_peak
    else:
        assert P * layout_bwd + sum(bwd_recv) + sum(map(sum, bwd_ret.values())) // S == P * m.bwd_peak
