"""tools/evaluate.py on a tiny trained checkpoint (issue #46 items 5-6): the demo config trained 4
iterations with the demo's checkpoint setting (Makefile `demo`), then scored by lm-eval's command line
with the `megatron_moe` backend on the local tasks of configs/eval_tasks: the results table on stdout
and --output_path's results (and --log_samples' samples) written; the same numbers from two processes
under torchrun (expert 2); bad input: one line on stderr, exit 2. No downloads."""
import glob
import json
import os

import pytest

from tests.e2e.demo_checkpoint import run_tool, train_demo_checkpoint

pytest.importorskip("lm_eval")
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1")
TASKS = ["--tasks", "stdlib_mc,stdlib_gen", "--include_path", "configs/eval_tasks", "--batch_size", "4"]


def _run(args, torchrun=False):
    return run_tool("evaluate.py", args, ENV, torchrun)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return train_demo_checkpoint(tmp_path_factory.mktemp("demo"), ENV)


def _results(directory):
    (path,) = glob.glob(os.path.join(directory, "**", "results_*.json"), recursive=True)
    with open(path) as f:
        return json.load(f)["results"]


def test_evaluate_prints_and_writes_results(checkpoint, tmp_path):
    out = _run(["--model_args", f"checkpoint={checkpoint}", *TASKS, "--output_path", str(tmp_path / "one"),
                "--log_samples", "--limit", "6"])
    assert out.returncode == 0, out.stderr[-3000:]
    assert "megatron_moe" in out.stdout and "stdlib_mc" in out.stdout and "exact_match" in out.stdout
    results = _results(tmp_path / "one")
    assert set(results) == {"stdlib_mc", "stdlib_gen"} and 0 <= results["stdlib_mc"]["acc,none"] <= 1
    assert len(glob.glob(str(tmp_path / "one" / "**" / "samples_stdlib_mc_*.jsonl"), recursive=True)) == 1
    parallel = _run(["--model_args", f"checkpoint={checkpoint},expert=2", *TASKS, "--output_path",
                     str(tmp_path / "two"), "--limit", "6"], torchrun=True)
    assert parallel.returncode == 0, parallel.stderr[-3000:]
    assert parallel.stdout.count("stdlib_mc") == out.stdout.count("stdlib_mc")  # one rank prints
    two = _results(tmp_path / "two")
    for task in results:
        assert two[task]["alias"] == results[task]["alias"]
        for key, value in results[task].items():
            if "stderr" not in key and key != "alias":
                assert two[task][key] == pytest.approx(value, abs=1e-9), (task, key)


@pytest.mark.parametrize("model_args,message", [
    ("checkpoint=/no/such/dir", "checkpoint /no/such/dir: not found"),
    ("tensor=1", "give --model_args checkpoint=DIR (a checkpoint root or iter_* directory)"),
])
def test_bad_input_is_one_line(model_args, message):
    out = _run(["--model_args", model_args, *TASKS])
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1] == f"error: megatron_moe: {message}", out.stderr[-2000:]
