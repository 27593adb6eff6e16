"""Why the best configuration wins: its step taken apart (compute, TP all-reduces, bubble, DP tail) beside the
next ones', and what their memory is."""

from __future__ import annotations

from pipeweave.planner.evaluate import Result
from pipeweave.planner.memory import GIB, StateBytes


def parts(r: Result) -> dict[str, float]:
    """The step in seconds: the busiest rank's compute and TP all-reduces, the rest of the pipeline's span
    (bubble and waits), and the DP reduction's tail."""
    pipeline = r.step_time - r.dp_exposed
    return {
        "compute": r.compute,
        "TP all-reduce": r.tp_comm,
        "bubble": max(0.0, pipeline - r.compute - r.tp_comm),
        "DP tail": r.dp_exposed,
    }


def time_terms(r: Result) -> str:
    """#1's step, term by term (``Evaluator.terms``): the work of the rank holding the head, the rest of the
    pipeline's span, and the busiest rank's DP reductions, optimizer steps and ZeRO all-gathers with what of them
    outlasts the pipeline."""
    return (
        "time of #1's step (s): "
        + ", ".join(f"{name} {value:.4g}" for name, value in r.terms.items())
        + (f"; step {r.step_time:.3f}")
    )


def memory_terms(r: Result, state: StateBytes) -> str:
    """The fullest GPU's memory, term by term (``planner.memory``)."""
    m = r.memory
    grads = "FP32 main-gradient buffer" if state.grads == "fp32" else "BF16"
    moments = "Adam's two moments" if state.optimizer == "adam" else "SGD's momentum"
    terms = (
        ("BF16 weights", m.params),
        (f"gradients ({grads})", m.grads),
        ("FP32 master weights", m.master),
        (moments, m.optimizer),
        ("activations", m.activations),
        ("CUDA context, cuBLAS and NCCL buffers", m.context),
        ("the largest collective's workspace", m.workspace),
        (f"allocator fragmentation ({100 * state.fragmentation:g} %)", m.fragmentation),
    )
    return (
        f"memory of #1's fullest GPU (ZeRO {r.config.zero}): "
        + " + ".join(f"{name} {value / GIB:.2f}" for name, value in terms)
        + f" = {m.total / GIB:.2f} GiB"
    )


def explain(results: list[Result], *, others: int = 3) -> list[str]:
    """Lines comparing the best with the next ``others`` configurations.

    Example:
        >>> explain([])
        ['no configuration fits: nothing to explain']
    """
    if not results:
        return ["no configuration fits: nothing to explain"]
    best = results[0]
    lines = [
        f"#1 {best.config.label}: step {best.step_time:.3f} s = "
        + " + ".join(f"{k} {v:.3f}" for k, v in parts(best).items())
        + f"; memory {best.memory.total / GIB:.1f} GiB"
    ]
    for k, other in enumerate(results[1 : 1 + others], 2):
        gap = other.step_time - best.step_time
        deltas = {name: parts(other)[name] - value for name, value in parts(best).items()}
        main = max(deltas, key=lambda n: abs(deltas[n]))
        lines.append(
            f"#{k} {other.config.label}: {gap:+.3f} s ({100 * gap / best.step_time:+.1f} %), mostly "
            f"{main} {deltas[main]:+.3f} s ("
            + ", ".join(f"{n} {d:+.3f}" for n, d in deltas.items())
            + f"); memory {other.memory.total / GIB:.1f} GiB"
        )
    return lines
