"""tools/profile_comm.py writes a profile that `moe.schedule: auto` reads; benchmarks/moe_layer.py
computes the same layer output on every row and moves exactly Parm's volumes (Parm §V-A, §IV).
Small sizes: this checks results and bytes, not speed (the fit itself: tests/unit/test_calibrate.py).
The benchmarks the README documents run as its commands (`run_doc_command`), with small sizes
appended."""
import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch

from megatron_moe.config import load_config, validate_config
from megatron_moe.perf.alpha_beta import fit_alpha_beta
from megatron_moe.training.calibrate import WIDTH
from megatron_moe.perf.hardware import OPS, load_profile
from tests.doc_blocks import run_doc_command

pytestmark = pytest.mark.e2e
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def torchrun(nproc, *args, timeout=240):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def test_profile_comm_writes_a_profile_that_auto_reads(tmp_path):
    """docs/parm.md's command (8 processes: tensor 2 x expert 2 x expert-shard 2), small sizes."""
    out = tmp_path / "profile.yaml"
    run_doc_command("docs/parm.md", "tools/profile_comm.py", "--min-elements", "1024", "--max-elements", "16384",
                    "--points", "3", "--reps", "2", "--hidden", "32", "--ffn", "64", "--rows", "64,256", "--out", out,
                    cwd=tmp_path)
    profile = load_profile(str(out))
    assert profile.fit["layout"] == {"tensor": 2, "expert": 2, "expert_shard": 2} and profile.fit["world_size"] == 8
    for op in OPS:
        points = profile.fit["points"][op]
        if op == "expert_compute":  # the rows asked for (64, 256) x FLOPs per row of h 32, f 64 / esp 2 (gelu)
            assert points["x"] == [64 * 2 * 32 * 32 * 2, 256 * 2 * 32 * 32 * 2], op
        else:  # the sizes asked for (1024, 4096, 16384), rounded to whole rows of WIDTH elements per rank
            assert points["x"] == [1024, 4096, 16384], op
            assert all(e % WIDTH == 0 for e in points["x"])
        # the profile holds the least-squares fit of exactly the points it records
        refit = fit_alpha_beta(points["x"], points["seconds"])
        assert getattr(profile, op) == refit, op
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["moe.schedule=auto", f"perf.hardware_profile={out}",
                                                    "parallel.tensor=2", "parallel.expert=2", "moe.balancer=fastermoe"])
    validate_config(cfg, 4)


def test_benchmark_rows_compute_the_same_layer_with_parms_volumes():
    n, h, k, world, dp = 1 * 16, 32, 2, 4, 2  # --batch 1 --seq 16 --hidden 32, tensor 2 x expert 2
    stdout = torchrun(world, "benchmarks/moe_layer.py", "--tensor", "2", "--expert", "2", "--reps", "1",
                      "--warmup", "0", "--batch", "1", "--seq", "16", "--hidden", "32", "--ffn", "64")
    rows = json.loads(stdout.strip().splitlines()[-1])["results"]
    rows.pop("deepspeed", None)  # present when DeepSpeed is installed: test_benchmark_deepspeed_row_...
    # node_dedup: the baseline with the node-deduplicated dispatch (docs/node_dedup.md); the loop
    # below checks it computes the same layer
    assert set(rows) == {"baseline", "s1", "s2", "s2_saa", "auto", "auto_saa", "auto_saa_s1_phased", "node_dedup"}
    for name, row in rows.items():
        assert row["max_abs_diff_vs_baseline"] < 1e-5, name  # outputs ~1: float rounding only
        assert set(row["exposed_ms"]) == set(row["total_ms"]) >= {k.split("/")[0] for k in row["bytes"]}, name
    # bytes over all ranks of one forward + backward, dropless (fp32 rows of h values):
    # one trip of a micro-batch's assignments = n k rows; the baseline sends every TP copy
    trip = n * k * 4 * h
    assert rows["baseline"]["bytes_all_ranks"]["all_to_all/ep"] == 4 * world * trip  # Eq. 1: N_MP copies
    for name in ("s1", "s2", "s2_saa", "auto", "auto_saa", "auto_saa_s1_phased"):
        got = rows[name]["bytes_all_ranks"]
        p2p = got.get("all_to_all_p2p/ep_esp", 0)
        if p2p:  # SAA: the second trip of each direction phased, a rank's own slice never sent
            assert got["all_to_all/ep_esp"] == 2 * dp * trip and 0 < p2p < 2 * dp * trip, name
        else:  # Eq. 7 / 11: each micro-batch's assignments once per trip, 4 trips
            assert got["all_to_all/ep_esp"] == 4 * dp * trip, name
        picked = rows[name].get("picked", name[:2])
        # MP-AllGather, forward + backward of the MP-Split: S1 gathers B L M, S2 gathers E T M;
        # auto's S1 splits after the gate, so its backward also gathers the combine weights' gradient
        weights_grad = world * n * k * 4 if picked == "s1" and name.startswith("auto") else 0
        assert got["all_gather/tp"] == 2 * world * (n if picked == "s1" else n * k) * 4 * h + weights_grad, name
        assert "all_to_all/ep" not in got and not any(key.endswith("/esp") for key in got), name
    # SAA belongs to S2: with S1 picked, only the pre-fix row phases its combine
    assert bool(rows["auto_saa"]["bytes"].get("all_to_all_p2p/ep_esp")) == (rows["auto_saa"]["picked"] == "s2")
    assert "all_to_all_p2p/ep_esp" in rows["auto_saa_s1_phased"]["bytes"]


