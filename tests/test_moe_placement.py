"""Placement: attention, norms and router on the main device; experts where the
residency policy and per-layer overrides put them (two logical CPU devices stand
in for a GPU and its host, so this runs anywhere)."""
from __future__ import annotations

import numpy as np
import pytest

from flare.core.errors import PlacementError
from flare.models.moe_lm import MoeLM, encode, get_config
from flare.models.moe_lm import weights as moe_weights
from flare.models.moe_lm.cli import parser
from flare.models.moe_lm.placement import Placement, parse_layer_map
from flare.core.session import Session


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return moe_weights.ensure(get_config("tiny"), 0, tmp_path_factory.mktemp("moe_weights"))


def _devices_by_role(model, entry="decode"):
    plan = model.graph.current_plan(entry)
    out: dict[str, set[str]] = {}
    for t in plan.graph.tensors:
        if t.id in plan.schedule.device_of and not t.name.startswith(("contiguous", "reshape")):
            out.setdefault(t.name, set()).add(plan.schedule.device_of[t.id])
    return {name: devs.pop() for name, devs in out.items()}


@pytest.mark.parametrize("experts", ["resident", "offload"])
def test_per_layer_expert_override(tiny_path, experts):
    ref = MoeLM.load("tiny", experts=experts, weights_path=tiny_path)
    want = ref.generate(encode("placement"), 6, stop_at_eos=False)
    ref.release()
    with Session(["cpu:0", "cpu:1"]) as session:
        model = MoeLM.load("tiny", experts=experts, weights_path=tiny_path, session=session,
                           expert_layer_devices=parse_layer_map(["1=cpu:1"]))
        try:
            got = model.generate(encode("placement"), 6, stop_at_eos=False)
            where = _devices_by_role(model)
            for name, dev in where.items():
                if name.startswith("L1.expert"):
                    assert dev == "cpu:1", name
                elif name.startswith(("L0.", "L1.attn", "L1.ffn", "L1.k_cache", "embed", "out.")):
                    assert dev == "cpu:0", name
            assert where["L1.ffn.router"] == "cpu:0" and where["L1.expert.down"] == "cpu:1"
            assert where["L0.expert.down"] == "cpu:0"
            info = model.graph.describe()["entries"]["decode"]
            assert info["splits_per_device"]["cpu:1"] >= 1 and info["copies"] > 0
        finally:
            model.release()
    assert want[0] == got[0] and all(np.array_equal(a, b) for a, b in zip(want[1], got[1]))


def test_layer_override_moves_a_whole_layer(tiny_path):
    with Session(["cpu:0", "cpu:1"]) as session:
        model = MoeLM.load("tiny", weights_path=tiny_path, session=session, layer_devices={0: "cpu:1"})
        try:
            model.generate(encode("x"), 2)
            where = _devices_by_role(model)
            assert where["L0.attn.q"] == where["L0.ffn.router"] == where["L0.expert.up"] == "cpu:1"
            assert where["L1.attn.q"] == where["L1.expert.up"] == "cpu:0"
        finally:
            model.release()


def test_unknown_device_is_a_placement_error(tiny_path):
    with pytest.raises(PlacementError, match="'vulkan'.*not in this session"):
        MoeLM.load("tiny", weights_path=tiny_path, expert_device="vulkan")


def test_layer_map_parsing_and_cli_flags():
    assert parse_layer_map(["0-2=cpu", "3=vulkan"]) == {0: "cpu", 1: "cpu", 2: "cpu", 3: "vulkan"}
    assert parse_layer_map(["0,2=cpu:1"]) == {0: "cpu:1", 2: "cpu:1"}
    with pytest.raises(ValueError):
        parse_layer_map(["x=cpu"])
    args = parser().parse_args(["--prompt", "p", "--expert-device", "1=cpu", "--layer-device", "0=vulkan"])
    assert args.expert_device == ["1=cpu"] and args.layer_device == ["0=vulkan"]
    policy = Placement("vulkan", expert_layers={1: "cpu"})
    assert policy.wanted("L1.experts.gate") == "cpu" and policy.wanted("L1.attn.q") == "vulkan"
    assert policy.wanted("L0.expert.stage") == "vulkan" and policy.wanted("lm_head") == "vulkan"
