"""Schedules side by side from Python: simulate named ones, search a zero-bubble one under a memory limit,
and compare every approach on a model's profiled costs.

    python examples/compare_schedules.py

The same as ``pipeweave simulate``, ``pipeweave search`` and ``pipeweave compare``.
"""

import pipeweave

if __name__ == "__main__":
    cost = pipeweave.CostModel(f=1.0, b=1.0, w=1.0)
    for name in ("gpipe", "1f1b", "zb-h1", "zb-h2", "zb-v"):
        m = pipeweave.simulate(name, num_stages=4, num_microbatches=8, cost=cost).metrics
        print(f"{name:<8} bubble {m.bubble_ratio:.3f}  peak activations {max(m.peak_activations):g} M_a")

    found = pipeweave.search(4, 8, activation_limit=1.0, cost=cost, solver="heuristic")
    print(f"searched under 1F1B's memory: bubble {found.bubble_ratio:.3f} (bound {found.bubble_bound:.3f})")

    table = pipeweave.compare(["gpipe", "1f1b", "zb-h1", "pipedream-2bw"], num_stages=2, num_microbatches=4,
                              batch=8, model="mlp", layers=4, hidden=32)
    for row in table.rows:
        print(f"{row['name']:<14} {row['family']:<28} bubble {row['bubble_ratio']:.3f}  "
              f"staleness {max(row['staleness'])}")
