"""The model features of issue #45 (item 6) composed with the parallel layouts, against one process: the
tiny configs of each family (configs/*_tiny.yaml at hidden 32, 4 layers, 4 experts, seq 16), ITERS
iterations of the Trainer on 4 ranks (one spawn), every iteration's loss, aux loss, MTP loss, grad
norm, the final evaluation's loss and the per-layer loads (tests/distributed/test_pipeline.py's
`_same_run`: rel 1e-5 in fp32):

* DeepSeek-V3 (MLA with q_lora_rank, YaRN with mscale_all_dim, the first layer dense, MTP depth 1,
  sigmoid routing with expert bias and router groups, a shared expert) on pipeline=2 expert=2 with
  FlexMoE moving vExperts every iteration (the MTP layer's too), and
  on pipeline=2 tensor=2 interleaved (2 virtual stages: MTP in the last model chunk);
* gpt-oss (attention sinks, a 5-token sliding window on alternating layers, q/k/v/o biases, router
  and expert biases, the clamped SwiGLU with a limit that clamps, YaRN with truncate false) on
  pipeline=2 expert=2 with EPLB moving slots every iteration (the expert biases move with them),
  and on tensor=2 (dp 2) with ZeRO-1 (`optimizer.distributed`);
* GLM-4.5 (rotary on half of each head, q/k/v biases without an output bias, the first layer
  dense, sigmoid + expert bias + shared expert, MTP) on pipeline=2 (dp 2) in bf16 with full
  recomputation, against the single-process bf16 run (tests/distributed/test_bf16.py's tolerances);
* `training.compile` with each family: DeepSeek-V3 on tensor=2 expert=2 with ZeRO-1, gpt-oss on
  expert=2 (dp 2) with selective recomputation, GLM-4.5 on tensor=2 expert=2 (fp32 tolerances:
  Inductor's kernels round differently, within them).

On NCCL (`make test-gpu`, 2 GPUs: a GPU node may have only 2): each family on one two-rank layout,
DeepSeek-V3 on tensor=2 (MLA's heads split over TP, MTP), gpt-oss on expert=2 (sinks and windows on
CUDA, expert biases) and GLM-4.5 on pipeline=2 (MTP on the last stage), fp32, against one process on
the test's GPU (NCCL_JOBS).

The same spawn runs the gpt-oss MoE layer (moe_cases case 6: router bias, expert biases, swiglu_oss)
on expert=2 (dp 2) under Parm's S1, S2 + SAA and auto and FasterMoE's smart schedule, against
tests/moe_reference.py (baseline: test_moe_baseline.py; node_dedup: test_node_dedup.py).
"""
import pytest

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets
from tests.distributed.harness import require_gpus, run_distributed
from tests.distributed.moe_cases import check_against_reference, run_on_layouts
from tests.distributed.test_bf16 import LOSS_RTOL, NORM_RTOL
from tests.distributed.test_moe_parm import TESTBED_B
from tests.distributed.test_pipeline import _same_run, _with_valid

pytestmark = pytest.mark.distributed

ITERS = 3
COMMON = [f"training.train_iters={ITERS}", "training.log_interval=1", f"training.eval_interval={ITERS}",
          "training.eval_iters=1", "training.micro_batch_size=1", "training.global_batch_size=8",
          "model.seq_length=16", "model.num_layers=4", "model.hidden_size=32", "model.ffn_hidden_size=32",
          "model.vocab_size=125", "moe.num_experts=4", "moe.top_k=2", "moe.expert_ffn_hidden_size=16",
          "moe.aux_loss_coeff=0.1", "logging.tensorboard=false", "optimizer.warmup_iters=1",
          "checkpoint.load=null", "checkpoint.save_interval=0"]
