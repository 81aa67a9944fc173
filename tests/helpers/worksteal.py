"""The collection's order for `pytest -n N --dist worksteal` (tests/conftest.py)."""

from __future__ import annotations


def worksteal_order(items: list, tiers: list[int], workers: int) -> list:
    """`items` in the order that starts every worker on the long tests at once under `--dist worksteal`; `tiers`:
    each item's, 0 for the longest (the multi-process runs), up to the highest for the shortest (the unit tests).

    worksteal hands worker i the i-th of `workers` contiguous blocks of the collection (len // workers items, the
    remainder to the later blocks), and an idle worker steals the back half of the longest queue. So the items of
    every tier but the last are dealt round-robin, tier after tier, to the blocks (skipping a full one), and the last
    tier fills them up: the workers run the long tests together, and what is stolen at the end is short. Each tier
    keeps its order."""
    last = max(tiers, default=0)
    dealt = [item for tier in range(last) for item, t in zip(items, tiers, strict=True) if t == tier]
    rest = [item for item, t in zip(items, tiers, strict=True) if t == last]
    sizes, left = [], len(items)
    for worker in range(workers):
        sizes.append(left // (workers - worker))
        left -= sizes[-1]
    shares = [[] for _ in sizes]
    worker = 0
    for item in dealt:  # round-robin over the shares with room left
        while len(shares[worker % workers]) == sizes[worker % workers]:
            worker += 1
        shares[worker % workers].append(item)
        worker += 1
    for share, size in zip(shares, sizes, strict=True):
        fill = size - len(share)
        share += rest[:fill]
        del rest[:fill]
    return [item for share in shares for item in share]
