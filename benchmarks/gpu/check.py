"""The GPU check: what pipeweave's CUDA paths must hold on one NVIDIA GPU, as a table of files.

Cases (benchmarks/gpu/README.md says what each compares and why):

- ``exact/<case>``: pipeweave on the GPU (one rank, or two ranks sharing it through ``--transport host``)
  equals a plain training loop of the same model on the same GPU, step by step (relative loss difference);
  fp16 against the loop with ``torch.amp.GradScaler`` where this checkout has ``--precision fp16``;
- ``planner/<gpt|llama>/h<hidden>/<F|I|W>``: the planner's prediction of one block
  (``planner.costs.block_times``) against pipeweave's profiler (``runtime.profile.profile_model``) at
  sequence 2048, microbatch 1, bf16;
- ``overhead/one-stage``: pipeweave's step against a plain torch loop of the same model (time ratio);
- ``bubble/2 ranks sharing the GPU``: the bubble measured from CUDA events against the simulated one, and
  ``memory/...``: each rank's CUDA allocator peaks in the record.

``--dry-run`` runs every case on the CPU at tiny sizes (the test suite does, so the script cannot rot); the
timing cases are then recorded but not judged. Nothing here needs ortools or highspy: the table says which
solvers were found, and a case that needed one would be skipped, saying so.

Usage: ``python benchmarks/gpu/check.py [--out DIR] [--dry-run]`` (``check.sh`` installs pipeweave first).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

import pipeweave
from pipeweave.data import data_source, step_microbatches
from pipeweave.models import ModelSpec, boundary
from pipeweave.models.boundary import num_samples
from pipeweave.models.build import build_layers
from pipeweave.config import TrainConfig
from pipeweave.errors import UserError
from pipeweave.models.precision import autocast
from pipeweave.models.randomness import is_keyed, run_keyed
from pipeweave.models.spec import loss_fn
from pipeweave.planner.costs import Cluster, block_times
from pipeweave.planner.efficiency import A100_CALIBRATED
from pipeweave.planner.hardware import GPUS
from pipeweave.planner.transformer import LLAMA, Transformer
from pipeweave.runtime.profile import profile_model
from pipeweave.runtime.report.trace import summarize
from pipeweave.runtime.run.prepare import prepare

EXACT_TOLERANCE = 1e-5
"""Largest relative loss difference from the plain loop (fp32; the same kernels on the same device)."""
COMPILED_TOLERANCE = 1e-4
"""``--compile``: inductor's fused kernels round differently from the eager loop's."""
FP16_TOLERANCE = 1e-3
"""fp16 with loss scaling against the loop with ``GradScaler``: the same kernels, the unscaling's rounding."""
BUBBLE_DIFFERENCE = 0.10
"""Largest ``|measured - simulated|`` bubble ratio of two ranks sharing the GPU (the simulator takes the costs
profiled from the same run; the ranks' kernels interleave on the one GPU, which it does not model)."""
PLANNER_RANGE = (0.67, 1.5)
"""Measured over predicted seconds of a block's F, I and W that pass."""
OVERHEAD_TARGET = 1.05
"""Largest pipeweave step time over the plain loop's (issue 33)."""
SOLVERS = ("ortools", "highspy")

EXACT_CASES: dict[str, dict[str, Any]] = {
    "1f1b": {"schedule": "1f1b"},
    "zb-h1": {"schedule": "zb-h1"},
    "interleaved-1f1b": {"schedule": "interleaved-1f1b", "num_chunks": 2},
    "zb-h1 --recompute selective": {"schedule": "zb-h1", "recompute": "selective"},
    "1f1b --offload all": {"schedule": "1f1b", "offload": "all"},
    "1f1b, 2 ranks sharing the GPU": {"schedule": "1f1b", "num_stages": 2, "transport": "host"},
    "zb-h1, 2 ranks sharing the GPU": {"schedule": "zb-h1", "num_stages": 2, "transport": "host"},
    "zb-h1 --compile": {"schedule": "zb-h1", "compile": True},
}
FP16_CASE = {"schedule": "zb-h1", "num_stages": 2, "transport": "host", "precision": "fp16"}
"""Where ``--precision fp16`` exists (``fp16_available``): two ranks, loss scaling across the pipeline."""


@dataclass(frozen=True)
class Sizes:
    """The model and run sizes of one mode (GPU or dry run)."""

    exact: ModelSpec
    exact_batch: int
    exact_steps: int
    planner_hidden: tuple[int, ...]
    planner_kinds: tuple[str, ...]
    planner_seq: int
    planner_repeats: int
    overhead: ModelSpec
    overhead_batch: int
    overhead_steps: int
    bubble_steps: int


