"""The Checkpointer saves the union of any states and loads each its own part back, in the layout checkpoints have
always had on disk (run.json: the trainer's and the metrics' keys at the top, the controller's under its name; the
data position per rank), so that a checkpoint written before the states had names resumes. The collective save and
load (checkpoint/manager.py) are stood in for: what is checked here is what reaches them and what comes back."""

import json
import signal
from pathlib import Path
from types import SimpleNamespace

import pytest
from transformers import GenerationConfig

from adaptive_ds.training.checkpoint import Checkpointer, Resume, manager, storage
from adaptive_ds.training.checkpoint.storage import SavesFailedError

# run.json and data_rank0.json as a checkpoint of step 4 holds them, as the trainer wrote them before its state
# was split into named states (one dict with the controller's state inside, the data position beside it)
RUN_JSON = {"step": 4, "data_steps": 5, "loss": 2.5, "identity": {"world_size": 1}, "micro_batch": None,
            "stopped_early": False, "configured_rows_per_rank": 8,
            "controller": {"knobs": {"micro_batch": 2}, "rollbacks": 1}}
DATA_RANK0 = {"position": 17}


class _State:
    def __init__(self, state, log, name):
        self.state, self.log, self.name = state, log, name

    def state_dict(self):
        return self.state

    def load_state_dict(self, state):
        self.log.append((self.name, state))


class _RollsBack(_State):
    def rolled_back(self, state):
        self.log.append((f"{self.name} rolled back", state))


def _states(log):
    trainer = {k: v for k, v in RUN_JSON.items() if k not in ("loss", "controller")}
    return {"controller": _RollsBack(RUN_JSON["controller"], log, "controller"),
            "data": _State(DATA_RANK0, log, "data"), "metrics": _State({"loss": 2.5}, log, "metrics"),
            "trainer": _State(trainer, log, "trainer")}


def _checkpointer(tmp_path, states, tag=None):
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    return Checkpointer(object(), states, Resume(str(tmp_path), tag, None, "rerun the same command"), {"run": 1},
                        tokenizer=None, save_steps=2, keep_last=2, max_steps=10)


def test_a_save_writes_the_states_in_the_layout_old_checkpoints_have(tmp_path, monkeypatch):
    written = []
    monkeypatch.setattr(manager, "save", lambda engine, output_dir, step, run_state, keep_last, tokenizer,
                        rank_states, progress: written.append((step, run_state, rank_states)))
    log = []
    saver = _checkpointer(tmp_path, _states(log))
    assert saver.maybe_save(4, healthy=True) and saver.last_saved == 4
    assert written == [(4, RUN_JSON, {"data": DATA_RANK0})]
    assert json.loads((tmp_path / "run_identity.json").read_text()) == {"run": 1}


def test_a_resume_hands_each_state_its_part_in_order_and_a_new_state_its_own_key(tmp_path, monkeypatch):
    where = tmp_path / "checkpoints" / "step00000004"
    where.mkdir(parents=True)
    (where / storage.rank_state_file("data", 0)).write_text(json.dumps(DATA_RANK0))
    monkeypatch.setattr(manager, "restore", lambda engine, output_dir, tag, identity: {**RUN_JSON, "extra": [1]})
    log = []
    states = {**_states(log), "extra": _State(None, log, "extra")}
    assert _checkpointer(tmp_path, states, tag="step00000004").restore() == 4
    assert [name for name, _ in log] == ["controller", "data", "metrics", "trainer", "extra"]
    parts = dict(log)
    assert parts["controller"] == RUN_JSON["controller"] and parts["data"] == DATA_RANK0 and parts["extra"] == [1]
    assert parts["trainer"]["step"] == 4 and parts["metrics"]["loss"] == 2.5


