"""Pipeline stages and the distributed optimizer against one process (issue #14): the Trainer on
pipeline=2 (4 ranks: data parallel 2), pipeline=2 with 2 virtual stages (interleaved 1F1B) and
pipeline=2 tensor=2 expert=2 with Parm's S2 + SAA (8 ranks), each with and without
`optimizer.distributed`, GPT (dropless) and BERT (capacity 1.0, binary head): 6 iterations, the loss,
aux loss, binary loss, grad norm (rel 1e-5), the final evaluation's loss through the forward-only
pipeline and the per-layer loads (gathered over the stages) equal one process's. Point-to-point
bytes, the optimizer state per rank and the bubble metric are checked too.

The 8-rank GPT run with the distributed optimizer saves checkpoints after iterations 3 and 6; the
first is resumed on one process (plain AdamW) and on pipeline=1 expert=4 with the distributed
optimizer (sharded over 4 data-parallel ranks): iterations 4-6 equal the uninterrupted run's.
Pipeline stages with other techniques, on pipeline=2 expert=2: EPLB's vExperts moving every
iteration with full recomputation on an uneven split (1 + 3 layers), and Pro-Prophet's block-wise
scheduler with Lancet's deferred weight gradients. One spawn per world size (8 ranks first: the 4-rank spawn resumes its checkpoint).
Everything runs on gloo, and on NCCL with a GPU per rank (`make test-gpu`; the references then
run on one GPU)."""
import hashlib
from typing import Dict

import pytest

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState, RankLayout
from megatron_moe.model.bert import BertMoEModel
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_bert_datasets, synthetic_datasets
from tests.distributed.harness import BACKENDS, run_distributed

pytestmark = pytest.mark.distributed

ITERS = 6
COMMON = [f"training.train_iters={ITERS}", "training.log_interval=1", f"training.eval_interval={ITERS}",
          "training.eval_iters=1", "training.micro_batch_size=1", "training.global_batch_size=8",
          "model.seq_length=16", "model.dropout=0.0", "model.num_layers=4", "model.vocab_size=125",
          "logging.tensorboard=false", "optimizer.warmup_iters=1",
          "moe.aux_loss_coeff=0.1"]  # aux losses weigh in: one missing or counted twice moves the grad norm
MODELS = {"gpt": ("configs/gpt_moe_tiny.yaml", GPTMoEModel, synthetic_datasets, []),
          "bert": ("configs/bert_moe_tiny.yaml", BertMoEModel, synthetic_bert_datasets, ["moe.capacity_factor=1.0"])}
PP2 = ["parallel.pipeline=2"]
LAYOUTS = {  # name: (world, RankLayout kwargs, overrides, pipeline bytes rank 0 sends per iteration)
    "pp2": (4, dict(pipeline=2), PP2, 4 * 4096),  # 4 micro-batches x [1, 16, 64] fp32 activations
    "pp2-vs2": (4, dict(pipeline=2), PP2 + ["parallel.pipeline_schedule=interleaved", "parallel.virtual_stages=2"],
                12 * 4096),  # model chunks 0 and 2 send on, chunk 2 sends gradients back to chunk 1
    "pp2-tp2-ep2-s2-saa": (8, dict(pipeline=2, tensor=2, expert=2),
                           PP2 + ["parallel.tensor=2", "parallel.expert=2", "moe.schedule=s2", "moe.saa=true"], 4 * 4096),
}
DIST = ["optimizer.distributed=true"]
PP2_EP2 = PP2 + ["parallel.expert=2"]
COMBINED = {  # name: overrides on pipeline=2 expert=2 (4 ranks), GPT
    "eplb-recompute": PP2_EP2 + ["moe.balancer=eplb", "moe.eplb.interval=1", "training.recompute=full",
                                 "parallel.pipeline_layers=[1,3]"],  # an uneven split too
    "proprophet-lancet": PP2_EP2 + ["moe.balancer=proprophet", "moe.proprophet.overlap=true",
                                    "moe.proprophet.min_replicas=1", "moe.lancet.defer_wgrad=true",
                                    "perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"],
}
SAVER = ("pp2-tp2-ep2-s2-saa", "gpt", True)  # saves after iterations 3 and 6


def _with_valid(datasets):
    def build(cfg):
        train, _ = datasets(cfg)
        return train, train  # the evaluation reads global batch 0 again

    return build


def _train(state, tmp: str, model: str, overrides) -> list:
    path, model_cls, datasets, extra = MODELS[model]
    run_dir = f"{tmp}/{model}-{hashlib.sha1(repr(overrides).encode()).hexdigest()[:8]}-{state.world_size}"
    cfg = load_config(path, COMMON + extra + list(overrides) + [f"training.run_dir={run_dir}"])
    trainer = Trainer(cfg, state, model_cls, _with_valid(datasets))
    keys = ("iteration", "loss", "aux_loss", "grad_norm", "binary_loss", "mtp_loss", "eval_loss", "balance_degree",
            "pipeline_bubble", "pipeline_bubble_ideal", "vexpert_ops_total", "moe_replicas")
    return [{**{k: r[k] for k in keys if k in r}, "pipeline_bytes": r["comm_bytes"].get("pipeline", 0),
             "optimizer_state_mb": r["optimizer_state_mb"][f"rank{state.rank}"]} for r in trainer.train()]


