"""bf16 training the Megatron way (issue #29, docs/precision.md), one process: bf16 parameters with
fp32 main gradients, AdamW on fp32 masters equal to torch's AdamW in fp32, checkpoints that hold
fp32 weights (fp32 <-> bf16 resume exactly, bf16 resumes bit for bit)."""
import math

import pytest
import torch

from megatron_moe.config import load_config
from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.model.gpt import GPTMoEModel
from megatron_moe.tensor_parallel.param_meta import ParamMeta, make_param
from megatron_moe.model.precision import cast_params_
from megatron_moe.moe import grouped_gemm
from megatron_moe.training.distributed_optimizer import DistributedOptimizer
from megatron_moe.training.mixed_precision import MixedPrecisionAdamW
from megatron_moe.training.optimizer import build_optimizer
from megatron_moe.training.trainer import Trainer
from tests.checkpoint_helpers import synthetic_datasets
from tests.tiny_model import tiny_model_steps

BASE = ["training.train_iters=4", "training.log_interval=1", "training.eval_interval=0",
        "training.micro_batch_size=2", "training.global_batch_size=4", "model.seq_length=16",
        "logging.tensorboard=false", "optimizer.warmup_iters=1", "model.vocab_size=128"]


def _config(tmp, name, extra=()):
    return load_config("configs/gpt_moe_tiny.yaml", BASE + [f"training.run_dir={tmp}/{name}", f"checkpoint.dir={tmp}/{name}-ckpt"]
                       + list(extra))


def _trainer(tmp, name, extra=()):
    return Trainer(_config(tmp, name, extra), ParallelState.single_process(), datasets=synthetic_datasets)


def _step_both(ours, theirs, params, ref, step: int) -> None:
    """One step of MixedPrecisionAdamW over bf16 `params` and of torch's AdamW over their fp32
    copies `ref`, with the same random gradients (fp32 main gradients for ours)."""
    ours.zero_grad()
    for p, r in zip(params, ref):
        r.grad = torch.randn(r.shape, generator=torch.Generator().manual_seed(step))
        p.main_grad.copy_(r.grad)
    ours.step()
    theirs.step()


def test_compiled_master_step_is_adamw():
    """`compiled=True` (training.compile): AdamW and the master -> bf16 copy as one compiled pass
    per group equal torch's AdamW on fp32 copies to fp32 rounding, each parameter's bias
    correction from its own step count (a state made fresh mid-run, as a vExpert move makes it),
    the parameters the bf16 rounding of the masters; a changing learning rate does not recompile."""
    from torch._dynamo.utils import counters
    one = ParallelState.single_process()
    torch.manual_seed(0)
    shapes = [(5, 3), (4, 3), (3,)]
    params = [make_param(ParamMeta("dense", shape, role="weight" if len(shape) == 2 else "bias"), one)
              for shape in shapes]
    for p in params:
        p.data.normal_()
    ref = [torch.nn.Parameter(p.detach().bfloat16().float()) for p in params]
    for p in params:
        p.data = p.data.bfloat16()
    ours = MixedPrecisionAdamW([{"params": params[:2], "weight_decay": 0.1},
                                {"params": params[2:], "weight_decay": 0.0}],
                               lr=1e-2, betas=(0.9, 0.95), eps=1e-8, compiled=True)
    theirs = torch.optim.AdamW([{"params": ref[:2], "weight_decay": 0.1}, {"params": ref[2:], "weight_decay": 0.0}],
                               lr=1e-2, betas=(0.9, 0.95), eps=1e-8, foreach=False)
    graphs = []
    for step in range(5):
        for group, other in zip(ours.param_groups, theirs.param_groups):
            group["lr"] = other["lr"] = 1e-2 * (step + 1) / 5  # a warm-up schedule
        if step == 2:  # params[1] starts over, in both
            ours.state[params[1]] = ours.fresh_state(params[1], ours.state[params[1]]["master"])
            del theirs.state[ref[1]]
        _step_both(ours, theirs, params, ref, step)
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[-1] == graphs[0] > 0, graphs  # compiled in the first step only (lr and steps are tensors)
    for p, r in zip(params, ref):
        torch.testing.assert_close(ours.state[p]["master"], r.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(ours.state[p]["exp_avg_sq"], theirs.state[r]["exp_avg_sq"], rtol=1e-6, atol=0)
        assert torch.equal(p.detach(), ours.state[p]["master"].bfloat16())
    assert float(ours.state[params[1]]["step"]) == 3 and float(ours.state[params[0]]["step"]) == 5


@pytest.mark.parametrize("wgrad_chunk", [None, 1])
def test_bf16_model_accumulates_fp32_main_grads(wgrad_chunk, monkeypatch):
    """Parameters bf16, the gradients of two different micro-batches summed in fp32 `main_grad`:
    bit for bit the fp32 sum of each micro-batch's own (bf16) gradient, which bf16 cannot hold
    (summing in bf16 would round it; the same batch twice would not tell, g + g is exact in bf16);
    nothing left in `.grad`; router logits and the loss fp32. `wgrad_chunk` 1: the experts' dW in
    chunks of one expert each (moe/grouped_gemm.py `_chunks`), the same bits."""
    if wgrad_chunk is not None:
        monkeypatch.setattr(grouped_gemm, "_WGRAD_TEMP_MAX_ELEMENTS", wgrad_chunk)
    cfg = load_config("configs/gpt_moe_tiny.yaml", ["model.seq_length=8", "model.vocab_size=64", "moe.num_experts=4"])
    one = ParallelState.single_process()
    model = cast_params_(GPTMoEModel(cfg, one), "bf16")
    optimizer = build_optimizer(model, cfg.optimizer)
    assert isinstance(optimizer, MixedPrecisionAdamW)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    batches = [torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(seed)) for seed in (0, 1)]

    def main_grads(micro_batches):
        optimizer.zero_grad()
        for tokens in micro_batches:
            out = model(tokens, tokens)
            assert out.lm_loss.dtype == torch.float32
            (out.lm_loss + out.aux_loss).backward()
        return {n: p.main_grad.clone() for n, p in model.named_parameters()}

    alone = [main_grads([tokens]) for tokens in batches]
    both = main_grads(batches)
    for name, p in model.named_parameters():
        assert p.grad is None and p.main_grad.dtype == torch.float32, name
        first, second = alone[0][name], alone[1][name]
        assert torch.equal(first.bfloat16().float(), first) and not torch.equal(first, second), name
        fp32_sum = first + second
        assert torch.equal(both[name], fp32_sum), name
        assert not torch.equal(fp32_sum.bfloat16().float(), fp32_sum), name  # a bf16 sum would differ