def test_benchmark_balancer_rows_fix_skew_exactly():
    """--skew gives the balancer imbalance to fix (issue #9 item 6): the fastermoe row computes the
    same output with a lower balance ratio, and its weight traffic is replicas x expert parameters;
    the eplb row (issue #11) re-plans its vExpert slots after the first repetition and then does
    the same with persistent replicas. Memory per rank (issue #30): the owners' 4 experts, EPLB's
    5 distinct ones (one copy each), FasterMoE's replica weights of one forward on top; AdamW's
    state twice the parameters. The flexmoe:best_effort row computes the same output."""
    stdout = torchrun(2, "benchmarks/moe_layer.py", "--expert", "2", "--rows", "baseline", "--balancer",
                      "none,fastermoe,eplb,flexmoe:best_effort", "--skew", "1.2", "--min-shadow", "1", "--reps", "2",
                      "--warmup", "0", "--batch", "2", "--seq", "16", "--hidden", "32", "--ffn", "64")
    rows = json.loads(stdout.strip().splitlines()[-1])["results"]
    none, shadow, eplb = rows["baseline"], rows["baseline+fastermoe"], rows["baseline+eplb"]
    expert_params = 32 * 64 + 64 * 32 + 64 + 32  # w1, w2, b1, b2 of one expert (gelu, biases)
    router = 8 * 32 * 4  # [E, h] fp32
    for row, experts in ((none, 4), (shadow, 4), (eplb, 5)):  # EPLB: (8 + 2 redundant) / 2 slots, all distinct
        memory = row["memory_per_rank"]
        assert memory["param_bytes"] == [experts * expert_params * 4 + router] * 2, memory
        assert memory["adam_state_bytes"] == [2 * b for b in memory["param_bytes"]]
    assert sum(shadow["memory_per_rank"]["replica_param_bytes"]) == shadow["bytes_all_ranks"]["agg/ep_side"] > 0
    assert none["memory_per_rank"]["replica_param_bytes"] == [0, 0] == eplb["memory_per_rank"]["replica_param_bytes"]
    flex = rows["baseline+flexmoe:best_effort"]
    assert flex["max_abs_diff_vs_baseline"] < 1e-5
    assert flex["vexpert_move_ms"]["exposed"] <= flex["vexpert_move_ms"]["total"] + 1e-9
    assert eplb["balance_ratio"] < none["balance_ratio"] and eplb["replicas"] >= 1 and eplb["vexpert_moves"] > 0
    assert eplb["vexpert_move_bytes_all_ranks"] > 0 and eplb["max_abs_diff_vs_baseline"] < 1e-5
    assert none["balance_ratio"] > 1.5 and none["replicas"] == 0 and none["trans_bytes"] == 0  # skewed
    assert shadow["balance_ratio"] < none["balance_ratio"] and shadow["replicas"] >= 1
    assert shadow["max_abs_diff_vs_baseline"] < 1e-5
    assert shadow["bytes_all_ranks"]["trans/ep_side"] == shadow["replicas"] * expert_params * 4
    assert shadow["bytes_all_ranks"]["agg/ep_side"] == shadow["replicas"] * expert_params * 4