def test_a_rollback_loads_the_engine_and_tells_only_the_states_that_roll_back(tmp_path, monkeypatch):
    restored = []
    monkeypatch.setattr(manager, "restore", lambda engine, output_dir, tag, identity: restored.append(tag) or RUN_JSON)
    log = []
    saver = _checkpointer(tmp_path, _states(log))
    assert saver.roll_back() is None and restored == []  # no checkpoint yet: the caller stops the run
    storage.write_atomic(str(tmp_path / "checkpoints" / storage.LATEST), "step00000004")
    saver.pending = True  # a save owed by the steps the rollback undoes
    assert saver.roll_back() == 4 and restored == ["step00000004"] and not saver.pending
    assert log == [("controller rolled back", RUN_JSON["controller"])]


@pytest.mark.parametrize("healthy_at_2, saved", [(True, [2]), (False, [3])])
def test_a_boundary_met_with_unhealthy_weights_is_saved_at_the_first_healthy_step(tmp_path, monkeypatch,
                                                                                  healthy_at_2, saved):
    written = []
    monkeypatch.setattr(manager, "save", lambda engine, output_dir, step, *args, **kwargs: written.append(step))
    saver = _checkpointer(tmp_path, _states([]))
    for step in (1, 2, 3):
        saver.maybe_save(step, healthy=healthy_at_2 or step != 2)
    assert written == saved


IDENTITY = {"preset": "debug", "arch": "dense", "world_size": 1, "rows_per_step": 8, "model": {"hidden_size": 32}}


def test_open_says_where_a_run_starts_and_refuses_a_directory_that_is_not_its_own(tmp_path, monkeypatch):
    from adaptive_ds import distributed
    from adaptive_ds.training.arguments import ConfigError
    from adaptive_ds.training.stop import Progress

    distributed.init_distributed()
    progress = Progress()
    new = Checkpointer.open(str(tmp_path / "new"), IDENTITY, progress=progress)
    assert (new.output_dir, new.tag, new.saved) == (str(tmp_path / "new"), None, None) and (tmp_path / "new").is_dir()
    assert progress.rerun == "rerun the same command" and progress.checkpoint is None
    # this run's own files from an attempt killed before its first checkpoint (on another number of processes):
    # it starts over there
    (tmp_path / "new" / "metrics.jsonl").write_text("")
    (tmp_path / "new" / "run_identity.json").write_text(json.dumps({**IDENTITY, "world_size": 2}))
    assert Checkpointer.open(str(tmp_path / "new"), IDENTITY).tag is None
    (tmp_path / "new" / "run_identity.json").write_text(json.dumps({**IDENTITY, "arch": "moe"}))
    with pytest.raises(ConfigError, match="holds another run's files but no checkpoint"):
        Checkpointer.open(str(tmp_path / "new"), IDENTITY)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match=r"holds files of something else \(notes.txt\) but no checkpoint"):
        Checkpointer.open(str(tmp_path / "other"), IDENTITY)
    (tmp_path / "saved" / "checkpoints").mkdir(parents=True)
    (tmp_path / "saved" / "checkpoints" / "latest").write_text("step00000002")
    with pytest.raises(ConfigError, match="holds checkpoint step00000002; pass --resume auto"):
        Checkpointer.open(str(tmp_path / "saved"), IDENTITY, resume="never")
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="is a file"):
        Checkpointer.open(str(tmp_path / "file"), IDENTITY)
    # without --output_dir: the job's directory, which the line to continue must name
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    chosen = Checkpointer.open(None, IDENTITY, progress=progress)
    assert chosen.output_dir == "runs/debug-dense-slurm-7"
    assert progress.rerun == "rerun the same command with --output_dir runs/debug-dense-slurm-7" == chosen.rerun


# run.json and data_rank0.json of step 2 of a real run of the code from before the states had names (0.1: a debug
# preset dense run streaming helpers.corpora's C4 shard, tokenizer bpe:320, validation_share 0.2, data_workers 0,
# max_steps 3, save_steps 2, on one CPU process); its identity's data path is the shard's name alone.
BEFORE_NAMED_STATES = Path(__file__).parents[1] / "fixtures" / "checkpoint_before_named_states"
SHARD = "c4-train.00000-of-01024.json.gz"


