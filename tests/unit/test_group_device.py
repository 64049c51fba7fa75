"""Issue #44 item 1: every tensor entering a collective lives on its group's device (NCCL has no CPU
backend). Single process: a `Group` of two ranks declared to live on the `meta` device stands for
an NCCL group whose tensors belong on the GPU; `torch.distributed` is never reached
(tests/distributed/test_nccl_rules.py checks the same on real gloo groups)."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megatron_moe.distributed import collectives as C
from megatron_moe.distributed.group import Group
from megatron_moe.techniques.flexmoe.vexpert_base import SlotBalancer
from megatron_moe.techniques.parm.parm import Auto

META = torch.device("meta")


def _meta_group(name: str = "ep") -> Group:
    return Group(name, [0, 1], 0, handle=object(), device=META)


def _ops(g: Group):
    """Every tensor op of `collectives`, each handed CPU tensors."""
    t = torch.ones(2, 3)
    return {
        "all_reduce": lambda: C.all_reduce(t, g),
        "all_gather": lambda: C.all_gather(t, g),
        "all_gather_v": lambda: C.all_gather_v(t, g, [2, 2]),
        "all_gather_v_async": lambda: C.all_gather_v_async(t, g, [2, 2]),
        "reduce_scatter": lambda: C.reduce_scatter(t, g),
        "all_to_all_v": lambda: C.all_to_all_v(t, [1, 1], [1, 1], g),
        "all_to_all_v in flight": lambda: C.all_to_all_v(t, [1, 1], [1, 1], g, while_in_flight=lambda: None),
        "exchange_counts": lambda: C.exchange_counts(torch.ones(2, 1, dtype=torch.long), g),
        "broadcast": lambda: C.broadcast(t, 0, g),
        "broadcast_async": lambda: C.broadcast_async(t, 0, g),
        "reduce_async": lambda: C.reduce_async(t, 0, g),
        "p2p send": lambda: C.p2p_exchange([(1, t)], [], g),
        "p2p receive": lambda: C.p2p_exchange([], [(1, t)], g),
        "p2p second tensor": lambda: C.p2p_exchange([(1, t.to(META))], [(1, t)], g),
        "all_reduce_autograd": lambda: C.all_reduce_autograd(t.clone().requires_grad_(True), g),
        "all_gather_v_autograd": lambda: C.all_gather_v_autograd(t, g, [2, 2]),
        "all_to_all_v_autograd": lambda: C.all_to_all_v_autograd(t, [1, 1], [1, 1], g),
    }


@pytest.mark.parametrize("op", list(_ops(_meta_group())))
def test_every_collective_refuses_a_tensor_off_the_groups_device(op):
    """Each op raises before it communicates (no torch.distributed call: the handle is a dummy)."""
    with pytest.raises(RuntimeError, match=r"group 'ep': a tensor on cpu, but its backend needs meta"):
        _ops(_meta_group())[op]()


def test_a_group_without_device_checks_nothing_and_to_device_moves():
    g = Group("tp", [0], 0)  # one rank, no process group: no device, ops are no-ops
    t = torch.ones(2)
    g.check_device(META)
    assert C.all_reduce(t, g) is t and g.to_device(t) is t
    assert _meta_group().to_device(t).device == META
    assert _meta_group().to_device(torch.ones(2, device=META)).device == META


class _Reached(Exception):
    """Raised by the fake torch.distributed op: the tensor passed the device check."""


@pytest.fixture
def reached(monkeypatch):
    """Fake `dist.all_reduce` that records its tensor's device and stops the caller there."""
    devices = []

    def fake(t, op=None, group=None):
        devices.append(t.device)
        raise _Reached

    monkeypatch.setattr(C.dist, "all_reduce", fake)
    return devices


def test_vexpert_window_is_all_reduced_on_the_edp_device(reached):
    """FlexMoE / EPLB's load window (numpy on the host) reaches edp's all-reduce on edp's device."""
    balancer = SlotBalancer.__new__(SlotBalancer)
    balancer.state = SimpleNamespace(edp=_meta_group("edp"), edp_size=2)
    balancer.in_flight, balancer.interval, balancer.window_iterations = None, 1, 0
    balancer.window = np.ones((2, 4))
    with pytest.raises(_Reached):
        balancer.after_optimizer_step(1, optimizer=None)
    assert reached == [META]


def test_parm_auto_assignments_are_max_reduced_on_the_tp_device(reached):
    """Parm auto's E T estimates (built on the host) reach tp's max all-reduce on tp's device."""
    auto = Auto.__new__(Auto)
    auto.state = SimpleNamespace(tp=_meta_group("tp"), tp_size=2, esp_size=1)
    auto.reduce_over_tp = True
    placement = SimpleNamespace(tokens_per_ep_rank=lambda: torch.tensor([3, 1]))
    with pytest.raises(_Reached):
        auto._choose(torch.zeros(4, 8), {"s1": placement, "s2": placement})
    assert reached == [META]
