"""Each script in examples/ runs as a user runs it, from the repository's root (here a directory of its own with
launchers/ and ds_configs/ beside it), at a tiny size, and does what its docstring says."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from helpers.common import ROOT, free_port, output_within, script_env
from helpers.corpora import DOCS

EXAMPLES = ROOT / "examples"
FIXTURES = ROOT / "tests" / "fixtures" / "final"


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    for name in ("launchers", "ds_configs", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    # a caller's shell that holds variables of common names: the scripts run as they would without them
    monkeypatch.setenv("OUT", "/nonexistent")
    monkeypatch.setenv("DS_CONFIG", "bogus")
    return tmp_path


def _start(args: list[str], cwd: Path, **env) -> subprocess.Popen:
    return subprocess.Popen(args, cwd=cwd, env=script_env(**env), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _finish(process: subprocess.Popen, timeout: int) -> str:
    """The process's output once it has ended with status 0; its whole group is killed if it outlives `timeout`."""
    output = output_within(process, timeout)
    assert process.returncode == 0, output[-3000:]
    return output


def _run(args: list[str], cwd: Path, timeout: int = 600, **env) -> str:
    return _finish(_start(args, cwd, **env), timeout)


def test_every_example_is_tested():
    tested = {"finetune_peft.py", "compare_architectures.sh", "own_data.sh", "push_to_hub.py",
              "torchrun_two_nodes.sh", "init_from_llama.sh"}
    assert {p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".sh")} == tested


