"""Topology: validation, layout, prices, presets and the torchrun environment."""
import dataclasses

import pytest

from gpusolver.topology import PRESETS, Topology, gb200_nvl72, h200_hgx, single_node


def test_h200_preset_figures():
    t = h200_hgx
    assert (t.ranks_per_node, t.nvlink_gbps, t.ib_gbps, t.attn_tflops) == (8, 450.0, 50.0, 400.0)
    assert t.nics_per_node == 8 and t.bwd_attn_tflops == 400.0 and t.bwd_flops_ratio == 2.5
    assert set(PRESETS) == {"h100_hgx", "h200_hgx", "gb200_nvl72", "single_node"}
    assert Topology.preset("gb200_nvl72") is gb200_nvl72 and gb200_nvl72.ranks_per_node == 72


def test_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        h200_hgx.ib_gbps = 1.0


@pytest.mark.parametrize("field,value,err", [
    ("ranks_per_node", 0, ValueError), ("ranks_per_node", 8.0, TypeError), ("nvlink_gbps", -1.0, ValueError),
    ("ib_gbps", float("inf"), ValueError), ("attn_tflops", 0, ValueError), ("bwd_flops_ratio", "2", TypeError),
    ("nics_per_node", 3, ValueError), ("ib_latency_us", -1.0, ValueError), ("max_nodes", 0, ValueError),
    ("rail_routing", 1, TypeError),
])
def test_validation_names_the_bad_value(field, value, err):
    kwargs = dict(ranks_per_node=8, nvlink_gbps=450.0, ib_gbps=50.0, attn_tflops=400.0)
    kwargs[field] = value
    with pytest.raises(err, match=field):
        Topology(**kwargs)


def test_layout_and_nics():
    t = Topology(ranks_per_node=8, nvlink_gbps=1.0, ib_gbps=1.0, attn_tflops=1.0, nics_per_node=2)
    assert [t.node_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    assert [t.nic_of(r) for r in (0, 3, 4, 7, 8, 12)] == [0, 0, 1, 1, 2, 3]
    assert t.same_node(1, 6) and not t.same_node(7, 8)
    assert t.nodes(4) == 1 and t.nodes(16) == 2
    t.check_group(4)
    t.check_group(24)
    with pytest.raises(ValueError, match="cp_size = 12"):
        t.check_group(12)
    with pytest.raises(ValueError, match="cp_size = 16"):
        single_node.check_group(16)
    single_node.check_group(8)


def test_link_sides():
    own = Topology(ranks_per_node=4, nvlink_gbps=1.0, ib_gbps=1.0, attn_tflops=1.0, nics_per_node=2)
    rail = dataclasses.replace(own, rail_routing=True)
    for t in (own, rail):  # inside a node: NVLink, whatever the routing
        assert t.link_sides(1, 3) == (("nvlink send", 1, 1), ("nvlink recv", 3, 3))
    # across nodes through the source's own NIC (rank 1: NIC 0; rank 7: NIC 3)
    assert own.link_sides(1, 7) == (("ib send", 0, 1), ("ib recv", 3, 7))
    # on the destination's rail: over NVLink to rank 3 (local index 3, like rank 7), out of its NIC 1
    assert rail.link_sides(1, 7) == (("nvlink send", 1, 1), ("nvlink recv", 3, 3), ("ib send", 1, 3),
                                     ("ib recv", 3, 7))
    assert rail.link_sides(6, 2) == (("ib send", 3, 6), ("ib recv", 1, 2))  # already on its rail: no hop
    assert all(t.rail_routing for t in (PRESETS["h100_hgx"], h200_hgx, gb200_nvl72, single_node))


def test_prices():
    t = Topology(ranks_per_node=2, nvlink_gbps=100.0, ib_gbps=10.0, attn_tflops=2.0, bwd_attn_tflops=1.0,
                 nvlink_latency_us=3.0, ib_latency_us=7.0)
    assert t.attn_flops(1000, 4, 128) == 4 * 128 * 4 * 1000
    assert t.attn_flops(1000, 4, 128, "bwd") == 2.5 * 4 * 128 * 4 * 1000
    assert t.attn_seconds(1e6, 1, 1) == pytest.approx(4e6 / 2e12)
    assert t.attn_seconds(1e6, 1, 1, "bwd") == pytest.approx(2.5 * 4e6 / 1e12)
    assert t.link_seconds(1e9, inter_node=False) == pytest.approx(0.01)
    assert t.link_seconds(1e9, inter_node=True) == pytest.approx(0.1)
    assert t.latency_seconds(inter_node=True) == pytest.approx(7e-6)
    with pytest.raises(ValueError, match="phase"):
        t.attn_flops(1, 1, 1, "both")


def test_from_env():
    t = Topology.from_env(env={"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "16"})
    assert t.ranks_per_node == 4 and t.nics_per_node == 4 and t.ib_gbps == h200_hgx.ib_gbps
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        Topology.from_env(env={})
    with pytest.raises(ValueError, match="WORLD_SIZE = 12"):
        Topology.from_env(env={"LOCAL_WORLD_SIZE": "8", "WORLD_SIZE": "12"})
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE = 'x'"):
        Topology.from_env(env={"LOCAL_WORLD_SIZE": "x"})
    with pytest.raises(ValueError, match="unknown topology"):
        Topology.from_env("tpu", env={"LOCAL_WORLD_SIZE": "8"})
