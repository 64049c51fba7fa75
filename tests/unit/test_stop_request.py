"""training/failures.py StopRequest: old handlers come back after a loop that no signal stopped;
after a stop signal, further stop signals are ignored (SIG_IGN, which Python's finalization keeps)
so that a repeat cannot kill the process while it tears down. training/completion.py's marker."""
import os
import signal

import pytest
import torch

from megatron_moe.distributed.parallel_state import ParallelState
from megatron_moe.training.completion import clear_complete_marker, read_complete_marker, write_complete_marker
from megatron_moe.training.failures import STOP_SIGNALS, StopRequest


@pytest.fixture
def saved_handlers():
    saved = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def test_handlers_restored_without_a_signal(saved_handlers):
    before = {sig: signal.getsignal(sig) for sig in STOP_SIGNALS}
    with StopRequest(None, torch.device("cpu")) as stop:
        assert all(signal.getsignal(sig) == stop._handle for sig in STOP_SIGNALS)
    assert stop.signal_name is None
    assert {sig: signal.getsignal(sig) for sig in STOP_SIGNALS} == before


def test_after_a_stop_signal_repeats_are_ignored(saved_handlers):
    with StopRequest(None, torch.device("cpu")) as stop:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.signal_name == "SIGUSR1"
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)
    os.kill(os.getpid(), signal.SIGUSR1)  # the default action would end this process
    os.kill(os.getpid(), signal.SIGTERM)


def test_stopping_on_another_ranks_signal_ignores_repeats_too(saved_handlers):
    with StopRequest(ParallelState.single_process(), torch.device("cpu")) as stop:
        assert stop.agreed() is False and stop.stopping is False
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.agreed() is True and stop.stopping is True
        stop.signal_name = None  # as on a rank that only learnt of the stop from the others' flags
    assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in STOP_SIGNALS)


def test_complete_marker(tmp_path):
    assert read_complete_marker(str(tmp_path)) is None
    write_complete_marker(str(tmp_path), 50)
    assert read_complete_marker(str(tmp_path))["train_iters"] == 50
    assert os.listdir(tmp_path) == ["complete.json"]  # written through a temporary file, renamed
    clear_complete_marker(str(tmp_path))
    clear_complete_marker(str(tmp_path))  # nothing to remove: fine
    assert read_complete_marker(str(tmp_path)) is None
