# Sourced by the launch scripts: sets PYTHON to the interpreter that runs megatron_moe, like the
# Makefile picks it: $PYTHON if set, else the active virtual environment's python, else the
# checkout's .venv, else python3. Expects ROOT (the repository root).
if [ -z "${PYTHON:-}" ]; then
  if [ -n "${VIRTUAL_ENV:-}" ]; then
    PYTHON=python
  elif [ -x "$ROOT/.venv/bin/python" ]; then
    PYTHON=$ROOT/.venv/bin/python
  else
    PYTHON=python3
  fi
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
