"""A reference Holm correction for tests, written apart from adaptive_ds/tools/significance.py."""


def holm_reference(p_values: list[float]) -> list[float]:
    """Holm's adjusted p-values, by the book: the k-th smallest times (m - k + 1), never below the one before."""
    order = sorted(range(len(p_values)), key=p_values.__getitem__)
    adjusted, running = {}, 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - k) * p_values[i]))
        adjusted[i] = running
    return [adjusted[i] for i in range(len(p_values))]