def test_benchmark_deepspeed_row_computes_the_same_layer():
    """The `deepspeed` row (issue #9 item 6) appears whenever DeepSpeed is importable and runs
    DeepSpeed-MoE's layer on the baseline's weights: the same output and input gradient, here at
    tensor 2 (issue #16: DeepSpeed gets our TP group as its mpu and drops TP-duplicate tokens)."""
    stdout = torchrun(4, "benchmarks/moe_layer.py", "--tensor", "2", "--expert", "2", "--rows", "baseline", "--reps", "1",
                      "--warmup", "0", "--batch", "2", "--seq", "16", "--hidden", "32", "--ffn", "64",
                      "--profile", "configs/hardware/cpu_gloo_2proc.yaml")  # no start-up calibration (~50 s)
    out = json.loads(stdout.strip().splitlines()[-1])
    if importlib.util.find_spec("deepspeed") is None:
        assert out["config"]["deepspeed_row"] == "deepspeed is not importable" and "deepspeed" not in out["results"]
    else:
        assert out["config"]["deepspeed_row"] == "present"
        assert out["results"]["deepspeed"]["max_abs_diff_vs_baseline"] < 1e-5


def test_proprophet_planner_benchmark_reports_speed_and_quality(tmp_path):
    """benchmarks/proprophet_planner.py (issue #10): the shipped 2-process CPU profile drives the
    cost model; Alg. 1's plans balance the skewed loads and stay near the exhaustive optimum."""
    proc = run_doc_command("README.md", "benchmarks/proprophet_planner.py", "--sizes", "8x2,64x64", "--reps", "2",
                           "--quality-cases", "30", cwd=tmp_path)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert set(out["speed"]) == {"8x2", "64x64"}
    for size in out["speed"].values():
        assert size["search_ms"] > 0 and size["placement_ms"] > 0 and size["replicas"] > 0
        assert size["balance_ratio_after"] < size["balance_ratio_before"]
        assert size["predicted_ms_after"] < size["predicted_ms_before"]
    quality = out["quality"]
    assert quality["cases"] == 30 and 1.0 <= quality["mean_ratio_to_optimum"] < 1.02 and quality["worst_ratio"] < 1.13


def test_proprophet_model_check_predicts_eq_1_to_5(tmp_path):
    """tools/proprophet_model_check.py on 2 processes with a given profile: every op of a placement
    with a replica is measured, and the predictions are Eq. 1-5 of that profile, by hand."""
    profile = tmp_path / "p.yaml"
    profile.write_text("name: p\np2p: {alpha: 1.0e-4, beta: 2.0e-9}\nexpert_compute: {alpha: 1.0e-4, beta: 5.0e-11}\n")
    hidden, ffn, rows = 32, 64, 256
    stdout = run_doc_command("README.md", "tools/proprophet_model_check.py", "--hidden", hidden, "--ffn", ffn, "--rows",
                             rows, "--skews", "0,1.6", "--reps", "2", "--profile", profile, cwd=tmp_path).stdout
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["world_size"] == 2 and len(out["cases"]) == 2
    for case in out["cases"]:
        assert case["replicas"] >= 1 and all(v > 0 for v in case["measured_ms"].values()), case
        predicted = case["predicted_ms"]
        # Eq. 4 = Eq. 5: replicas x (w1 [h, f] + w2 [f, h]) elements x 1/B / D devices
        assert predicted["trans"] == predicted["agg"] == pytest.approx(
            case["replicas"] * 2 * hidden * ffn * 2.0e-9 / 2 * 1e3, rel=1e-3)
        # Eq. 2 >= the balanced share of all rows: E rows x 2 h f x 2 FLOPs x beta / D
        assert predicted["fec"] >= 2 * rows * 4 * hidden * ffn * 5.0e-11 / 2 * 1e3 * (1 - 1e-3)
        assert case["predicted_with_alpha_ms"]["a2a"] == pytest.approx(predicted["a2a"] + 0.1, rel=1e-3)
    assert 0 <= out["mean_rel_error_all"] and set(out["mean_rel_error"]) == {"a2a", "fec", "trans", "agg"}


