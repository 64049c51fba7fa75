"""The profile fit `tools/profile_comm.py` (and start-up calibration) runs: on synthetic timings
with known alpha and beta per op it must recover them (training/calibrate.py, Parm §V-A)."""
import pytest

from megatron_moe.perf.alpha_beta import fit_alpha_beta
from megatron_moe.training.calibrate import fit_profile, geometric_sizes
from megatron_moe.perf.hardware import OPS, load_profile, save_profile

TRUE = {"mp_allgather": (5e-3, 1.2e-8), "ep_esp_alltoall": (3.7e-3, 6.3e-9), "saa": (7.5e-3, 6.6e-8),
        "p2p": (2e-4, 3e-9), "broadcast": (4e-4, 5e-9), "expert_compute": (1e-4, 2e-9)}


def _synthetic(noise: float):
    """op -> (elements, seconds) at the tool's default sizes, alpha + beta x times (1 +- noise)."""
    sizes = geometric_sizes(1 << 14, 1 << 20, 6)
    assert sizes[0] == 1 << 14 and sizes[-1] == 1 << 20 and len(sizes) == 6
    return {op: (sizes, [(a + b * x) * (1 + noise * (-1) ** i) for i, x in enumerate(sizes)])
            for op, (a, b) in TRUE.items()}


def test_fit_recovers_known_costs(tmp_path):
    exact = fit_profile("synthetic", _synthetic(0.0), {"layout": {"tensor": 2}})
    for op in OPS:
        alpha, beta = TRUE[op]
        fitted = getattr(exact, op)
        # fitted to the recorded points (6 significant digits), not to the unrounded timings
        assert fitted.alpha == pytest.approx(alpha, rel=1e-5) and fitted.beta == pytest.approx(beta, rel=1e-5), op
        points = exact.fit["points"][op]
        assert fitted == fit_alpha_beta(points["x"], points["seconds"]), op
        assert fitted.r2 == pytest.approx(1.0)
    noisy = fit_profile("synthetic", _synthetic(0.03), {})
    for op in OPS:  # +-3% alternating noise: beta within 5%, alpha within 30% (it is the small term)
        alpha, beta = TRUE[op]
        fitted = getattr(noisy, op)
        assert fitted.beta == pytest.approx(beta, rel=0.05) and fitted.alpha == pytest.approx(alpha, rel=0.3), op
        assert 0.95 < fitted.r2 < 1.0
    # the measured points travel with the profile and survive the YAML round trip
    save_profile(noisy, str(tmp_path / "p.yaml"))
    loaded = load_profile(str(tmp_path / "p.yaml"))
    assert loaded == noisy and loaded.fit["points"]["saa"]["x"][-1] == 1 << 20
    # an op measured on a group of one rank has no points and costs nothing; unknown ops are refused
    single = fit_profile("one rank", {"mp_allgather": ([], []), "saa": _synthetic(0.0)["saa"]}, {})
    assert (single.mp_allgather.alpha, single.mp_allgather.beta) == (0.0, 0.0) and single.p2p is None
    with pytest.raises(ValueError, match="unknown ops"):
        fit_profile("bad", {"nccl_magic": ([1, 2], [1.0, 2.0])}, {})


def test_p2p_warm_up_once_per_group(monkeypatch):
    """The p2p builders warm their communicator up once (`warm_up_p2p`), not once per size."""
    import torch
    from megatron_moe.distributed.parallel_state import ParallelState
    from megatron_moe.training import calibrate

    warmed = []
    monkeypatch.setattr(calibrate, "warm_up_p2p", lambda group, side=False: warmed.append(group.name))
    state, cpu = ParallelState.single_process(), torch.device("cpu")
    p2p = calibrate._builders(state, cpu, calibrate.ExpertShape())["p2p"][1]
    links = calibrate._link_builders(state, cpu)["p2p"]
    for size in geometric_sizes(1 << 10, 1 << 14, 3):
        p2p(size)
        links(size)
    assert warmed == ["ep", "world"]
