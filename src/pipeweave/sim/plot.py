"""Timeline pictures in the style of the papers' figures, drawn with matplotlib (Agg, no screen).

One row per rank (rank 0 on top), one box per action coloured by its op
(F, B, I, W; U as a thin red tick), later chunks or the second direction in a
lighter shade of the same colour, the microbatch number inside each box wide
enough to hold it, idle time left blank. All boxes are one PolyCollection, so
D=64, T=512 (65 k boxes) draws in about a second.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from pipeweave.errors import UserError
from pipeweave.schedule.ir import Op
from pipeweave.sim.bubble import bubble_metrics
from pipeweave.sim.textline import chunk_of_stages
from pipeweave.sim.timeline import Timeline

if TYPE_CHECKING:  # imported lazily at run time: pyplot must not pick a backend at import
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

# Colours close to the zero-bubble paper's figures: F blue, B/I teal-green, W purple.
COLOURS = {
    Op.F: (0.27, 0.45, 0.77),
    Op.B: (0.30, 0.65, 0.45),
    Op.I: (0.35, 0.70, 0.70),
    Op.W: (0.55, 0.40, 0.75),
    Op.U: (0.80, 0.20, 0.20),
    # Memory actions (schedule.levers): warm greys-browns, apart from the compute colours.
    Op.OFFLOAD: (0.85, 0.60, 0.25),
    Op.RELOAD: (0.95, 0.80, 0.45),
    Op.EVICT: (0.60, 0.45, 0.35),
    Op.LOAD: (0.80, 0.68, 0.58),
}
_NAMES = {
    Op.F: "F forward",
    Op.B: "B backward",
    Op.I: "I input grad",
    Op.W: "W weight grad",
    Op.U: "U update",
    Op.OFFLOAD: "offload",
    Op.RELOAD: "reload",
    Op.EVICT: "evict (BPipe)",
    Op.LOAD: "load (BPipe)",
}
FORMATS = (".png", ".svg", ".pdf")
"""The picture formats ``plot_timeline`` writes, by file extension."""
_MAX_LABELS = 4000  # text artists are slow (benchmarks/simulator/README.md); past this many, boxes stay unlabelled


def shade(colour: tuple[float, float, float], chunk: int, num_chunks: int) -> tuple[float, float, float]:
    """``colour`` lightened towards white for later chunks (chunk 0 unchanged)."""
    if num_chunks <= 1 or chunk == 0:
        return colour
    mix = 0.55 * chunk / (num_chunks - 1)
    r, g, b = colour
    return (r + (1 - r) * mix, g + (1 - g) * mix, b + (1 - b) * mix)


def plot_timeline(timeline: Timeline, path: str | Path, *, title: str | None = None) -> Path:
    """Draw ``timeline`` and write it to ``path`` (.png, .svg or .pdf, by extension).

    Args:
        timeline: a simulated or measured timeline.
        path: output file; its extension picks the format.
        title: overrides the default "<schedule>  D=..  T=..  bubble ratio ..".

    Raises:
        UserError: an extension other than .png, .svg, .pdf.

    Example:
        >>> from pipeweave.schedule import generate
        >>> from pipeweave.sim.timeline import simulate
        >>> plot_timeline(simulate(generate("1f1b", num_stages=4, num_microbatches=8)), "1f1b.png")  # doctest: +SKIP
        PosixPath('1f1b.png')
    """
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise UserError(f"cannot write a plot to {str(path)!r}; end the file name in .png, .svg or .pdf")
    import matplotlib

    matplotlib.use("Agg")  # no screen; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.collections import PolyCollection
    from matplotlib.patches import Patch

    schedule = timeline.schedule
    num_ranks = len(timeline.events)
    fig_w, row_h = 12.0, min(0.45, max(0.12, 8.0 / max(1, num_ranks)))
    fig, ax = plt.subplots(figsize=(fig_w, max(2.2, row_h * num_ranks + 1.4)))
    boxes, colours, ticks, labels = _boxes(timeline)
    ax.add_collection(
        PolyCollection(boxes, facecolors=colours, edgecolors="white" if len(boxes) < 5000 else "none", linewidths=0.5)
    )
    if ticks:
        ax.vlines(
            [t for t, _ in ticks],
            [r - 0.45 for _, r in ticks],
            [r + 0.45 for _, r in ticks],
            colors=[COLOURS[Op.U]],
            linewidths=1.0,
        )
    makespan, _, _, ratio, _, _ = bubble_metrics(timeline)
    start = min((row[0].start for row in timeline.events if row), default=0.0)
    ax.set_xlim(start, start + max(makespan, 1e-9))
    ax.set_ylim(num_ranks - 0.5, -0.5)
    _label(ax, fig, labels, makespan, num_ranks)
    step = max(1, num_ranks // 16)
    ax.set_yticks(range(0, num_ranks, step), [f"rank {r}" for r in range(0, num_ranks, step)])
    ax.set_xlabel("time")
    ops = {e.action.op for row in timeline.events for e in row}
    fig.legend(
        handles=[Patch(color=COLOURS[op], label=_NAMES[op]) for op in COLOURS if op in ops],
        loc="lower center",
        ncol=5,
        frameon=False,
        fontsize=9,
    )
    ax.set_title(
        title
        or f"{schedule.name}   D={num_ranks}   T={schedule.num_microbatches}"
        f"{f'   v={schedule.num_chunks}' if schedule.num_chunks > 1 else ''}   bubble ratio {ratio:.3f}"
    )
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    fig.tight_layout(rect=(0, 0.35 / fig.get_size_inches()[1], 1, 1))  # room for the legend below
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


Box = list[tuple[float, float]]
_Label = tuple[float, float, int, int, str]  # start, end, rank, microbatch, text colour


def _boxes(
    timeline: Timeline,
) -> tuple[list[Box], list[tuple[float, float, float]], list[tuple[float, int]], list[_Label]]:
    """Rectangles and colours of every box, U ticks, and the labels to write."""
    schedule = timeline.schedule
    chunk = chunk_of_stages(schedule)
    num_chunks = max(chunk, default=0) + 1
    boxes: list[Box] = []
    colours: list[tuple[float, float, float]] = []
    ticks: list[tuple[float, int]] = []
    labels: list[_Label] = []
    for r, row in enumerate(timeline.events):
        lo, hi = r - 0.4, r + 0.4
        for e in row:
            s, op, j = e.action
            if op is Op.U:
                ticks.append((e.start, r))
                continue
            if e.end <= e.start or op not in COLOURS:
                continue
            boxes.append([(e.start, lo), (e.end, lo), (e.end, hi), (e.start, hi)])
            colour = shade(COLOURS[op], chunk[s], num_chunks)
            colours.append(colour)
            dark = 0.3 * colour[0] + 0.59 * colour[1] + 0.11 * colour[2] > 0.62  # light box: dark text
            labels.append((e.start, e.end, r, j, "black" if dark else "white"))
    return boxes, colours, ticks, labels


def _label(ax: Axes, fig: Figure, labels: list[_Label], makespan: float, num_ranks: int) -> None:
    """Write microbatch numbers into the boxes wide and tall enough for them."""
    width_in = fig.get_size_inches()[0] * 0.85
    points_per_unit = width_in * 72 / max(makespan, 1e-9)
    row_points = fig.get_size_inches()[1] * 0.75 * 72 / max(1, num_ranks)
    font = max(4.0, min(8.0, row_points * 0.55))
    if row_points < 6:
        return
    fitting = [
        label for label in labels if (label[1] - label[0]) * points_per_unit >= font * 0.65 * len(str(label[3])) + 2
    ]
    if len(fitting) > _MAX_LABELS:
        return
    for t0, t1, r, j, colour in fitting:
        ax.text((t0 + t1) / 2, r, str(j), ha="center", va="center", fontsize=font, color=colour)
