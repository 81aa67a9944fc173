"""Expert parallelism over two processes equals one process, for both expert paths, for fine-grained, shared
and bias-balanced experts, and through DeepSpeed's dispatcher."""

import pytest


@pytest.mark.slow
def test_two_process_expert_parallel_equals_one_process(run_command):
    """Both expert paths, and fine-grained + shared + bias-balanced experts (tests/unit/test_moe_options.py), in one
    launch."""
    cases = ["always", "never", "never+fine", "never+deepspeed"]
    result = run_command(["torchrun", "--nproc_per_node", "2", "tests/helpers/moe_expert_parallel.py", *cases])
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    for case in cases:
        assert result.stdout.count(f", {case}: loss and gradients match the one-process run") == 2, case
