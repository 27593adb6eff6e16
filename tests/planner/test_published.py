"""Megatron-LM's Table 1: the GEMM efficiency fitted on the four rows without a pipeline only, then the six
rows with one predicted within 10 %, their published configuration fitting in 80 GB
(benchmarks/plan/README.md holds the table)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest

from pipeweave.planner.costs import Cluster
from pipeweave.planner.efficiency import A100_CALIBRATED, ETA_GRID, N_HALF_GRID, Efficiency, calibrate
from pipeweave.planner.evaluate import Evaluator, Result
from pipeweave.planner.hardware import GPUS
from pipeweave.planner.published import CALIBRATION, PREDICTION, Row


def predict(row: Row, efficiency: Efficiency) -> Result:
    cluster = Cluster(model=row.transformer, gpu=GPUS["a100-80gb"], efficiency=efficiency)
    result = Evaluator(cluster=cluster, batch=row.batch, overlap=row.overlap_dp).evaluate(row.config())
    assert result is not None
    return result


def pairs(rows: Sequence[Row], efficiency: Efficiency) -> Iterator[tuple[float, float]]:
    for row in rows:
        yield predict(row, efficiency).tflops_per_gpu, row.tflops_per_gpu


def test_the_calibration_uses_only_the_rows_without_a_pipeline() -> None:
    # The constant is the best point of the grid around it (3 steps each way) for the rows without a pipeline;
    # that it is the best of the whole grid is the slow test below (19 s).
    assert [r.pp for r in CALIBRATION] == [1, 1, 1, 1] and all(r.pp > 1 for r in PREDICTION)
    near_eta = [e for e in ETA_GRID if abs(e - A100_CALIBRATED.eta_max) < 0.035]
    near_n_half = [n for n in N_HALF_GRID if abs(n - A100_CALIBRATED.n_half) < 35.0]
    assert len(near_eta) == len(near_n_half) == 7
    assert calibrate(lambda e: pairs(CALIBRATION, e), eta_grid=near_eta, n_half_grid=near_n_half) == A100_CALIBRATED


@pytest.mark.slow  # 19 s: the 71 x 61 grid, 4 rows each
def test_the_calibration_is_the_best_of_the_whole_grid() -> None:
    assert calibrate(lambda e: pairs(CALIBRATION, e)) == A100_CALIBRATED


@pytest.mark.parametrize("row", PREDICTION, ids=lambda r: r.model)
def test_rows_with_a_pipeline_are_predicted_within_10_percent(row: Row) -> None:
    result = predict(row, A100_CALIBRATED)
    assert result.tflops_per_gpu == pytest.approx(row.tflops_per_gpu, rel=0.10)
    assert result.fits and result.memory.total <= 80e9


@pytest.mark.parametrize("row", CALIBRATION, ids=lambda r: r.model)
def test_calibration_rows_are_reproduced(row: Row) -> None:
    assert predict(row, A100_CALIBRATED).tflops_per_gpu == pytest.approx(row.tflops_per_gpu, rel=0.02)