def _jobs(state, jobs, tmp):
    """Every job (layout kwargs, model, overrides) on this rank, one ParallelState per layout."""
    states: Dict[str, ParallelState] = {}
    out = []
    for kwargs, model, overrides in jobs:
        if str(kwargs) not in states:
            states[str(kwargs)] = ParallelState.build(RankLayout(world_size=state.world_size, **kwargs), state.rank)
        out.append(_train(states[str(kwargs)], tmp, model, overrides))
    return out


def _save(tmp) -> list:
    return DIST + [f"checkpoint.dir={tmp}/ckpt", "checkpoint.save_interval=3", "checkpoint.keep_last=0"]


def _resume(tmp) -> list:
    return [f"checkpoint.load={tmp}/ckpt/iter_0000003", "checkpoint.save_interval=0"]


def _spawn(world: int, tmp, backend: str, extra_jobs=()) -> Dict[tuple, list]:
    """{(layout name, model, distributed): rank 0's records} of every run on `world` ranks."""
    runs = [(name, model, dist) for name, (w, _, _, _) in LAYOUTS.items() if w == world
            for model in MODELS for dist in (False, True)]
    jobs = [(LAYOUTS[name][1], model, LAYOUTS[name][2] + (DIST if dist else [])
             + (_save(tmp) if (name, model, dist) == SAVER else [])) for name, model, dist in runs]
    jobs = [(kwargs, model, overrides + [f"parallel.backend={backend}"])
            for kwargs, model, overrides in jobs + list(extra_jobs)]
    outputs = run_distributed(world, _jobs, jobs[0][0], (jobs, str(tmp)), timeout=900, backend=backend)
    per_rank = list(zip(*outputs))  # [job][rank]
    results = {run: per_rank[i] for i, run in enumerate(runs)}
    results.update({("extra", i): per_rank[len(runs) + i] for i in range(len(extra_jobs))})
    return results


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request):
    return request.param


@pytest.fixture(scope="module")
def tmp(tmp_path_factory, backend):
    return tmp_path_factory.mktemp(f"pipeline-{backend}")


@pytest.fixture(scope="module")
def reference(tmp, backend):
    return {model: _train(ParallelState.single_process(), str(tmp), model, [f"parallel.backend={backend}"])
            for model in MODELS}


@pytest.fixture(scope="module")
def world8(tmp, reference, backend):
    return _spawn(8, tmp, backend)


@pytest.fixture(scope="module")
def world4(tmp, world8, backend):  # after world8: resumes the checkpoint it saved
    return _spawn(4, tmp, backend,
                  extra_jobs=[(dict(expert=4), "gpt", ["parallel.expert=4"] + DIST + _resume(tmp))]
                  + [(dict(pipeline=2, expert=2), "gpt", overrides) for overrides in COMBINED.values()])


def _same_run(got, want, label, rel=None):
    rel = rel or {}
    assert [r["iteration"] for r in got] == [r["iteration"] for r in want], label
    for a, b in zip(got, want):
        for key in ("loss", "aux_loss", "grad_norm", "binary_loss", "mtp_loss", "eval_loss"):
            assert (key in a) == (key in b), (label, key)
            if key in b:
                assert a[key] == pytest.approx(b[key], rel=rel.get(key, 1e-5)), (label, a["iteration"], key, a[key], b[key])
        # per-layer loads (every stage's MoE layers, in layer order) are layout-invariant
        if not rel:
            assert a["balance_degree"] == pytest.approx(b["balance_degree"], rel=1e-9, abs=1e-9), label


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_layouts_train_like_one_process(name, reference, world4, world8):
    world, _, _, pipeline_bytes = LAYOUTS[name]
    results = world8 if world == 8 else world4
    for model in MODELS:
        plain, dist = results[(name, model, False)], results[(name, model, True)]
        for rank_records, label in ((plain, "adamw"), (dist, "distributed")):
            _same_run(rank_records[0], reference[model], f"{name} {model} {label}")
            assert len(rank_records[0][0]["balance_degree"]) == 4  # all 4 MoE layers, from both stages
            records = rank_records[0]
            assert all(r["pipeline_bytes"] == pipeline_bytes for r in records), (name, records[0]["pipeline_bytes"])
            assert all(0.0 <= r["pipeline_bubble"] < 1.0 for r in records)
            assert records[0]["pipeline_bubble_ideal"] == pytest.approx(1 / (4 * (2 if "vs2" in name else 1) + 1))
        # ZeRO-1 over 2 data-parallel (and 2 expert-data-parallel) ranks: half the AdamW state per rank
        for rank in range(world):
            ratio = dist[rank][-1]["optimizer_state_mb"] / plain[rank][-1]["optimizer_state_mb"]
            assert ratio == pytest.approx(0.5, abs=0.01), (name, model, rank, ratio)


