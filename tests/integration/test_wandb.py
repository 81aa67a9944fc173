"""--report_to wandb end to end, offline: what wandb stored for each step is what metrics.jsonl holds."""

import json
import struct
import zlib

import pytest

from adaptive_ds.training import train

wandb_internal_pb2 = pytest.importorskip("wandb.proto.wandb_internal_pb2")  # the logging extra

BLOCK, HEADER = 32768, 7  # wandb's run file is a LevelDB log: 32 KiB blocks of (crc32, length, kind) records
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def _records(path):
    """Every protobuf Record of an offline run's .wandb file, checksums verified."""
    data = path.read_bytes()
    ident, magic, version = struct.unpack("<4sHB", data[:HEADER])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), "not a wandb run file"
    pos, pending = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        crc, length, kind = struct.unpack("<IHB", data[pos:pos + HEADER]) if left >= HEADER else (0, 0, 0)
        if (crc, length, kind) == (0, 0, 0):  # a block's zero trailer
            pos += left
            continue
        payload = data[pos + HEADER:pos + HEADER + length]
        assert zlib.crc32(payload, zlib.crc32(bytes([kind]))) == crc, f"corrupt record at byte {pos}"
        pos += HEADER + length
        pending += payload
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b""
            yield record


def _numeric_leaves(record, prefix=""):
    leaves = {}
    for key, value in record.items():
        if isinstance(value, dict):
            leaves.update(_numeric_leaves(value, f"{prefix}{key}/"))
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and key != "step":
            leaves[prefix + key] = value
    return leaves


def test_wandb_offline_run_holds_the_logged_values(tmp_path, monkeypatch, tiny_ds_config):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    out = tmp_path / "run"
    train(["--ds_config", tiny_ds_config(micro=2), "--arch", "hybrid", "--output_dir", str(out),
           "--report_to", "wandb"])
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    run_files = list(tmp_path.rglob("offline-run-*/run-*.wandb"))
    assert len(run_files) == 1, run_files
    history = {}
    for record in _records(run_files[0]):
        if record.WhichOneof("record_type") == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            history[items["_step"]] = items
    assert sorted(history) == [m["step"] for m in metrics] == [1, 2, 3, 4]
    for m in metrics:
        logged = history[m["step"]]
        assert logged["loss"] == m["loss"]
        expected = _numeric_leaves(m)
        assert "moe/load_balance" in expected and "mod/skip_rate" in expected
        assert {k: logged[k] for k in expected} == expected