@pytest.mark.slow
@pytest.mark.parametrize("source", ["final", "llama_export"])
def test_finetune_peft_trains_lora_adapters_and_merges_them(workdir, source):
    """From our final/ or from its `--to llama` export: the adapters train, and merged/ loads as the original
    did, on torch and transformers alone (ours with its source files), with the package-side model's logits."""
    from helpers.standalone_load import STOCK, load_without_the_package, model_card_load
    from transformers import AutoModelForCausalLM

    import adaptive_ds.models  # noqa: F401  (the Auto classes)
    from adaptive_ds.export.convert import main as export

    model = FIXTURES / "dense"
    if source == "llama_export":
        model = workdir / "llama"
        export(["--to", "llama", str(FIXTURES / "dense"), str(model)])
    texts = workdir / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"[count] {' '.join(str((i + k) % 10) for k in range(12))}"}) + "\n"
                             for i in range(16)))
    out = workdir / "lora"
    output = _run(["python", "examples/finetune_peft.py", str(model), "--data", str(texts), "--out",
                   str(out), "--steps", "4", "--batch", "4", "--seq_len", "16", "--lr", "0.01"], workdir)
    report = json.loads(output.strip().splitlines()[-1])
    assert len(report["losses"]) == 4 and all(torch.isfinite(torch.tensor(report["losses"])))
    assert (out / "adapter_config.json").exists() and (out / "adapter_model.safetensors").exists()
    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(model).eval()(input_ids=ids).logits
        tuned = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(input_ids=ids).logits
    assert torch.isfinite(tuned).all() and not torch.allclose(base, tuned)  # the adapters trained and merged in
    (alone,) = load_without_the_package(workdir, [(out / "merged", model_card_load() if source == "final" else STOCK,
                                                   ids)])
    assert alone.module.startswith("transformers_modules." if source == "final" else "transformers.models.llama")
    torch.testing.assert_close(alone.logits, tuned, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_compare_architectures_writes_the_grid_report(workdir):
    _run(["bash", "examples/compare_architectures.sh", "--tokens", "8192", "--seeds", "1", "--variants", "dense",
          "mod", "--eval_batches", "1"], workdir)
    (report,) = (workdir / "runs" / "compare" / "report").glob("grid_*.json")
    results = json.loads(report.read_text())["results"]
    assert set(results) == {"dense", "mod"}


@pytest.mark.slow
def test_own_data_prepares_the_files_and_trains_on_them(workdir):
    """Parquet files (JSON lines go the same way through `prepare`: tests/integration/test_prepared_data.py)."""
    import pandas

    corpus = workdir / "corpus"
    corpus.mkdir()
    for part in range(2):
        pandas.DataFrame({"text": DOCS[part::2]}).to_parquet(corpus / f"part{part}.parquet")
    _run(["bash", "examples/own_data.sh", str(corpus), "--max_steps", "2", "--micro_batch", "2", "--eval_batches",
          "1", "--log_steps", "1"], workdir, ADAPTIVE_DS_TOKENIZER="bpe:320", ADAPTIVE_DS_VALIDATION_SHARE="0.2")
    manifest = json.loads((workdir / "runs" / "own_data" / "prepared" / "manifest.json").read_text())
    summary = json.loads((workdir / "runs" / "own_data" / "run" / "summary.json").read_text())
    assert manifest["train"]["documents"] + manifest["validation"]["documents"] == len(DOCS)
    assert summary["steps"] == 2 and summary["validation_loss"] > 0


def _load_example(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), EXAMPLES / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class LocalHub:
    """Stands in for huggingface_hub.HfApi: repos are folders; each upload is kept."""

    def __init__(self, root: Path, fail: bool = False):
        self.root, self.fail, self.uploads = root, fail, []

    def create_repo(self, repo_id, exist_ok=False):
        if self.fail:
            raise ConnectionError("hub unreachable")
        (self.root / repo_id).mkdir(parents=True, exist_ok=True)

    def upload_folder(self, repo_id, folder_path, commit_message):
        self.uploads.append((repo_id, commit_message, sorted(os.listdir(folder_path))))


def test_push_to_hub_uploads_the_final_model_with_its_card(tmp_path, capsys):
    run = tmp_path / "run"
    (run / "final").mkdir(parents=True)
    for name in os.listdir(FIXTURES / "moe"):
        (run / "final" / name).write_bytes((FIXTURES / "moe" / name).read_bytes())
    (run / "summary.json").write_text(json.dumps({"arch": "moe", "preset": "debug", "validation_loss": 2.5,
                                                  "total_parameters": 1000, "active_parameters": 500}))
    hub = LocalHub(tmp_path / "hub")
    _load_example("push_to_hub.py").main([str(run), "me/tiny-moe"], api=hub)
    ((repo, message, files),) = hub.uploads
    assert (repo, message) == ("me/tiny-moe", "final model")
    assert {"README.md", "config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    assert "pushed" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="hub unreachable"):
        _load_example("push_to_hub.py").main([str(run), "me/tiny-moe"], api=LocalHub(tmp_path / "hub", fail=True))
    with pytest.raises(SystemExit, match="final not found; pass the output directory of a finished training run"):
        _load_example("push_to_hub.py").main([str(run / "final"), "me/tiny-moe"], api=hub)


@pytest.mark.slow
def test_torchrun_two_nodes_trains_one_run_of_two_processes(workdir):
    port = str(free_port())
    out = workdir / "runs" / "two_nodes"
    flags = ["--max_steps", "2", "--eval_batches", "1", "--log_steps", "1", "--output_dir", str(out)]
    nodes = [_start(["bash", "examples/torchrun_two_nodes.sh", *flags], workdir, ADAPTIVE_DS_NODE_RANK=str(rank),
                    ADAPTIVE_DS_MASTER_ADDR="127.0.0.1", ADAPTIVE_DS_MASTER_PORT=port) for rank in (0, 1)]
    try:
        for node in nodes:
            _finish(node, timeout=600)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.communicate()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 2


@pytest.mark.slow
def test_init_from_llama_continues_a_stock_llama_and_upcycles_it_to_moe(workdir):
    from helpers.pretrained_folders import DEBUG, llama_folder

    llama = llama_folder(workdir / "llama", shape=DEBUG)  # the debug preset's shape, the embedded corpus's tokenizer
    _run(["bash", "examples/init_from_llama.sh", str(llama), "embedded", "--max_steps", "2", "--warmup_steps", "1",
          "--eval_batches", "1", "--log_steps", "1"], workdir, ADAPTIVE_DS_DS_CONFIG="ds_configs/debug_cpu.json")
    dense = json.loads((workdir / "runs" / "from_llama" / "dense" / "summary.json").read_text())
    moe = json.loads((workdir / "runs" / "from_llama" / "moe" / "summary.json").read_text())
    assert (dense["arch"], moe["arch"]) == ("dense", "moe") and dense["steps"] == moe["steps"] == 2
    assert moe["total_parameters"] > dense["total_parameters"]  # the MLP copied into every expert
    assert (dense["base_model"], moe["base_model"]) == (str(llama), "runs/from_llama/dense/final")
