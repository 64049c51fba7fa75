"""The fenced shell blocks of README.md and docs/*.md, and how a test runs one of their commands.

`tests/e2e/test_doc_examples.py` runs every runnable block as written (docstring there). A test
that checks a documented command's output in detail runs it with `run_doc_command` instead:

    proc = run_doc_command("README.md", "benchmarks/pipeline.py", "--iters", "2", cwd=tmp_path)

runs the README's one command that names `benchmarks/pipeline.py`, with the test's arguments
appended (a later flag wins), in the doc-test's fresh directory and environment. Such a command is
then dropped from its block's doc-test run (`run_by_tests`): it runs once, where it is asserted on.
"""
from __future__ import annotations

import ast
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"bash", "sh", "shell", "console"}
MARK = re.compile(r"^<!--\s*doc-test:\s*(run|skip)\b(.*?)\s*-->\s*$")
LINKED = ["pretrain_gpt_moe.py", "pretrain_bert_moe.py", "megatron_moe", "scripts", "tools", "benchmarks", "tests",
          "Makefile", "pyproject.toml", ".venv"]
RUNNERS = ("run_doc_command", "doc_command")  # the calls `run_by_tests` looks for


@dataclass
class Block:
    doc: str  # path relative to the checkout
    line: int  # of the opening fence
    lang: str
    text: str
    mark: Optional[str] = None  # "run" | "skip"
    options: Dict[str, str] = field(default_factory=dict)
    reason: str = ""

    @property
    def id(self) -> str:
        return f"{self.doc}:{self.line}"


def blocks(path: Path) -> List[Block]:
    """The fenced code blocks of a Markdown file, with the doc-test mark above each."""
    lines = path.read_text().splitlines()
    out, i = [], 0
    while i < len(lines):
        fence = re.match(r"^(```+|~~~+)\s*(.*)$", lines[i])
        if not fence:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].strip() == fence.group(1)), None)
        assert end is not None, f"{path.name}:{i + 1}: unclosed code fence"
        block = Block(str(path.relative_to(ROOT)), i + 1, fence.group(2).split()[0] if fence.group(2) else "",
                      "\n".join(lines[i + 1:end]))
        mark = MARK.match(lines[i - 1].strip()) if i else None
        if mark:
            block.mark = mark.group(1)
            rest = mark.group(2).strip()
            if block.mark == "skip":
                block.reason = rest
            else:
                block.options = dict(kv.partition("=")[::2] for kv in shlex.split(rest))
        out.append(block)
        i = end + 1
    return out


ALL = [b for doc in DOCS for b in blocks(doc)]
RUNNABLE = [b for b in ALL if b.lang in SHELL and b.mark == "run"]


def logical_lines(text: str) -> List[str]:
    """Commands of a shell block: backslash continuations joined, comments and blank lines dropped."""
    out, current = [], ""
    for line in text.splitlines():
        current += line
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        command = strip_comment(current).strip()
        if command:
            out.append(command)
        current = ""
    return out


def strip_comment(line: str) -> str:
    """The line without a shell comment (a `#` starting a word outside quotes)."""
    quote = None
    for i, ch in enumerate(line):
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch == "#" and (i == 0 or line[i - 1].isspace()):
            return line[:i]
    return line


def squash(command: str) -> str:
    """`command` with its whitespace runs made one space (how commands are compared)."""
    return " ".join(command.split())


def doc_command(doc: str, names: str) -> str:
    """The one command of `doc`'s runnable blocks that contains `names` (e.g. a script path)."""
    found = {squash(c) for b in RUNNABLE if b.doc == doc for c in logical_lines(b.text) if names in c}
    assert len(found) == 1, f"{doc}: {len(found)} commands of its runnable blocks contain {names!r}: {sorted(found)}"
    return found.pop()


def workdir(tmp: Path) -> Path:
    """A fresh directory that looks like the checkout: code linked, configs copied."""
    for name in LINKED:
        if (ROOT / name).exists():
            (tmp / name).symlink_to(ROOT / name)
    shutil.copytree(ROOT / "configs", tmp / "configs")
    (tmp / ".setup-stamp").touch()  # the Makefile's set-up is done (this checkout's environment)
    return tmp


def environment() -> Dict[str, str]:
    """As after `. .venv/bin/activate`: the running interpreter's bin first on PATH. One intra-op
    thread per process (the suite shares 2 cores; idle OpenMP threads spin)."""
    env = dict(os.environ, VIRTUAL_ENV=sys.prefix, PYTHON=sys.executable, OMP_NUM_THREADS="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    for var in ("PYTHONPATH", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(var, None)
    return env


def run_doc_command(doc: str, names: str, *args: str, cwd: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    """Run `doc_command(doc, names)` with `args` appended, as the doc-test would (`bash -e`, in
    `cwd`, an empty directory made to look like the checkout); stdout and stderr captured. Exit
    code 0 is asserted, with the output's tail in the message."""
    script = doc_command(doc, names) + "".join(" " + shlex.quote(str(a)) for a in args)
    proc = subprocess.run(["bash", "-e", "-o", "pipefail", "-c", script], cwd=workdir(Path(cwd)), env=environment(),
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{script}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@functools.lru_cache(maxsize=1)
def run_by_tests() -> Dict[str, str]:
    """{doc command (squashed): the test file that runs it}: every `run_doc_command(DOC, NAMES, ...)`
    (or `doc_command`) call with literal DOC and NAMES in tests/."""
    out = {}
    for path in sorted(ROOT.glob("tests/**/*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) in RUNNERS
                    and len(node.args) >= 2 and all(isinstance(a, ast.Constant) for a in node.args[:2])):
                out[doc_command(node.args[0].value, node.args[1].value)] = str(path.relative_to(ROOT))
    return out
