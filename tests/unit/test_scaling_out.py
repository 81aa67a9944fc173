"""What runs a training job on a cluster, read as its scheduler would: the Kubernetes PyTorchJob of examples/ (its
fields, and its command through torchrun's parser and the run's own, as the Training Operator's variables set them),
and the Slurm batch script's header (its requeue and warning, and the variables it reads). The Slurm script runs on a
real Slurm in tests/integration/test_slurm.py."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from helpers.common import ROOT
from torch.distributed.run import get_args_parser

from adaptive_ds.training.arguments import parse

MANIFEST = ROOT / "examples" / "kubernetes_pytorchjob.yaml"
SBATCH = ROOT / "launchers" / "slurm" / "train.sbatch"


def _pod(job: dict) -> dict:
    """The one pod spec of every replica, which each must share."""
    pods = [replica["template"]["spec"] for replica in job["spec"]["pytorchReplicaSpecs"].values()]
    assert all(pod == pods[0] for pod in pods)
    return pods[0]


def test_the_pytorchjob_runs_one_run_of_its_pods_x_gpus(monkeypatch):
    job = yaml.safe_load(MANIFEST.read_text())
    assert (job["apiVersion"], job["kind"]) == ("kubeflow.org/v1", "PyTorchJob")
    replicas = job["spec"]["pytorchReplicaSpecs"]
    assert set(replicas) == {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    assert {r["restartPolicy"] for r in replicas.values()} == {"OnFailure"}
    assert job["spec"]["runPolicy"]["backoffLimit"] >= 1
    (container,) = _pod(job)["containers"]
    assert container["name"] == "pytorch"  # the Training Operator's container
    nodes, per_node = sum(r["replicas"] for r in replicas.values()), int(job["spec"]["nprocPerNode"])
    assert container["resources"]["limits"]["nvidia.com/gpu"] == per_node

    # torchrun as each pod starts it: its node options from the variables the operator sets (here the Master's)
    for name, value in {"PET_NNODES": nodes, "PET_NPROC_PER_NODE": per_node, "PET_NODE_RANK": 0,
                        "PET_MASTER_ADDR": f"{job['metadata']['name']}-master-0", "PET_MASTER_PORT": 23456}.items():
        monkeypatch.setenv(name, str(value))
    launcher = get_args_parser().parse_args([*container["command"][1:], *container["args"]])
    assert container["command"][0] == "torchrun" and launcher.module
    assert (launcher.training_script, int(launcher.nnodes), int(launcher.nproc_per_node)) == (
        "adaptive_ds.training", nodes, per_node)
    monkeypatch.chdir(ROOT)  # the image's working directory holds the repository
    settings, _ = parse(launcher.training_script_args, nodes * per_node)  # the ds_config's batch fits 2 x 4

    # the run's directory, named, on the volume every pod mounts; SIGTERM leaves time to save
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    claims = {v["name"] for v in _pod(job)["volumes"] if "persistentVolumeClaim" in v}
    assert any(Path(settings.output_dir).is_relative_to(mounts[name]) for name in claims), settings.output_dir
    assert _pod(job)["terminationGracePeriodSeconds"] > settings.stop_grace_s


def test_the_slurm_script_may_requeue_is_warned_and_reads_only_its_own_and_slurms_variables():
    text = SBATCH.read_text()
    directives = re.findall(r"^#SBATCH (\S+)", text, flags=re.M)
    assert {"--ntasks-per-node=1", "--requeue", "--open-mode=append"} <= set(directives)
    assert any(re.fullmatch(r"--signal=B:USR1@\d+", d) for d in directives), directives
    body = "\n".join(line for line in text.splitlines() if not line.startswith("#"))
    variables = set(re.findall(r"\$\{?([A-Z][A-Z0-9_]*)", body))
    assert all(v.startswith(("ADAPTIVE_DS_", "SLURM_")) for v in variables), sorted(variables)
    header = "\n".join(line for line in text.splitlines() if line.startswith("#"))
    assert all(v in header for v in variables if v.startswith("ADAPTIVE_DS_"))
    assert {"ADAPTIVE_DS_LAUNCHER", "SLURM_JOB_ID", "SLURM_NODEID"} <= variables
