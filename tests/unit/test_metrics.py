"""metrics.jsonl: one record per step, abandoned records kept apart, rewinds that cost what they move."""

import json

from adaptive_ds.training.metrics import MetricsWriter


def _records(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_rewind_moves_the_later_records_apart_and_keeps_one_record_per_step(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for step in range(1, 3001):  # ~100 KB: more than one window of the backward scan
        writer.write({"step": step, "loss": 1.0 / step})
    assert writer.rewind(2990, "rolled back") == 10
    writer.write({"step": 2991, "loss": 0.5})
    writer.close()
    assert [r["step"] for r in _records(tmp_path / "metrics.jsonl")] == list(range(1, 2992))
    abandoned = _records(tmp_path / "abandoned_metrics.jsonl")
    assert [r["step"] for r in abandoned] == list(range(2991, 3001))
    assert all(r["abandoned"] and r["abandoned_because"] == "rolled back" for r in abandoned)
    assert abandoned[0]["loss"] == 1.0 / 2991  # the original record, not the new one


def test_a_torn_last_line_is_set_aside_and_a_rewind_to_zero_empties_the_file(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n{"ste')  # killed mid-write
    writer = MetricsWriter(str(tmp_path))
    assert writer.rewind(1, "resumed") == 1
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
    writer = MetricsWriter(str(tmp_path))
    assert writer.rewind(0, "started over") == 1
    writer.close()
    assert (tmp_path / "metrics.jsonl").read_text() == ""
    assert [r["step"] for r in _records(tmp_path / "abandoned_metrics.jsonl")] == [2, 1]


def test_amend_adds_to_the_last_record_of_its_step_or_writes_one(tmp_path):
    writer = MetricsWriter(str(tmp_path))
    for step in (1, 2, 3):
        writer.write({"step": step, "loss": float(step), "failed_saves": 0})
    writer.amend(3, {"failed_saves": 2})  # step 3's record is the last: merged, nothing else touched
    writer.amend(5, {"failed_saves": 3})  # step 5 logged nothing: a record of its own
    writer.write({"step": 6, "loss": 6.0})  # the writer appends as before
    writer.close()
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert records == [{"step": 1, "loss": 1.0, "failed_saves": 0}, {"step": 2, "loss": 2.0, "failed_saves": 0},
                       {"step": 3, "loss": 3.0, "failed_saves": 2}, {"step": 5, "failed_saves": 3},
                       {"step": 6, "loss": 6.0}]


class _Controller:
    """Judges a read's steps as the real controller does (in order, stopping at the first it does not accept):
    here it accepts `accept` of them and rolls back at the next."""

    def __init__(self, accept):
        self.accept, self.reports = accept, []

    def observe_steps(self, reports):
        from adaptive_ds.training.controller import CONTINUE, Action, Verdict

        self.reports.append(reports)
        if self.accept >= len(reports):
            return len(reports), CONTINUE
        return self.accept, Verdict(Action.ROLL_BACK)


def test_the_processor_reads_the_step_losses_where_something_needs_them_and_in_one_transfer(tiny_config):
    """Steps 1-10, logging every 5, a checkpoint boundary at step 3: the losses reach the host after steps 3, 5 and
    10 (and wherever the run stops), each read taking every step since the last in one transfer, which the
    controller judges in order; the losses it accepted join the window, the latest of them is the checkpoint's."""
    import torch

    from adaptive_ds.training.controller import Action
    from adaptive_ds.training.metrics import PhaseClock
    from adaptive_ds.training.metrics_processor import MetricsProcessor, StepResult

    controller = _Controller(accept=1)
    processor = MetricsProcessor(MetricsWriter(None, log_steps=5), PhaseClock(), controller, tiny_config("dense"),
                                 None, max_steps=10, tokens_per_step=64, needs_losses=(lambda step: step == 3,))
    assert [s for s in range(1, 11) if processor.reads_at(s, stopping=False)] == [3, 5, 10]
    assert processor.reads_at(4, stopping=True)
    with processor.displaying(0, rank=1):
        for step, loss in ((1, 2.0), (2, 9.0), (3, 1.0)):
            processor.add_step(step, StepResult(torch.tensor(loss), overflow=step == 2))
        assert processor.unread and processor.window.tokens == 3 * 64
        assert processor.read().action is Action.ROLL_BACK
    assert [(r.step, r.loss, r.overflow) for r in controller.reports[0]] == [(1, 2.0, False), (2, 9.0, True),
                                                                          (3, 1.0, False)]
    assert not processor.unread and processor.window.losses == [2.0] and processor.last_loss == 2.0
    assert processor.state_dict() == {"loss": 2.0}
