"""Where a run without --output_dir lives: a directory a restart or requeue of the same job finds again."""

import re

import pytest

from adaptive_ds.training.output_dir import default_output_dir


@pytest.mark.parametrize("environ, path", [
    ({"SLURM_JOB_ID": "4242"}, "runs/debug-moe-slurm-4242"),
    ({"SLURM_JOB_ID": "4242", "TORCHELASTIC_RUN_ID": "job7"}, "runs/debug-moe-slurm-4242"),  # torchrun in sbatch
    ({"TORCHELASTIC_RUN_ID": "job7"}, "runs/debug-moe-job7"),
    ({"TORCHELASTIC_RUN_ID": "../../etc/x y"}, "runs/debug-moe-.._.._etc_x_y"),  # a name, never a path
])
def test_a_job_names_its_directory(environ, path):
    assert default_output_dir("debug", "moe", environ) == path


def test_without_a_job_each_start_makes_a_new_time_stamped_directory():
    for environ in ({}, {"TORCHELASTIC_RUN_ID": "none"}):  # torchrun's default id names nothing
        assert re.fullmatch(r"runs/debug-moe-\d{8}-\d{6}", default_output_dir("debug", "moe", environ))
    assert default_output_dir(None, "dense", {"SLURM_JOB_ID": "1"}) == \
        "runs/pretrained-dense-slurm-1"