def test_train_throughput_runs_the_same_model_as_hugging_face():
    """benchmarks/train_throughput.py (issue #16): equal parameter counts, the same first-step loss
    from the same weights (ours eager, ours compiled, HF), and a step time per side and the matmul floor."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "model.num_layers=1", "model.seq_length=32",
                           "training.micro_batch_size=2", "--steps", "1", "--warmup", "0"],
                          capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["parameters"]["ours"] == out["parameters"]["hf"] > 0
    assert out["loss_diff"] < 1e-4 and out["first_step_lm_loss"]["ours"] == pytest.approx(6.93, abs=0.2)  # ~ln 1024
    assert out["compiled_loss_diff"] < 1e-5  # training.compile computes the same model
    assert min(out["step_ms"].values()) > 0 and set(out["step_ms"]) == {"ours", "ours_compiled", "hf"}
    assert out["matmul_floor_ms"] > 0
    ms = out["step_ms"]  # one round: each ratio is that round's (the median over rounds, in general)
    assert out["ours_vs_hf"] == pytest.approx(ms["hf"] / ms["ours"], rel=1e-2)
    assert out["ours_vs_floor"] == pytest.approx(ms["ours"] / out["matmul_floor_ms"], rel=3e-2)  # ms rounded to 0.1
    machine = out["machine"]  # what the numbers depend on (docs/performance.md)
    assert machine["cpu"] and machine["cpu_cores"] >= machine["usable_cores"] >= 1 and machine["torch_threads"] == 1
    assert machine["torch"] == torch.__version__ and len(machine["load_average"]) == 2
    assert machine["cuda_device"] == (torch.cuda.get_device_name() if torch.cuda.is_available() else None)


def test_train_throughput_bf16_sides():
    """--precision bf16 (issue #29): ours bf16 and fp32, HF fp32, autocast and bf16, all from the
    same weights (first-step losses agree to bf16 rounding), the ratios and a peak per side."""
    pytest.importorskip("transformers")
    proc = subprocess.run([sys.executable, "benchmarks/train_throughput.py", "model.num_layers=1", "model.seq_length=32",
                           "training.micro_batch_size=2", "--steps", "1", "--warmup", "0", "--precision", "bf16",
                           "--no-compile"], capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    sides = {"ours", "hf", "ours_fp32", "hf_autocast", "hf_bf16"}
    assert set(out["step_ms"]) == set(out["peak_mb"]) == sides and min(out["peak_mb"].values()) > 0
    first = out["first_step_lm_loss"]
    assert all(abs(first[s] - first["ours_fp32"]) < 2e-2 * first["ours_fp32"] for s in sides)  # a few bf16 ulps
    ms = out["step_ms"]
    assert out["ours_vs_best_hf_bf16"] == pytest.approx(min(ms["hf_autocast"], ms["hf_bf16"]) / ms["ours"], rel=1e-2)
    assert out["ours_vs_ours_fp32"] == pytest.approx(ms["ours_fp32"] / ms["ours"], rel=1e-2) and out["peak_vs_fp32"] > 0
    assert out["matmul_floor_ms"] > 0 and "training.precision=bf16" in out["config"]["overrides"]


def test_bf16_loss_curve_over_seeds():
    """benchmarks/bf16_loss_curve.py --seeds (issue #29): each seed trains fp32 and bf16 from its
    own initial weights; the seed-averaged curves are the mean of the seeds' curves, and their gaps
    are reported next to each seed's."""
    proc = subprocess.run([sys.executable, "benchmarks/bf16_loss_curve.py", "--iters", "3", "--seeds", "1,2",
                           "training.micro_batch_size=1"], capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["config"]["seeds"] == [1, 2] and [run["seed"] for run in out["per_seed"]] == [1, 2]
    first, second = (run["loss_at"] for run in out["per_seed"])
    assert first["fp32"]["1"] != second["fp32"]["1"]  # other initial weights
    for precision in ("fp32", "bf16"):
        for i in ("1", "3"):
            mean = (first[precision][i] + second[precision][i]) / 2
            assert out["loss_at_seed_mean"][precision][i] == pytest.approx(mean, abs=1e-4), (precision, i)
    for gaps in (out["seed_mean"], *out["per_seed"]):
        assert 0 <= gaps["mean_rel_gap"] <= gaps["max_rel_gap"] < 0.05


def test_recompute_benchmark_keeps_the_loss(one_thread):
    """benchmarks/recompute.py (issue #16): each level's step (run here in this process: the
    benchmark gives each its own process only so that peaks do not mix) has the plain step's loss
    and grad norm, and a step time and peak."""
    spec = importlib.util.spec_from_file_location("recompute_benchmark", "benchmarks/recompute.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    shape = ["model.num_layers=1", "model.seq_length=64", "model.dropout=0.1", "--steps", "1"]
    runs = {level: bench.run_level(bench.parse_args(shape + ["--level", level])) for level in bench.LEVELS}
    for level, run in runs.items():
        assert run["loss"] == runs["none"]["loss"] and run["grad_norm"] == pytest.approx(runs["none"]["grad_norm"],
                                                                                           rel=1e-6), level
        assert run["step_ms"] > 0 and run["peak_rss_mb"] > 0


def test_expert_scaling_sweeps_the_number_of_experts(tmp_path):
    """benchmarks/expert_scaling.py (issue #16): one training run per E, the same tokens, the step
    split into forward / backward / optimizer, expert parameters growing with E."""
    proc = subprocess.run([sys.executable, "benchmarks/expert_scaling.py", "--experts", "4,8", "--iters", "2",
                           "--warmup", "1", "--reps", "1"], capture_output=True, text=True, timeout=240, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])["results_ms"]
    assert set(results) == {"4", "8"} and results["4"]["step_vs_smallest_E"] == 1.0
    for r in results.values():
        assert r["step"] > 0 and r["forward"] > 0 and r["backward"] > 0
    assert results["8"]["local_parameters"] > results["4"]["local_parameters"]


def test_lancet_benchmark_defers_wgrad_without_changing_gradients(tmp_path):
    """benchmarks/lancet.py (issue #12): the same GPT-MoE plain, with `moe.lancet.defer_wgrad`, with
    2 batch parts and with both; the deferred dW ran inside backward all-to-alls, the parts'
    forward all-to-alls partly under the other part's computation, and every gradient is the plain
    model's."""
    stdout = run_doc_command("README.md", "benchmarks/lancet.py", "--reps", "2", "--warmup", "0", "--batch", "2",
                             cwd=tmp_path).stdout  # README's: 2 processes, --expert 2
    out = json.loads(stdout.strip().splitlines()[-1])["results"]
    assert out["max_abs_grad_diff"] < 1e-6
    assert out["partitions"]["segments"] == [[0, 3, 2], [3, 4, 2]]  # range 1 on 2 MoE layers
    assert out["partitions"]["a2a_exposed_ms_forward"] < out["partitions"]["a2a_total_ms_forward"]
    for name in ("plain", "defer_wgrad", "partitions", "both"):
        assert out[name]["ms_median"] > 0 and out[name]["a2a_total_ms_backward"] > 0
        assert out[name]["a2a_exposed_ms_backward"] <= out[name]["a2a_total_ms_backward"]
    assert out["plain"]["a2a_exposed_ms_backward"] == out["plain"]["a2a_total_ms_backward"]  # synchronous
    assert out["defer_wgrad"]["wgrad_overlapped_ms"] > 0  # calibrated all-to-all budget: each takes dW until covered


def test_grouped_gemm_benchmark_compares_the_dw_kernels():
    """benchmarks/grouped_gemm.py (issue #16): every dW kernel's accumulated gradient equals
    autograd's (the benchmark checks and stops otherwise), and the chooser's decisions are reported."""
    proc = subprocess.run([sys.executable, "benchmarks/grouped_gemm.py", "--shapes", "8x256x8x16,64x64x8x16",
                           "--micro-batches", "2", "--reps", "1"], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])["results"]
    assert set(results["8x256x8x16"]["ms"]) == {"autograd", "padded", "native_temp", "per_group", "chosen"}
    assert results["64x64x8x16"]["padding_pays"] and not results["8x256x8x16"]["padding_pays"]  # 1 vs 32 rows a group


def test_pipeline_benchmark_reports_the_bubble_next_to_its_formula(tmp_path):
    """benchmarks/pipeline.py (issue #14): 1F1B and interleaved rows on 2 stages, each with the
    ideal bubble (p-1)/(vm+p-1), the measured and simulated ones, the cluster simulator's prediction
    and the exact activation bytes."""
    shape = ["--override", "model.hidden_size=32", "--override", "model.ffn_hidden_size=64", "--override",
             "moe.expert_ffn_hidden_size=64", "--override", "model.seq_length=16", "--override", "model.num_layers=4"]
    proc = run_doc_command("README.md", "benchmarks/pipeline.py", "--micro-batches", "2", "--iters", "2",
                           "--warmup", "1", "--memory-nproc", "0", *shape, cwd=tmp_path)
    rows = {r["schedule"]: r for r in json.loads(proc.stdout.strip().splitlines()[-1])["bubble"]}
    assert rows["1f1b"]["bubble_ideal"] == pytest.approx(1 / 3, abs=1e-4)  # (2-1)/(2+2-1)
    assert rows["interleaved"]["bubble_ideal"] == pytest.approx(1 / 5, abs=1e-4)  # (2-1)/(2*2+2-1)
    activation = 2 * 16 * 32 * 4  # micro-batch 2 x seq 16 x hidden 32, fp32
    assert rows["1f1b"]["pipeline_bytes_rank0"] == 2 * activation  # m activations forward
    assert rows["interleaved"]["pipeline_bytes_rank0"] == 3 * 2 * activation  # two chunks' outputs + one's input grads
    for row in rows.values():
        assert 0.0 < row["bubble_measured"] < 1.0 and 0.0 < row["bubble_simulated"] < 1.0
        assert 0.0 < row["bubble_predicted"] < 1.0


@pytest.mark.gpu
def test_moe_layer_benchmark_smoke_on_gpus():
    """`make test-gpu`'s benchmark run: benchmarks/moe_layer.py on 2 GPUs (NCCL) with every row,
    FasterMoE and Pro-Prophet's block-wise scheduler over 2 layers, with and without the smart
    schedule, and the hardware profile calibrated at start-up on the GPUs. Every row computes the
    baseline's output, and every op kind was timed (CUDA events, perf/timing.py)."""
    from tests.distributed.harness import require_gpus

    require_gpus(2)
    stdout = torchrun(2, "benchmarks/moe_layer.py", "--expert", "2", "--balancer", "none,fastermoe,proprophet:overlap",
                      "--layers", "2", "--min-shadow", "1", "--min-replicas", "1", "--smart", "--reps", "3",
                      "--warmup", "1", timeout=600)
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["config"]["device"].startswith("cuda")
    rows = out["results"]
    assert {"baseline", "auto_saa+proprophet:overlap", "auto+fastermoe+smart"} <= set(rows)
    assert not any(name.startswith("s2_saa") for name in rows)  # refused at tensor 1
    for name, row in rows.items():
        assert 0 < row["ms_median"] < 1e4 and row["max_abs_diff_vs_baseline"] < 1e-4, (name, row)
        assert set(row["total_ms"]) >= {key.split("/")[0] for key in row["bytes"]}, name
        assert sum(row["total_ms"].values()) > 0, name
    assert rows["baseline+fastermoe"]["replicas"] >= 1 and rows["baseline+proprophet:overlap"]["replicas"] >= 1
