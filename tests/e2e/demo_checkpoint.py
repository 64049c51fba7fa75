"""A tiny trained checkpoint for the tool tests (tools/generate.py, tools/evaluate.py): the demo
config trained 4 iterations with the demo's checkpoint setting (Makefile `demo`), and a tool run in
one process or two under torchrun."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def train_demo_checkpoint(run_dir, env, overrides=()) -> str:
    """Train into `run_dir` (with config `overrides`); its checkpoint root."""
    subprocess.run([sys.executable, "pretrain_gpt_moe.py", "--config", "configs/gpt_moe_tiny.yaml",
                    f"training.run_dir={run_dir}", "checkpoint.save_interval=100", "training.train_iters=4",
                    "training.eval_interval=0", "logging.tensorboard=false", *overrides], cwd=ROOT, env=env, check=True,
                   capture_output=True, timeout=600)
    return os.path.join(str(run_dir), "checkpoints")


def run_tool(tool: str, args, env, torchrun: bool = False, timeout: int = 600) -> subprocess.CompletedProcess:
    """`python tools/<tool> args` (or under torchrun with 2 processes), output captured."""
    launcher = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"] if torchrun else [sys.executable]
    return subprocess.run(launcher + [f"tools/{tool}"] + list(args), cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)