def test_master_weights_step_like_fp32_adamw():
    """MixedPrecisionAdamW on bf16 parameters with fp32 main gradients == torch's fused AdamW on
    fp32 copies: the masters bit for bit, the parameters their bf16 rounding."""
    one = ParallelState.single_process()
    torch.manual_seed(0)
    params = [make_param(ParamMeta("dense", (5, 3), role="weight"), one), make_param(ParamMeta("dense", (3,), role="bias"), one)]
    for p in params:
        p.data.normal_()
    ref = [torch.nn.Parameter(p.detach().bfloat16().float()) for p in params]
    groups = [{"params": [params[0]], "weight_decay": 0.1}, {"params": [params[1]], "weight_decay": 0.0}]
    for p in params:
        p.data = p.data.bfloat16()
    ours = MixedPrecisionAdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    theirs = torch.optim.AdamW([{"params": [ref[0]], "weight_decay": 0.1}, {"params": [ref[1]], "weight_decay": 0.0}],
                               lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused=True)
    for step in range(3):
        _step_both(ours, theirs, params, ref, step)
    for p, r in zip(params, ref):
        assert torch.equal(ours.state[p]["master"], r.detach())
        assert torch.equal(p.detach(), r.detach().bfloat16())
        assert torch.equal(ours.state[p]["exp_avg_sq"], theirs.state[r]["exp_avg_sq"])


@pytest.mark.parametrize("distributed", [False, True])
def test_grad_norm_and_clipping_use_the_fp32_main_grads(tmp_path, distributed):
    """The grad norm a bf16 run reports and clips with is its fp32 main gradients' (Megatron's fp32
    grad buffers), not their bf16 rounding: equal to the norm computed here from the main gradients
    the clip saw (in float64) to fp32 rounding, rel 1e-6 (measured: <= 1e-7; the bf16-rounded
    gradients' norm is 3.5e-5 and 4.4e-5 off), and clipping scales the main gradients in fp32, bit
    for bit (clip_grad 0.1, below the norm: both steps clip)."""
    trainer = _trainer(tmp_path, "bf16", ["training.precision=bf16", "optimizer.clip_grad=0.1"]
                       + (["optimizer.distributed=true"] if distributed else []))
    clip, seen = trainer.grads.clip, []

    def main_grads():
        return {n: p.main_grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}

    def recording_clip(max_norm):
        before = main_grads()
        norm = clip(max_norm)
        seen.append((before, main_grads()))
        return norm

    trainer.grads.clip = recording_clip
    for iteration in (1, 2):
        record = trainer.train_step(iteration)
        before, after = seen[-1]
        norm = math.sqrt(sum(float(g.double().pow(2).sum()) for g in before.values()))
        rounded = math.sqrt(sum(float(g.bfloat16().double().pow(2).sum()) for g in before.values()))
        assert abs(rounded / norm - 1) > 1e-5  # what the tolerance below tells apart
        assert record["grad_norm"] == pytest.approx(norm, rel=1e-6, abs=0), (record["grad_norm"], norm, rounded)
        coef = 0.1 / (record["grad_norm"] + 1e-6)
        assert coef < 1
        for name, grad in before.items():
            assert torch.equal(after[name], grad * coef), name


