"""Every major option through the real entry point with the shipped config's logging defaults
(issue #27 item 1): TensorBoard on, load pictures on, eval on. A pipeline run used to die at its
first log line (`pipeline_compute_ms`, a dict of lists, in `metrics.scalars`) because every e2e
test switched TensorBoard off.

Four 2-rank runs of 3 iterations compose the options that combine (CI time): pipeline stages with
interleaving, ZeRO-1, FasterMoE and full recomputation; pipeline stages with EPLB's vExperts and
Lancet (deferred weight gradients, 2 batch parts); expert=2 with ZeRO-1, Pro-Prophet, selective
recomputation and torch.compile; expert=2 with FlexMoE's vExperts and Lancet. Each must exit 0,
log iterations 1 and 3 (shipped `log_interval`: the first and the last), write every field of its
records to TensorBoard (no entry skipped) with each option's own tags, and draw the load heatmap
(and with vExperts every MoE layer's placement) at iteration 2, an iteration that is not logged.
"""
import pytest

from megatron_moe.training.metrics import scalars
from tests.e2e.test_train_cli import train

pytestmark = pytest.mark.e2e

# only what the cases need: few iterations and an image within them; the balancers' cost models
# read the shipped 2-process profile instead of calibrating at start-up (tests/e2e/test_balancers.py
# covers calibration)
SHORT = ["training.train_iters=3", "logging.image_interval=2"]
PROFILE = ["perf.hardware_profile=configs/hardware/cpu_gloo_2proc.yaml"]
PP2 = ["parallel.pipeline=2"]
EP2 = ["parallel.expert=2"]
LANCET = ["moe.lancet.defer_wgrad=true", "moe.lancet.partitions=2"]
RUNS = {  # name: (overrides, TensorBoard tags the options add, MoE layers with vExpert placements)
    "pp2-interleaved-zero1-fastermoe-recompute": (
        PP2 + ["parallel.virtual_stages=2", "model.num_layers=4",  # infers pipeline_schedule=interleaved
               "optimizer.distributed=true", "moe.balancer=fastermoe", "training.recompute=full"] + PROFILE,
        ["pipeline_bubble", "pipeline_bubble_ideal", "pipeline_compute_ms/rank1/backward", "comm_bytes/pipeline",
         "optimizer_state_mb/rank1", "moe_replicas/layer3",
         "expert_load_imbalance/layer3"], []),
    "pp2-eplb-lancet": (
        PP2 + ["moe.balancer=eplb"] + LANCET,
        ["pipeline_bubble", "pipeline_compute_ms/rank0/forward", "vexpert_moves/layer1",
         "a2a_total_ms/backward", "balance_degree/layer1"], [0, 1]),
    "ep2-zero1-proprophet-compile-recompute": (
        EP2 + ["optimizer.distributed=true", "moe.balancer=proprophet", "training.compile=true",
               "training.recompute=selective"] + PROFILE,
        ["comm_bytes/all_to_all", "comm_bytes/param_all_gather", "optimizer_state_mb/rank1", "plan_ms/layer1",
         "trans_total_ms/layer0", "moe_replicas/layer1"], []),
    "ep2-flexmoe-lancet": (
        EP2 + ["moe.balancer=flexmoe"] + LANCET + PROFILE,
        ["vexpert_moves/layer0", "comm_exposed_ms/all_to_all", "a2a_exposed_ms/backward"], [0, 1]),
}
# in every record (TensorBoard tags), whatever the options
COMMON_TAGS = ["loss", "aux_loss", "lr", "grad_norm", "tokens_per_sec", "iter_time_ms", "skipped_iterations",
               "time_ms/forward", "time_ms/comm_wait", "max_rss_mb/rank1", "dropped_fraction/layer0",
               "moe_schedule/layer0/baseline", "eval_loss", "eval_ppl"]


@pytest.mark.parametrize("name", list(RUNS))
def test_shipped_logging_defaults_with_every_option(name, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    overrides, option_tags, vexpert_layers = RUNS[name]
    records, stdout = train(2, SHORT + overrides, tmp_path)
    assert [r["iteration"] for r in records] == [1, 3], stdout[-2000:]
    assert "eval_loss" in records[-1]  # the last iteration evaluates (shipped eval_iters)
    if "parallel.virtual_stages=2" in overrides:  # the run directory's config names the schedule that ran
        assert "pipeline_schedule: interleaved" in (tmp_path / "config.yaml").read_text()
    assert "not written" not in stdout  # no field of a record was left out of TensorBoard
    files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(files) == 1, files
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0, "images": 0}).Reload()
    tags = set(events.Tags()["scalars"])
    for tag in COMMON_TAGS + option_tags:
        assert tag in tags, (tag, sorted(tags))
    # every number of every record reached TensorBoard, at its iteration, with its value
    expected = {}
    for record in records:
        for tag, value in scalars(record):
            expected.setdefault(tag, []).append((record["iteration"], value))
    assert set(expected) == tags, set(expected) ^ tags
    for tag, points in expected.items():
        got = [(e.step, e.value) for e in events.Scalars(tag)]
        assert [s for s, _ in got] == [s for s, _ in points], tag
        assert [v for _, v in got] == pytest.approx([v for _, v in points], rel=1e-6), tag  # TB stores float32
    images = events.Tags()["images"]
    assert [e.step for e in events.Images("expert_load/heatmap")] == [2]  # image_interval=2, not logged
    assert sorted(t for t in images if t.startswith("vexperts/")) == [f"vexperts/layer{i}" for i in vexpert_layers]
    for tag in images:
        image = events.Images(tag)[0]
        assert image.width > 100 and image.height > 100 and len(image.encoded_image_string) > 1000, tag
