"""The shell examples of README.md and docs/*.md, run as written (with small overrides), so a doc
cannot drift from the code.

Every fenced block names its language, and every shell block (bash, sh, shell, console) carries a
mark, an HTML comment on the line right above the fence (invisible when rendered):

    <!-- doc-test: run -->                     run it; exit code 0 expected
    <!-- doc-test: run exit=2 -->              ... this exit code expected instead
    <!-- doc-test: run output="config error" --> ... and this text in its output
    <!-- doc-test: run files=a.txt,d.jsonl --> ... with these inputs made first (make_inputs)
    <!-- doc-test: skip slurm -->              not run, with the reason (slurm, gpu, or words)
    <!-- doc-test: skip same as README.md -->  not run here: every command of the block is one of a
                                               runnable block of that doc (checked), which runs it

A runnable block runs as one `bash -e` script in a fresh directory that links the checkout's code
(configs/ is copied, so written profiles stay there), with the checkout's environment active (as
after `. .venv/bin/activate`). Each command that starts a program listed in CHEAP gets that
program's arguments appended (a later flag or `section.key=value` wins), e.g.
`training.train_iters=2` for training and `--reps 1` for benchmarks; every benchmark a doc runs
must have an entry. A command that a test runs with `tests/doc_blocks.py`'s `run_doc_command`
(and asserts on) is left out of its block's script here: it runs once, in that test.
"""
from __future__ import annotations

import json
import re
import shlex
import subprocess
import time
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from tests.doc_blocks import (ALL, DOCS, ROOT, RUNNABLE, SHELL, environment, logical_lines, run_by_tests, squash,
                              workdir)

pytestmark = pytest.mark.e2e

MIN_RUNNABLE = 15  # the docs hold more; fewer found means the extraction broke
OPTIONS = ("exit", "files", "output")  # of a run mark

# program (a script path, `pytest`, `make demo`) -> arguments appended to keep a run short
CHEAP: Dict[str, List[str]] = {
    "pretrain_gpt_moe.py": ["training.train_iters=2"],
    "pretrain_bert_moe.py": ["training.train_iters=2"],
    "scripts/run_local.sh": ["training.train_iters=2"],
    "make demo": ["ARGS=training.train_iters=2"],
    "make test": ["--dry-run"],  # the suite this test belongs to: only that the target exists
    "pytest": ["--collect-only", "-q"],
    "tools/simulate.py": ["--iterations", "1"],
    "tools/reproduce_papers.py": ["--quick", "--out", "reproduce.md"],
    "tools/profile_comm.py": ["--points", "2", "--reps", "1"],
    "tools/proprophet_model_check.py": ["--reps", "1", "--skews", "0"],
    "benchmarks/pipeline.py": ["--micro-batches", "2", "--iters", "2", "--warmup", "1", "--memory-nproc", "0"],
    "benchmarks/moe_layer.py": ["--reps", "1", "--warmup", "0"],
    "benchmarks/lancet.py": ["--reps", "1", "--warmup", "0"],
    "benchmarks/proprophet_planner.py": ["--sizes", "8x2,16x4", "--reps", "1", "--quality-cases", "2"],
    "benchmarks/simulate_scale.py": ["--gpus", "64", "--iterations", "2"],
    "benchmarks/sim_validate.py": ["--worlds", "2", "--reps", "1", "--balancers", "none"],
}
TIMEOUT_S = 600


def test_every_shell_block_is_marked():
    """A doc cannot dodge the check: every fenced block names its language, every shell block is
    marked run or skip (with a reason), and no shell command hides in an indented code block."""
    problems = [f"{b.id}: fenced block without a language (```bash, ```text, ...)" for b in ALL if not b.lang]
    problems += [f"{b.id}: shell block without a <!-- doc-test: run --> or <!-- doc-test: skip REASON --> line above"
                 for b in ALL if b.lang in SHELL and b.mark is None]
    problems += [f"{b.id}: skip without a reason" for b in ALL if b.mark == "skip" and not b.reason]
    problems += [f"{b.id}: unknown option {k!r} (known: {', '.join(OPTIONS)})"
                 for b in RUNNABLE for k in b.options if k not in OPTIONS]
    problems += elsewhere_problems()
    run_by_tests()  # every run_doc_command in tests/ names exactly one documented command
    for doc in DOCS:
        fenced = False
        prev = ""
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if re.match(r"^(```|~~~)", line):
                fenced = not fenced
            elif (not fenced and not prev.strip() and re.match(r"^ {4,}(\$ )?(python|torchrun|OMP_NUM_THREADS|"
                                                                r"scripts/|sbatch|make |\.venv/)", line)):
                problems.append(f"{doc.relative_to(ROOT)}:{n}: a command in an indented block: fence and mark it")
            prev = line
    assert not problems, "\n".join(problems)
    assert len(RUNNABLE) >= MIN_RUNNABLE, f"only {len(RUNNABLE)} runnable shell blocks found in {len(DOCS)} docs"
    assert all(logical_lines(b.text) for b in RUNNABLE), "a runnable block without a command"