@pytest.mark.parametrize("distributed", [False, True])
def test_checkpoints_hold_fp32_weights_across_precisions(tmp_path, distributed):
    """An fp32 run's checkpoint loads into a bf16 run's masters exactly (weights and moments), and
    a bf16 run's checkpoint holds its masters: an fp32 run loads them as its weights; a bf16 run
    resumed from its own checkpoint continues bit for bit."""
    opt = ["optimizer.distributed=true"] if distributed else []
    save = ["checkpoint.save_interval=2", "checkpoint.keep_last=0"]
    fp32 = _trainer(tmp_path, "fp32", save + opt)
    fp32.train()
    at2 = f"{tmp_path}/fp32-ckpt/iter_0000002"
    bf16 = _trainer(tmp_path, "bf16-from-fp32", ["training.precision=bf16", f"checkpoint.load={at2}",
                                                 "training.train_iters=2"] + opt)
    bf16.train()  # nothing left to run: the state is the loaded one
    want = _trainer(tmp_path, "fp32-again", [f"checkpoint.load={at2}", "training.train_iters=2"] + opt)
    want.train()
    masters, moments = _masters_and_moments(bf16)
    ref_weights = {n: p.detach() for n, p in want.model.named_parameters()}
    _, ref_moments = _masters_and_moments(want)
    for name, master in masters.items():
        assert master.dtype == torch.float32 and torch.equal(master, ref_weights[name]), name
        assert torch.equal(moments[name], ref_moments[name]), name
        assert torch.equal(dict(bf16.model.named_parameters())[name].detach(), master.bfloat16()), name

    records = _trainer(tmp_path, "bf16", ["training.precision=bf16"] + save + opt).train()
    source = _trainer(tmp_path, "bf16-again", ["training.precision=bf16", "training.train_iters=4",
                                               f"checkpoint.load={tmp_path}/bf16-ckpt/iter_0000002"] + opt)
    assert [(r["loss"], r["grad_norm"]) for r in source.train()] == [(r["loss"], r["grad_norm"]) for r in records[2:]]
    back = _trainer(tmp_path, "fp32-from-bf16", [f"checkpoint.load={tmp_path}/bf16-ckpt/iter_0000004"] + opt)
    back.load_checkpoint()
    masters, _ = _masters_and_moments(source)  # after its iteration 4: what the checkpoint of 4 holds
    for name, p in back.model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), masters[name]), name


def test_compile_and_recompute_in_bf16():
    """`training.compile` and both recomputation levels in bf16 give the eager bf16 run's losses
    and gradients up to bf16 rounding: recomputation repeats the same kernels (bitwise), Inductor
    fuses element-wise work into other kernels that round differently (a few u = 2^-8 on the
    loss, normwise on each gradient). Dropout 0.1 and capacity drops, two steps; and without
    dropout, where attention is `core_attention`'s flash forward with its own bf16 backward
    (model/core_attention.py, a custom op inside the compiled graph)."""
    u = 2.0 ** -8
    bf16 = ["training.precision=bf16"]
    runs = {(): tiny_model_steps(bf16, steps=2),
            ("model.dropout=0.0",): tiny_model_steps(bf16 + ["model.dropout=0.0"], steps=2)}
    for base, extra, loss_tol, grad_tol in (((), ["training.recompute=full"], 0.0, 0.0),
                                            ((), ["training.recompute=selective"], 0.0, 0.0),
                                            ((), ["training.compile=true"], 2 * u, 8 * u),
                                            (("model.dropout=0.0",), ["training.recompute=selective"], 0.0, 0.0),
                                            (("model.dropout=0.0",), ["training.compile=true"], 2 * u, 8 * u)):
        plain = runs[base]
        got = tiny_model_steps(bf16 + list(base) + extra, steps=2)
        for a, b in zip(got, plain):
            assert a.loss == pytest.approx(b.loss, rel=loss_tol, abs=0) and a.dropped == b.dropped, extra
            for name, grad in b.grads.items():
                assert grad.dtype == torch.float32
                err = float((a.grads[name] - grad).norm() / grad.norm().clamp_min(1e-12))
                assert err <= grad_tol, (extra, name, err)


