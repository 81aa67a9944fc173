"""The losses of tests/fixtures/golden_losses.json, bit for bit: the default run of each architecture for 40 steps,
and tiny runs through a kill and resume, an out-of-memory retry, a spike rollback, a stop request and its resume, and
a 2-process run resumed on one process (tests/helpers/golden.py defines each once, for the recorder and for this
test). A change meant to keep numerics keeps them equal; one meant to change them records the fixture again:

    python tests/helpers/golden.py record tests/fixtures/golden_losses.json

The replays take minutes at one thread, so `make test` leaves them out (marker `golden`); `make golden` runs them,
and a change to the training wing's code runs it before it is committed (docs/development.md).
"""

import json
from importlib.metadata import version

import pytest
from helpers import golden

FIXTURE = json.loads(golden.FIXTURE.read_text())


def test_the_fixture_holds_every_scenario_at_the_thread_count_the_commands_run_on():
    assert sorted(FIXTURE["scenarios"]) == sorted(golden.SCENARIOS), "record the fixture again"
    assert FIXTURE["threads"] == golden.THREADS


@pytest.mark.golden
@pytest.mark.slow
@pytest.mark.parametrize("name", list(golden.SCENARIOS))
def test_a_scenario_trains_bit_for_bit_as_recorded(name, tmp_path):
    got = golden.run(name, tmp_path)
    problems = golden.differences(name, FIXTURE["scenarios"][name], got)
    versions = {package: (FIXTURE[package], version(package)) for package in ("torch", "deepspeed")}
    assert not problems, "\n".join([*problems, f"recorded at {FIXTURE['commit']} on {golden.THREADS} thread(s); "
                                    + ", ".join(f"{p} {was} (now {now})" for p, (was, now) in versions.items())])
