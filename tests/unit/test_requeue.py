"""training/failures.request_requeue: after a stop signal, rank 0 asks the sbatch job script to
requeue the job only when the requeued job (the same command) resumes from the saved checkpoint."""
from megatron_moe.training.failures import REQUEUE_FILE_ENV, request_requeue


def test_requeue_request_written_only_when_the_same_command_resumes(tmp_path):
    marker = tmp_path / "requeue"
    env = {REQUEUE_FILE_ENV: str(marker)}
    assert request_requeue("ckpt/iter_0000005", "auto", 10, env={}) is None  # not under the job script
    assert request_requeue(None, "auto", 10, env=env) is None  # no checkpoint.dir: nothing to resume from
    assert request_requeue("ckpt/iter_0000010", "auto", 0, env=env) is None  # stopped after the last iteration
    assert not marker.exists()
    message = request_requeue("ckpt/iter_0000005", None, 10, env=env)
    assert message == "the job is not requeued (a requeued job resumes only with checkpoint.load=auto)"
    assert not marker.exists()
    message = request_requeue("ckpt/iter_0000005", "auto", 10, env=env)
    assert message == "the job script requeues the job, which resumes from it (checkpoint.load=auto)"
    assert marker.read_text() == "ckpt/iter_0000005\n"