def test_checkpoint_from_pipeline_resumes_on_one_process_and_on_expert4(tmp, backend, reference, world8, world4):
    saved = world8[SAVER][0]
    _same_run(saved, reference["gpt"], "saving run")
    one = _train(ParallelState.single_process(), str(tmp), "gpt", _resume(tmp) + [f"parallel.backend={backend}"])
    _same_run(one, reference["gpt"][3:], "resumed on 1 process")
    ep4 = world4[("extra", 0)]
    _same_run(ep4[0], reference["gpt"][3:], "resumed on expert=4, distributed optimizer")


def test_pipeline_with_vexperts_recompute_proprophet_and_lancet(reference, world4):
    eplb, proprophet = (world4[("extra", 1 + i)][0] for i in range(len(COMBINED)))
    _same_run(eplb, reference["gpt"], "eplb + recompute")
    assert sum(eplb[-1]["vexpert_ops_total"].values()) > 0  # the slots moved (gathered over both stages)
    _same_run(proprophet, reference["gpt"], "proprophet overlap + lancet defer_wgrad")
    assert any(n > 0 for r in proprophet for n in r["moe_replicas"])  # replicas were placed


# Dense and MoE layers by position and multi-token prediction (issue #45 items 2-3) on 4 ranks: the
# first layer dense (`moe.first_k_dense`), MTP depth 1 (its MoE layer joins the balancer, the stats and
# the aux loss) with an untied output layer (the last stage then holds and syncs its own copy of the
# word table), against one process: pp2 (dp 2), pp2 x ep2 on an uneven split (1 + 3 layers), tp2 x ep2
# (dp 2) with Pro-Prophet's replicas, and bf16 on pp2 x tp2 (tied head) against the single-process bf16
# run (tests/distributed/test_bf16.py's tolerances: rel 8e-3 on the losses, 3e-2 on the grad norm).
MTP = ["model.mtp_depth=1", "moe.first_k_dense=1", "model.tie_embeddings=false", "training.mtp_loss_weight=0.5"]
MTP_BF16 = ["model.mtp_depth=2", "moe.first_k_dense=1", "training.precision=bf16", "training.train_iters=4",
            "training.eval_interval=4"]  # test_bf16.py's 4 iterations: bf16 rounding grows with every step
MTP_JOBS = {  # name: (layout kwargs, overrides, reference overrides)
    "pp2": (dict(pipeline=2), PP2 + MTP, MTP),
    "pp2-ep2-uneven": (dict(pipeline=2, expert=2), PP2_EP2 + MTP + ["parallel.pipeline_layers=[1,3]"], MTP),
    "tp2-ep2-proprophet": (dict(tensor=2, expert=2), MTP + ["parallel.tensor=2", "parallel.expert=2",
                                                            "moe.balancer=proprophet", "moe.proprophet.min_replicas=1",
                                                            "perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"],
                           MTP),
    "pp2-tp2-bf16": (dict(pipeline=2, tensor=2), PP2 + ["parallel.tensor=2"] + MTP_BF16, MTP_BF16),
}


@pytest.fixture(scope="module")
def mtp_runs(tmp, backend):
    """({name: rank 0's records} on 4 ranks, {name: the single-process reference})."""
    jobs = [(kwargs, "gpt", overrides + [f"parallel.backend={backend}"]) for kwargs, overrides, _ in MTP_JOBS.values()]
    outputs = run_distributed(4, _jobs, jobs[0][0], (jobs, str(tmp)), timeout=900, backend=backend)
    references = {}
    for name, (_, _, ref) in MTP_JOBS.items():
        if repr(ref) not in references:
            references[repr(ref)] = _train(ParallelState.single_process(), str(tmp), "gpt",
                                           ref + [f"parallel.backend={backend}"])
    per_rank = list(zip(*outputs))  # [job][rank]
    return ({name: per_rank[i][0] for i, name in enumerate(MTP_JOBS)},
            {name: references[repr(ref)] for name, (_, _, ref) in MTP_JOBS.items()})


def test_dense_layers_and_mtp_train_like_one_process(mtp_runs):
    runs, references = mtp_runs
    for name, records in runs.items():
        bf16 = "bf16" in name
        _same_run(records, references[name], name,
                  rel=dict(loss=8e-3, aux_loss=8e-3, mtp_loss=8e-3, eval_loss=8e-3, grad_norm=3e-2) if bf16 else None)
        assert records[0]["mtp_loss"] > 0
        # MoE layers 1-3 and the MTP layers (4, 5 with depth 2): balancer and stats see them, from every stage
        assert len(records[0]["balance_degree"]) == (5 if bf16 else 4), name
    assert any(n > 0 for r in runs["tp2-ep2-proprophet"] for n in r["moe_replicas"])