FAMILIES = {  # name: (config, tiny overrides)
    "deepseek_v3": ("configs/deepseek_v3_tiny.yaml", [
        "model.q_lora_rank=16", "model.kv_lora_rank=12", "model.qk_nope_head_dim=8", "model.qk_rope_head_dim=8",
        "model.v_head_dim=8", "moe.router_groups=2", "moe.router_group_topk=1", "moe.shared_expert_ffn_hidden_size=16",
        "model.rope_scaling.type=yarn", "model.rope_scaling.factor=4", "model.rope_scaling.original_max_position_embeddings=8",
        "model.rope_scaling.mscale=1.0", "model.rope_scaling.mscale_all_dim=1.0"]),
    "gpt_oss": ("configs/gpt_oss_tiny.yaml", [
        "model.num_attention_heads=4", "model.head_dim=8", "model.sliding_window=5", "moe.swiglu_limit=1.0",
        "model.layer_types=[sliding_attention,full_attention,sliding_attention,full_attention]",
        "model.rope_scaling.original_max_position_embeddings=8"]),
    "glm45": ("configs/glm45_tiny.yaml", ["model.head_dim=8", "moe.shared_expert_ffn_hidden_size=16"]),
}
PP2, BF16 = ["parallel.pipeline=2"], ["training.precision=bf16"]
TP2_EP2, TP2_EP2_KEYS = dict(tensor=2, expert=2), ["parallel.tensor=2", "parallel.expert=2"]
JOBS = {  # name: (family, layout kwargs, overrides; the reference: the family's single-process run)
    "deepseek_v3 pp2-ep2-flexmoe": ("deepseek_v3", dict(pipeline=2, expert=2), PP2 + [
        "parallel.expert=2", "moe.balancer=flexmoe", "moe.flexmoe.interval=1", "moe.flexmoe.threshold=1.0"]),
    "deepseek_v3 pp2-tp2-vs2": ("deepseek_v3", dict(pipeline=2, tensor=2), PP2 + [
        "parallel.tensor=2", "parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2"]),
    "gpt_oss pp2-ep2-eplb": ("gpt_oss", dict(pipeline=2, expert=2), PP2 + [
        "parallel.expert=2", "moe.balancer=eplb", "moe.eplb.interval=1"]),
    "gpt_oss tp2-zero1": ("gpt_oss", dict(tensor=2), ["parallel.tensor=2", "optimizer.distributed=true"]),
    "glm45 pp2-bf16-recompute": ("glm45", dict(pipeline=2), PP2 + BF16 + ["training.recompute=full"]),
    # training.compile (TorchInductor, model/compile.py) with each family's attention and MoE layer
    "deepseek_v3 tp2-ep2-zero1-compile": ("deepseek_v3", TP2_EP2, TP2_EP2_KEYS + [
        "optimizer.distributed=true", "training.compile=true"]),
    "gpt_oss ep2-compile-selective": ("gpt_oss", dict(expert=2), [
        "parallel.expert=2", "training.compile=true", "training.recompute=selective"]),
    "glm45 tp2-ep2-compile": ("glm45", TP2_EP2, TP2_EP2_KEYS + ["training.compile=true"]),
}
NCCL_JOBS = {  # on 2 GPUs (`make test-gpu`): each family on one two-rank layout, fp32
    "deepseek_v3 tp2": ("deepseek_v3", dict(tensor=2), ["parallel.tensor=2"]),
    "gpt_oss ep2": ("gpt_oss", dict(expert=2), ["parallel.expert=2"]),
    "glm45 pp2": ("glm45", dict(pipeline=2), PP2),
}
LAYER_RUNS = [("s1", False, False), ("s2", True, False), ("auto", True, False), ("baseline", False, True),
              ("s2", False, True)]  # (moe.schedule, moe.saa, moe.smart_schedule) on moe_cases case 6
OSS_CASE = 6