def _keys(value) -> object:
    """The nested keys of a JSON value (a dict's values by key, a list's items in order), without the values."""
    if isinstance(value, dict):
        return {key: _keys(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_keys(item) for item in value]
    return None


def _streamed_run(tmp_path, max_steps: int) -> dict:
    """A run on the stand-in engine (tests/helpers/fake_engine.py) with the fixture's settings into tmp_path/run."""
    from functools import partial
    from unittest import mock

    from helpers.corpora import write_c4
    from helpers.fake_engine import EngineLog, FakeEngine

    from adaptive_ds.training import loop, train

    shard = tmp_path / SHARD
    if not shard.exists():
        write_c4(shard)
    argv = ["--ds_config", str(Path(__file__).parents[2] / "ds_configs" / "debug_cpu.json"), "--max_steps",
            str(max_steps), "--save_steps", "2", "--log_steps", "1", "--data", str(shard), "--tokenizer", "bpe:320",
            "--validation_share", "0.2", "--data_workers", "0", "--eval_steps", "100", "--output_dir",
            str(tmp_path / "run")]
    with mock.patch.object(loop, "build_engine", partial(FakeEngine, log=EngineLog())):
        return train(argv)


def _fixture(name: str, tmp_path) -> dict:
    saved = json.loads((BEFORE_NAMED_STATES / name).read_text())
    if name == "run.json":
        saved["identity"]["data"] = str(tmp_path / SHARD)
    return saved


def test_a_checkpoint_holds_the_keys_a_checkpoint_of_the_code_before_named_states_held(tmp_path):
    _streamed_run(tmp_path, max_steps=2)
    where = tmp_path / "run" / "checkpoints" / "step00000002"
    for name in ("run.json", "data_rank0.json"):
        ours, before = json.loads((where / name).read_text()), _fixture(name, tmp_path)
        if name == "run.json":  # the model config's own fields changed since, and only these: config_version
            # (models/defaults.py) and the model families' features (all off by default)
            model, old_model = ours["identity"].pop("model"), before["identity"].pop("model")
            features = {"head_dim", "attention_qkv_bias", "attention_out_bias", "qk_norm", "rope_scaling_parameters",
                        "sliding_window", "moe_intermediate_size", "moe_norm_topk_prob", "source_model_type"}
            assert (set(model) - set(old_model), set(old_model) - set(model)) == (
                {"config_version", *features}, {"moe_eval_capacity_factor"})
        assert _keys(ours) == _keys(before), name


def test_a_checkpoint_written_before_the_states_had_names_resumes(tmp_path):
    """The old files in place of a checkpoint's own (its manifest removed: a checkpoint from before manifests passes
    on its run.json alone): the run resumes at the old step, with the old position in the stream and the controller's
    losses."""
    _streamed_run(tmp_path, max_steps=2)
    where = tmp_path / "run" / "checkpoints" / "step00000002"
    (where / "manifest.json").unlink()
    for name in ("run.json", "data_rank0.json"):
        (where / name).write_text(json.dumps(_fixture(name, tmp_path)))
    summary = _streamed_run(tmp_path, max_steps=3)
    assert summary["resumed_from_step"] == 2 and summary["steps"] == 3
    resumed = json.loads((tmp_path / "run" / "checkpoints" / "step00000003" / "run.json").read_text())
    assert resumed["controller"]["losses"][:2] == _fixture("run.json", tmp_path)["controller"]["losses"]
    assert resumed["data_steps"] == 3


class _Engine:
    """The engine as the collective save (checkpoint/manager.py) reaches it; `fail_at`: the steps whose save
    raises the OSError of a full disk."""

    has_moe_layers = False

    def __init__(self, fail_at=()):
        self.fail_at = set(fail_at)
        self.module = SimpleNamespace(generation_config=GenerationConfig())  # the model's, saved beside its weights

    def save_checkpoint(self, root, tag, client_state, save_latest=False):
        if int(tag.removeprefix("step")) in self.fail_at:
            raise OSError(28, "No space left on device")
        (Path(root) / tag).mkdir(parents=True)
        (Path(root) / tag / "model.pt").write_text("weights")


class _Tokenizer:
    def save_pretrained(self, path):
        Path(path).mkdir(parents=True)


def _saver(tmp_path, engine, saved, amended, **options):
    """A Checkpointer over the real collective save, with a stand-in engine; `saved` receives on_saved's steps,
    `amended` amend_record's arguments."""
    from adaptive_ds import distributed

    distributed.init_distributed()
    (tmp_path / "checkpoints").mkdir(exist_ok=True)
    return Checkpointer(engine, _states([]), Resume(str(tmp_path), None, None, "rerun the same command"), {"run": 1},
                        tokenizer=_Tokenizer(), save_steps=1, keep_last=5, max_steps=100, on_saved=saved.append,
                        amend_record=lambda step, counts: amended.append((step, counts)), **options)


def test_max_failed_saves_in_a_row_stop_the_run_and_amend_its_record_and_a_success_resets_the_count(tmp_path):
    saved, amended = [], []
    saver = _saver(tmp_path, _Engine(fail_at={1, 2, 4, 5, 6}), saved, amended, max_failed_saves=3)
    for step in (1, 2, 3, 4, 5):  # two failures, a success (the count starts over), two failures: the run goes on
        assert saver.maybe_save(step, healthy=True) == (step == 3)
    assert (saver.failed_saves, saver.failed_saves_total, saved, amended) == (2, 4, [3], [])
    assert storage.latest_tag(str(tmp_path)) == "step00000003"
    with pytest.raises(SavesFailedError, match=r"3 checkpoint saves in a row failed \(max_failed_saves 3\), the last "
                                               r"at step 6 \(.*No space left on device\); the last good checkpoint "
                                               r"is .*step00000003; rerun the same command to resume from it"):
        saver.maybe_save(6, healthy=True)
    assert amended == [(6, {"failed_saves": 3, "failed_saves_total": 5})] and saved == [3]


def test_on_saved_follows_a_successful_boundary_or_stop_save_only_and_never_the_save_at_the_end(tmp_path):
    from adaptive_ds.training.stop import StopRequest, StopRequested

    saved, amended = [], []
    saver = _saver(tmp_path, _Engine(fail_at={2, 5}), saved, amended)
    assert saver.maybe_save(1, healthy=True) and not saver.maybe_save(2, healthy=True)
    assert saved == [1]  # not after the failed boundary save
    # where on_saved stages its export: beside the checkpoints, which pruning and resuming leave it out of
    assert saver.snapshot_dir == str(tmp_path / "checkpoints" / "hub_snapshot")
    Path(saver.snapshot_dir).mkdir()
    storage.prune(str(tmp_path / "checkpoints"), "step00000001", keep_last=1)
    assert Path(saver.snapshot_dir).is_dir() and storage.candidates(str(tmp_path / "checkpoints")) == ["step00000001"]
    stop = StopRequest(grace_s=30)
    stop.signum = signal.SIGTERM
    with pytest.raises(StopRequested, match="stopped by SIGTERM at step 3, saved"):
        saver.save_on_stop(3, stop, healthy=True)
    assert saved == [1, 3]
    with pytest.raises(StopRequested, match="at step 5 without a checkpoint there \\(its save failed\\)"):
        saver.save_on_stop(5, stop, healthy=True)
    assert saved == [1, 3]
    saver.save_at_end(4, healthy=True)  # the end's push is the final export's, not on_saved's
    assert saver.last_saved == 4 and saved == [1, 3] and amended == []
    with pytest.raises(SavesFailedError, match="the checkpoint of the run's last step 5 could not be saved"):
        saver.save_at_end(5, healthy=True)  # no boundary follows to try again: it stops the run at once
    assert amended == [(5, {"failed_saves": 1, "failed_saves_total": 3})] and saved == [1, 3]


def test_states_that_would_write_the_same_run_json_key_are_refused(tmp_path):
    log = []
    states = {**_states(log), "loss": _State(1.0, log, "loss")}  # its own key, which the metrics' state holds
    with pytest.raises(AssertionError, match=r"state 'loss' writes run.json keys another state writes: \['loss'\]"):
        _checkpointer(tmp_path, states).maybe_save(4, healthy=True)