GPU_SIZES = Sizes(
    exact=ModelSpec(kind="gpt", layers=4, hidden=1024, heads=16, seq_len=512),
    exact_batch=8,
    exact_steps=4,
    planner_hidden=(4096, 6144, 8192),
    planner_kinds=("gpt", "llama"),
    planner_seq=2048,
    planner_repeats=10,
    overhead=ModelSpec(kind="gpt", layers=8, hidden=2048, heads=16, seq_len=1024),
    overhead_batch=8,
    overhead_steps=30,
    bubble_steps=10,
)
DRY_SIZES = Sizes(
    exact=ModelSpec(kind="gpt", layers=2, hidden=32, heads=2, seq_len=16),
    exact_batch=4,
    exact_steps=3,
    planner_hidden=(64,),
    planner_kinds=("gpt", "llama"),
    planner_seq=32,
    planner_repeats=1,
    overhead=ModelSpec(kind="gpt", layers=2, hidden=32, heads=2, seq_len=16),
    overhead_batch=4,
    overhead_steps=4,
    bubble_steps=3,
)
MICROBATCHES = 2


@dataclass
class Row:
    """One line of the results table."""

    case: str
    measured: str
    expected: str
    result: str
    """``pass``, ``FAIL``, ``info`` (recorded, not judged: a dry run's timings) or ``skipped: <why>``."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _forward_context(precision: str, device: torch.device) -> Any:
    """fp16: ``torch.autocast`` to float16 (the GradScaler recipe); else pipeweave's own (``models.precision``)."""
    if precision == "fp16":
        return torch.autocast(device.type, dtype=torch.float16)
    return autocast(precision, device)


def plain_losses(
    spec: ModelSpec, device: torch.device, *, steps: int, batch_size: int, lr: float, precision: str = "fp32"
) -> tuple[list[float], list[float]]:
    """``(losses, step start times)`` of plain training on ``device``: AdamW at ``lr``, pipeweave's data of seed
    0 in ``MICROBATCHES`` microbatches, each loss scaled by its share of the batch (``runtime.plain``'s loop);
    fp16 with ``torch.amp.GradScaler``'s dynamic loss scaling at its defaults."""
    model = nn.ModuleList(build_layers(spec, range(spec.num_layers))).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
    loss_of, source = loss_fn(spec), data_source(spec, batch_size=batch_size, seed=0)
    losses, starts = [], []
    for step in range(steps):
        _sync(device)
        starts.append(time.perf_counter())
        total = 0.0
        for j, (x, target) in enumerate(zip(*step_microbatches(source, step, MICROBATCHES))):
            x, target = boundary.to(x, device), boundary.to(target, device)
            with _forward_context(precision, device):
                if is_keyed(spec):  # dropout masks keyed as the pipeline's (models.randomness)
                    x = run_keyed(enumerate(model), x, seed=spec.seed, step=step, microbatch=j)
                else:
                    for layer in model:
                        x = boundary.call(layer, x)
                loss = loss_of(x, target) * (num_samples(target) / batch_size)
            scaler.scale(loss).backward()
            total += loss.item()  # as pipeweave sums a step's microbatch losses
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    _sync(device)
    starts.append(time.perf_counter())
    return losses, starts


def pipeweave_run(spec: ModelSpec, *, steps: int, batch_size: int, **fields: Any) -> Any:
    """pipeweave's run of ``spec`` (one rank unless ``num_stages`` says; the GPU where there is one): its
    ``RunRecord``."""
    fields = {"num_stages": 1, "num_microbatches": MICROBATCHES, **fields}
    with tempfile.TemporaryDirectory() as out:
        return pipeweave.train(
            model=spec,
            steps=steps,
            batch_size=batch_size,
            quiet=True,
            out=out,
            **fields,
        )


def relative_difference(a: list[float], b: list[float]) -> float:
    """The largest ``|a - b| / |b|`` over the steps (inf when the lengths differ)."""
    if len(a) != len(b):
        return float("inf")
    return max(abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b))


def fp16_available() -> bool:
    """Whether this checkout trains ``--precision fp16`` (loss scaling; issue 33 item 3)."""
    try:
        TrainConfig(precision="fp16")
    except (UserError, TypeError, ValueError):
        return False
    return True


def exactness(sizes: Sizes, device: torch.device) -> list[Row]:
    """pipeweave against plain training, on the same device, for every ``EXACT_CASES`` run (and fp16)."""
    lr = 3e-3  # pipeweave's default for adamw, the gpt's default optimizer
    run = {"steps": sizes.exact_steps, "batch_size": sizes.exact_batch, "lr": lr}
    plain, _ = plain_losses(sizes.exact, device, **run)
    rows = []
    for name, fields in EXACT_CASES.items():
        tolerance = COMPILED_TOLERANCE if fields.get("compile") else EXACT_TOLERANCE
        rows.append(_exact_row(name, pipeweave_run(sizes.exact, **run, **fields).losses, plain, tolerance))
    if not fp16_available():
        return rows + [Row("exact/fp16", "-", "-", "skipped: --precision fp16 is not in this checkout")]
    scaled, _ = plain_losses(sizes.exact, device, **run, precision="fp16")
    record = pipeweave_run(sizes.exact, **run, **FP16_CASE)
    return rows + [_exact_row("zb-h1 fp16, 2 ranks sharing the GPU", record.losses, scaled, FP16_TOLERANCE)]


