"""The collection's order under worksteal (tests/helpers/worksteal.py): each worker's initial share starts with its
part of the long tests. The shares are cut here as pytest-xdist's worksteal scheduler cuts them (each idle worker in
turn takes len(pending) // workers_left of what is left)."""

from helpers.worksteal import worksteal_order
from hypothesis import given, settings
from hypothesis import strategies as st
from xdist.scheduler import worksteal


def _shares(ordered: list, workers: int) -> list[list]:
    shares, pending = [], list(ordered)
    for worker in range(workers):
        take = len(pending) // (workers - worker)
        shares.append(pending[:take])
        del pending[:take]
    return shares


def test_a_hand_worked_order():
    # 2 long (a, b), 2 middle (c, d), 6 short (0-5) on 3 workers: shares of 3, 3 and 4
    items = ["a", "0", "c", "1", "b", "2", "3", "d", "4", "5"]
    tiers = [0, 2, 1, 2, 0, 2, 2, 1, 2, 2]
    assert worksteal_order(items, tiers, 3) == ["a", "d", "0", "b", "1", "2", "c", "3", "4", "5"]


def test_long_tests_that_overflow_a_share_go_to_the_next_with_room():
    # 4 long, 1 short on 3 workers: shares of 1, 2 and 2
    assert worksteal_order(["a", "b", "c", "d", "0"], [0, 0, 0, 0, 1], 3) == ["a", "b", "d", "c", "0"]


def test_the_scheduler_cuts_the_shares_as_this_test_does():
    source = open(worksteal.__file__).read()
    assert "num_send = len(self.pending) // nodes_remaining" in source


@given(tiers=st.lists(st.integers(0, 2), max_size=60), workers=st.integers(1, 8))
@settings(max_examples=300)
def test_every_worker_starts_on_its_share_of_the_long_tests(tiers, workers):
    items = list(range(len(tiers)))
    ordered = worksteal_order(items, tiers, workers)
    assert sorted(ordered) == items  # a permutation
    last = max(tiers, default=0)
    long = [i for i in items if tiers[i] < last]
    shares = _shares(ordered, workers)
    counts = [sum(tiers[i] < last for i in share) for share in shares]
    assert sum(counts) == len(long)
    if all(len(share) >= len(long) // workers + 1 for share in shares):  # room for the long ones in every share
        assert max(counts) - min(counts) <= 1
    for share in shares:  # the long ones first, by tier; each tier in the collection's order
        keys = [(tiers[i] == last, tiers[i], i) for i in share]
        assert keys == sorted(keys)