def _masters_and_moments(trainer):
    """name -> fp32 weights (the masters in bf16 runs, else the parameters) and exp_avg, whole
    (single process: a distributed optimizer's shard is the whole flat buffer)."""
    opt = trainer.optimizer
    named = dict(trainer.model.named_parameters())
    if isinstance(opt, DistributedOptimizer):
        weights, moments = {}, {}
        for name, st in opt.sharded_states().items():
            shape = named[name].shape
            weights[name] = _whole(st.get("master"), shape) if "master" in st else named[name].detach()
            moments[name] = _whole(st["exp_avg"], shape)
        return weights, moments
    weights = {n: opt.state[p]["master"] if "master" in opt.state.get(p, {}) else p.detach() for n, p in named.items()}
    return weights, {n: opt.state[p]["exp_avg"] for n, p in named.items()}


def _whole(boxes, shape):
    out = torch.zeros(shape)
    for view, offsets in boxes:
        out[tuple(slice(o, o + n) for o, n in zip(offsets, view.shape))] = view
    return out


@pytest.mark.parametrize("normalization", ["layernorm", "rmsnorm"])
def test_bf16_norms_compute_in_fp32_and_keep_only_bf16_input(normalization):
    """bf16 norms (model/norm.py): output and gradients of torch's fp32 norm on the same bf16
    values, each rounded once to bf16 (within 1 ulp: fp32 reductions in another order); autograd
    keeps the bf16 input and fp32 [rows, 1] statistics, no fp32 [rows, h] copy."""
    from megatron_moe.model.norm import LayerNorm, RMSNorm

    one = ParallelState.single_process()
    norm = RMSNorm(64, one) if normalization == "rmsnorm" else LayerNorm(64, one)
    gen = torch.Generator().manual_seed(0)
    for p in norm.parameters():
        p.data = (1 + 0.1 * torch.randn(p.shape, generator=gen))
    cast_params_(norm, "bf16")
    x = (3 * torch.randn(8, 5, 64, generator=gen) + 1).bfloat16().requires_grad_(True)
    dy = torch.randn(8, 5, 64, generator=gen).bfloat16()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: (saved.append(t), t)[1], lambda t: t):
        y = norm(x)
    assert y.dtype == torch.bfloat16
    assert all(t.dtype == torch.bfloat16 or t.shape[-1] == 1 for t in saved if t.dim() == 3), \
        [(t.dtype, tuple(t.shape)) for t in saved]
    grads = torch.autograd.grad(y, [x, *norm.parameters()], dy)
    x32 = x.detach().float().requires_grad_(True)
    params32 = [p.detach().float().requires_grad_(True) for p in norm.parameters()]
    if normalization == "rmsnorm":
        y32 = torch.nn.functional.rms_norm(x32, (64,), params32[0], 1e-5)
    else:
        y32 = torch.nn.functional.layer_norm(x32, (64,), params32[0], params32[1], 1e-5)
    want = torch.autograd.grad(y32, [x32, *params32], dy.float())
    ulp = 2.0 ** -7  # bf16 spacing relative to the value (8 significant bits)
    for got, ref in zip([y, *grads], [y32, *want]):
        torch.testing.assert_close(got.float(), ref.bfloat16().float(), rtol=ulp, atol=ulp * float(ref.detach().abs().max()) * 1e-2)


@pytest.mark.parametrize("distributed", [False, True])
def test_weights_only_checkpoint_loads_into_the_masters(tmp_path, distributed):
    """A checkpoint without optimizer state (import-hf, upcycle: `write_model_checkpoint`) starts a
    bf16 run with masters equal to its fp32 weights, not the seed's (the first step would
    otherwise copy stale masters over the loaded weights)."""
    from megatron_moe.convert.offline import write_model_checkpoint

    cfg = _config(tmp_path, "src")
    gen = torch.Generator().manual_seed(3)
    fp32 = Trainer(cfg, ParallelState.single_process(), datasets=synthetic_datasets).model
    weights = {n: torch.randn(p.shape, generator=gen) * 0.02 for n, p in fp32.named_parameters()}
    for name, p in fp32.named_parameters():  # a padded vocabulary would cut rows; none here (vocab 128)
        assert p.meta.valid_rows in (None, p.shape[0]), name
    root = write_model_checkpoint(f"{tmp_path}/weights", cfg, weights)
    bf16 = _trainer(tmp_path, "bf16", ["training.precision=bf16", f"checkpoint.load={root}"]
                    + (["optimizer.distributed=true"] if distributed else []))
    bf16.load_checkpoint()
    masters, _ = _masters_and_moments(bf16)
    for name, p in bf16.model.named_parameters():
        assert torch.equal(masters[name], weights[name]) and torch.equal(p.detach(), weights[name].bfloat16()), name