SAME_AS = re.compile(r"^same as (\S+)$")


def elsewhere_problems() -> List[str]:
    """A `skip same as DOC` block runs nowhere else: each of its commands must be (whitespace aside)
    a command of a runnable block of DOC."""
    problems = []
    for b in ALL:
        same = SAME_AS.match(b.reason) if b.mark == "skip" else None
        if not same:
            continue
        there = {squash(c) for r in RUNNABLE if r.doc == same.group(1) for c in logical_lines(r.text)}
        problems += [f"{b.id}: `{c}` is in no runnable block of {same.group(1)} (skip same as {same.group(1)})"
                     for c in logical_lines(b.text) if squash(c) not in there]
    return problems


def program(command: str) -> Optional[str]:
    """The CHEAP key of a command: the first script it names, `pytest`, or `make <target>`."""
    words = shlex.split(command)
    while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):  # VAR=value prefixes
        words.pop(0)
    if not words:
        return None
    if words[0] == "make":
        return " ".join(words[:2])
    if "pytest" in words[:3]:
        return "pytest"
    return next((w for w in words if w.endswith((".py", ".sh"))), None)


def cheap(command: str) -> str:
    key = program(command)
    if key is None or key not in CHEAP:
        assert not (key or "").startswith("benchmarks/"), f"{key}: a benchmark without cheap overrides in CHEAP"
        return command
    return command + " " + " ".join(shlex.quote(a) for a in CHEAP[key])


def make_inputs(names: str, cwd: Path) -> None:
    """Inputs a block names with files=: stdlib sources as text files, or as JSON lines, one
    document per part between double blank lines (enough documents for every split)."""
    sources = sorted(Path(json.__file__).parent.glob("*.py"))
    for i, name in enumerate(names.split(",")):
        path = cwd / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.endswith(".jsonl"):
            docs = [part for s in sources for part in s.read_text().split("\n\n\n") if part.strip()]
            path.write_text("".join(json.dumps({"text": doc}) + "\n" for doc in docs))
        elif name.endswith(".txt"):
            path.write_text(sources[i % len(sources)].read_text())
        else:
            raise AssertionError(f"files={names}: no input of the kind {name}")


@pytest.mark.parametrize("block", [b for b in ALL if b.lang in SHELL], ids=lambda b: b.id)
def test_doc_example(block, tmp_path):
    if block.mark != "run":
        pytest.skip(f"doc-test: skip {block.reason}")
    elsewhere = run_by_tests()  # command -> the test file that runs it
    commands = [c for c in logical_lines(block.text) if squash(c) not in elsewhere]
    if not commands:
        tests = sorted({elsewhere[squash(c)] for c in logical_lines(block.text)})
        pytest.skip(f"every command runs in {', '.join(tests)}")
    cwd = workdir(tmp_path)
    if "files" in block.options:
        make_inputs(block.options["files"], cwd)
    script = "\n".join(cheap(c) for c in commands)
    start = time.monotonic()
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=cwd, env=environment(),
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    elapsed = time.monotonic() - start
    want = int(block.options.get("exit", 0))
    report = f"{script}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-3000:]}"
    assert proc.returncode == want, f"{block.id}: exit {proc.returncode} (want {want}) after {elapsed:.0f} s\n{report}"
    assert block.options.get("output", "") in proc.stdout + proc.stderr, f"{block.id}: no {block.options['output']!r}\n{report}"


def test_cheap_overrides_are_appended():
    """The command rewriting itself, on the forms the docs use."""
    assert cheap("OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/lancet.py --expert 2") == \
        "OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node 2 benchmarks/lancet.py --expert 2 --reps 1 --warmup 0"
    assert program("python -m pytest tests/unit/test_x.py -k 'a or b'") == "pytest"
    assert program("make demo") == "make demo" and cheap("make test") == "make test --dry-run"
    assert logical_lines("a \\\n  b  # note\n# only a comment\n\nc '#x' d # e") == ["a    b", "c '#x' d"]
    with pytest.raises(AssertionError, match="benchmarks/new.py: a benchmark without cheap overrides"):
        cheap("python benchmarks/new.py")