def _exact_row(name: str, losses: Any, plain: list[float], tolerance: float) -> Row:
    diff = relative_difference(list(losses), plain)
    return Row(f"exact/{name}", f"{diff:.2e}", f"<= {tolerance:.0e}", "pass" if diff <= tolerance else "FAIL")


def planner_gpu(device: torch.device) -> str:
    """The planner's preset for this GPU (``h200`` or ``h100-sxm``; ``h100-sxm`` on the CPU)."""
    name = torch.cuda.get_device_name(device).lower() if device.type == "cuda" else ""
    return "h200" if "h200" in name else "h100-sxm"


def planner_model(spec: ModelSpec) -> Transformer:
    """The planner's description of ``spec`` (a gpt or a llama) with one block."""
    shape = {"layers": 1, "hidden": spec.hidden, "heads": spec.heads, "seq_len": spec.seq_len, "vocab": spec.vocab}
    if spec.kind == "llama":
        return Transformer(
            name="llama", **shape, kv_heads=spec.kv_head_count, ffn_hidden=spec.ffn_width, **{**LLAMA, "tied": False}
        )
    return Transformer(**shape)


def planner(sizes: Sizes, device: torch.device, dry_run: bool) -> list[Row]:
    """Measured F, I, W seconds of one gpt and one llama block against ``planner.costs.block_times``."""
    rows = []
    for kind in sizes.planner_kinds:
        for hidden in sizes.planner_hidden:
            heads = max(hidden // 128, 2)
            spec = ModelSpec(kind=kind, layers=1, hidden=hidden, heads=heads, seq_len=sizes.planner_seq)
            rows += _planner_rows(spec, sizes, device, dry_run)
    return rows


def _planner_rows(spec: ModelSpec, sizes: Sizes, device: torch.device, dry_run: bool) -> list[Row]:
    """One block of ``spec`` profiled (bf16, microbatch 1) against the planner's F, I and W."""
    gpu = GPUS[planner_gpu(device)]
    with tempfile.TemporaryDirectory() as cache:
        costs = profile_model(
            spec, 1, device=device, repeats=sizes.planner_repeats, cache_dir=cache, refresh=True, precision="bf16"
        )
    block = costs.types.index("Block")
    cluster = Cluster(model=planner_model(spec), gpu=gpu, efficiency=A100_CALIBRATED)
    predicted = block_times(cluster, tp=1, microbatch_size=1, recompute="none")
    rows = []
    for op, measured, expected in (
        ("F", costs.forward[block], predicted.f),
        ("I", costs.input_grad[block], predicted.i),
        ("W", costs.weight_grad[block], predicted.w),
    ):
        ratio = measured / expected
        ok = PLANNER_RANGE[0] <= ratio <= PLANNER_RANGE[1]
        rows.append(
            Row(
                f"planner/{spec.kind}/h{spec.hidden}/{op}",
                f"{measured * 1e3:.3f} ms ({ratio:.2f}x)",
                f"{expected * 1e3:.3f} ms ({gpu.name}), ratio in {PLANNER_RANGE}",
                "info" if dry_run else ("pass" if ok else "FAIL"),
            )
        )
    return rows


def step_period(starts: list[float], skip: int) -> float:
    """The median time between consecutive step starts, after ``skip`` warm-up steps."""
    gaps = [b - a for a, b in zip(starts[skip:], starts[skip + 1 :])]
    return statistics.median(gaps)


def overhead(sizes: Sizes, device: torch.device, dry_run: bool) -> list[Row]:
    """pipeweave's one-stage 1F1B step against the plain loop's, both measured from step start to step start."""
    spec, steps, batch, lr = sizes.overhead, sizes.overhead_steps, sizes.overhead_batch, 3e-3
    skip = max(1, steps // 5)
    _, starts = plain_losses(spec, device, steps=steps, batch_size=batch, lr=lr)
    plain = step_period(starts, skip)
    record = pipeweave_run(spec, steps=steps, batch_size=batch, lr=lr, schedule="1f1b")
    mine = step_period([step[0][3] for step in record.ranks[0].records], skip)
    ratio = mine / plain
    return [
        Row(
            "overhead/one-stage",
            f"{ratio:.3f} ({mine * 1e3:.2f} ms vs plain {plain * 1e3:.2f} ms)",
            f"<= {OVERHEAD_TARGET}",
            "info" if dry_run else ("pass" if ratio <= OVERHEAD_TARGET else "FAIL"),
        )
    ]


def shared_gpu(sizes: Sizes, device: torch.device, dry_run: bool) -> list[Row]:
    """Two ranks sharing the GPU (``--transport host``), 1F1B: the bubble measured from CUDA events against the
    simulated one (costs profiled from the same run), and each rank's CUDA allocator peaks in the record."""
    record = pipeweave_run(
        sizes.exact,
        steps=sizes.bubble_steps,
        batch_size=sizes.exact_batch * 2,
        schedule="1f1b",
        num_stages=2,
        num_microbatches=2 * MICROBATCHES,
        transport="host",
    )
    figures = summarize(prepare(record.config).schedule, record)
    measured, simulated = figures["bubble_ratio"], figures["bubble_ratio_simulated"]
    events = figures["timing_source"] == "cuda events"
    ok = events and abs(measured - simulated) <= BUBBLE_DIFFERENCE
    peaks = [max(r.cuda_allocated, default=0) for r in record.ranks]
    reserved = [max(r.cuda_reserved, default=0) for r in record.ranks]
    return [
        Row(
            "bubble/2 ranks sharing the GPU (1f1b, events vs simulated)",
            f"{measured:.3f} ({figures['timing_source']})",
            f"{simulated:.3f} +- {BUBBLE_DIFFERENCE}, from cuda events",
            "info" if dry_run else ("pass" if ok else "FAIL"),
        ),
        Row(
            "memory/2 ranks sharing the GPU (cuda allocator peaks per rank)",
            ", ".join(f"{a / 2**20:.0f}/{r / 2**20:.0f} MiB" for a, r in zip(peaks, reserved)),
            "allocated/reserved recorded on every rank",
            "info" if dry_run else ("pass" if all(peaks) and all(reserved) else "FAIL"),
        ),
    ]


def streams(device: torch.device, dry_run: bool) -> list[Row]:
    """The transport's CUDA branches in one process (``p2p_streams``): exact, the pool not growing, every group
    posted from the communication stream."""
    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:  # loaded from its file (the tests do), not run as a script
        sys.path.insert(0, here)
    import p2p_streams

    steps = 4 if dry_run else 20
    out = p2p_streams.run(device, 16 if dry_run else 4096, steps)
    second, last = out["pools"][1], out["pools"][-1]
    ok = out["difference"] == 0.0 and second == last and out["off_stream"] == 0
    measured = (
        f"difference {out['difference']:.1e}; pool (buffers, bytes) per side step 2 {second}, step {steps} {last}; "
        f"{out['off_stream']} groups off the stream"
    )
    return [Row("p2p/streams", measured, "0; the same; 0", "pass" if ok else "FAIL")]


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ImportError:
        return False


def environment(device: torch.device) -> dict[str, Any]:
    """What the table was measured on."""
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=False,
            cwd=Path(__file__).parent,
        ).stdout.strip()
    except OSError:
        commit = ""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "commit": commit,
        "solvers": {name: _installed(name) for name in SOLVERS},
    }