def _train(state, tmp: str, family: str, overrides) -> list:
    path, tiny = FAMILIES[family]
    name = "-".join(o.split("=")[0].split(".")[-1] for o in overrides) or "one"
    cfg = load_config(path, COMMON + tiny + list(overrides)
                      + [f"training.run_dir={tmp}/{family}-{name}-{state.world_size}", f"checkpoint.dir={tmp}/ckpt"])
    keys = ("iteration", "loss", "aux_loss", "mtp_loss", "grad_norm", "eval_loss", "balance_degree", "vexpert_ops_total")
    return [{k: r[k] for k in keys if k in r} for r in Trainer(cfg, state, datasets=_with_valid(synthetic_datasets)).train()]


def _layer_setup(run):
    schedule, saa, smart = run

    def edit(cfg, sub):
        cfg.moe.schedule, cfg.moe.saa, cfg.moe.smart_schedule = schedule, saa, smart
        cfg.perf.hardware_profile = TESTBED_B

    return OSS_CASE, edit


def _spawned(state, tmp, jobs=None, extra=()):
    """{job name: its records} of `jobs` (JOBS, and then the gpt-oss layer runs) with `extra` overrides."""
    out = {}
    for name, (family, kwargs, overrides) in (jobs or JOBS).items():
        sub = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank)
        out[name] = _train(sub, tmp, family, list(overrides) + list(extra))
    if jobs is None:
        out["layer"] = [result for result, _ in run_on_layouts(state, [dict(expert=2)], LAYER_RUNS, _layer_setup)[0]]
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = str(tmp_path_factory.mktemp("families"))
    outputs = run_distributed(4, _spawned, dict(expert=2), (tmp,), timeout=1500)
    one = ParallelState.single_process()
    refs = {(family, bf16): _train(one, tmp, family, BF16 if bf16 else [])
            for family, bf16 in {(family, "bf16" in name) for name, (family, _, _) in JOBS.items()}}
    return outputs, refs


@pytest.mark.parametrize("name", list(JOBS))
def test_family_layouts_train_like_one_process(name, runs):
    outputs, refs = runs
    family = JOBS[name][0]
    bf16 = "bf16" in name
    _check_family(name, family, outputs, refs[(family, bf16)], bf16)


@pytest.mark.gpu
def test_families_on_two_gpus_train_like_one_gpu(tmp_path):
    """NCCL_JOBS on 2 GPUs against one process on this process's GPU (fp32 tolerances)."""
    require_gpus(2)
    on = ["parallel.backend=nccl"]
    outputs = run_distributed(2, _spawned, dict(tensor=2), (str(tmp_path), NCCL_JOBS, on), timeout=900, backend="nccl")
    one = ParallelState.single_process()
    refs = {family: _train(one, str(tmp_path), family, on) for family in {job[0] for job in NCCL_JOBS.values()}}
    for name, (family, _, _) in NCCL_JOBS.items():
        _check_family(name, family, outputs, refs[family], False)


def _check_family(name, family, outputs, ref, bf16):
    """Every rank's records of job `name` are the single-process run `ref`'s; MTP and loads recorded."""
    tolerances = dict(loss=LOSS_RTOL, aux_loss=LOSS_RTOL, mtp_loss=LOSS_RTOL, eval_loss=LOSS_RTOL, grad_norm=NORM_RTOL)
    for rank, out in enumerate(outputs):
        _same_run(out[name], ref, f"{name} rank {rank}", rel=tolerances if bf16 else None)
    records = outputs[0][name]
    assert records[0].get("mtp_loss", 0) > 0 or family == "gpt_oss", name
    # MoE layers 1-3 (the first dense in DeepSeek-V3 and GLM-4.5) and the MTP layer: every stage's
    assert len(records[0]["balance_degree"]) == 4, name
    if "eplb" in name or "flexmoe" in name:
        assert sum(records[-1]["vexpert_ops_total"].values()) > 0, name  # slots (and their expert biases) moved


def test_gpt_oss_moe_layer_under_every_schedule(runs):
    outputs, _ = runs
    layout = RankLayout(world_size=4, expert=2)
    for i, run in enumerate(LAYER_RUNS):
        check_against_reference([out["layer"][i] for out in outputs], OSS_CASE, layout, f"{run}")