def write(out: Path, rows: list[Row], env: dict[str, Any], seconds: float) -> None:
    """``results.json`` and ``results.md`` (the table) under ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(
        json.dumps({**env, "seconds": seconds, "rows": [asdict(r) for r in rows]}, indent=1)
    )
    lines = [
        f"GPU check, {env['date']}, {env['device']}, commit {env['commit'] or '?'}, torch {env['torch']}, "
        f"{seconds:.0f} s; solvers: "
        + ", ".join(f"{k} {'found' if v else 'absent (nothing here needs them)'}" for k, v in env["solvers"].items()),
        "",
        "| case | measured | expected | result |",
        "|---|---|---|---|",
        *(f"| {r.case} | {r.measured} | {r.expected} | {r.result} |" for r in rows),
    ]
    (out / "results.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Run every case; exit 1 if one fails, 2 if there is no GPU outside a dry run."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/gpu/results"))
    parser.add_argument("--dry-run", action="store_true", help="on the CPU at tiny sizes (timings not judged)")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu check: no CUDA device is visible; run on a GPU machine, or give --dry-run", file=sys.stderr)
        return 2
    device = torch.device("cpu") if args.dry_run else torch.device("cuda", 0)
    sizes = DRY_SIZES if args.dry_run else GPU_SIZES
    started = time.perf_counter()
    rows = exactness(sizes, device) + planner(sizes, device, args.dry_run) + overhead(sizes, device, args.dry_run)
    rows += shared_gpu(sizes, device, args.dry_run) + streams(device, args.dry_run)
    write(args.out, rows, environment(device), time.perf_counter() - started)
    print((args.out / "results.md").read_text())
    return 1 if any(r.result == "FAIL" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
