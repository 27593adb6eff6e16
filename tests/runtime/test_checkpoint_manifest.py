"""A checkpoint's manifest edited by hand is one line before anything spawns (``runtime.run.checkpoint_manifest``).

Before, ``"steps": "six"`` was a ValueError traceback, and ``"steps": -5`` trained and then
ended in a ZeroDivisionError with the run's record lost.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from config_defaults import train_config

from pipeweave.config import ModelSpec
from pipeweave.errors import UserError
from pipeweave.runtime.loss_scale import LossScale
from pipeweave.runtime.run import checkpoint, checkpoint_manifest
from pipeweave.runtime.run.prepare import prepare

SAVED = Path(__file__).parent / "fixtures" / "checkpoint-v2"
"""A checkpoint written by pipeweave (format /2): 4-layer mlp of width 8, 1f1b on 2 stages, 2 steps."""
RUN = train_config(num_stages=2, num_microbatches=2, model=ModelSpec(kind="mlp", layers=4, hidden=8), momentum=0.9)


def _edited(tmp_path: Path, **fields: Any) -> Path:
    ck = tmp_path / "ck"
    shutil.copytree(SAVED, ck)
    manifest = ck / "step-000002" / "manifest.json"
    saved = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**saved, **fields}))
    return ck


@pytest.mark.parametrize(
    ("fields", "problem"),
    [
        ({"steps": "six"}, "\"steps\" is 'six', not an integer >= 1"),
        ({"steps": -5}, '"steps" is -5, not an integer >= 1'),
        ({"files": [{"name": "../x"}]}, "\"files\" is [{'name': '../x'}], not a list of {name, bytes, sha256}"),
        ({"model": {"kind": "mlp", "layers": 4, "hidden": "8"}}, "\"model\": hidden='8' is invalid"),
        ({"model": {"kind": "mlp", "layers": 4, "width": 8}}, "\"model\" holds 'width', no model option"),
        (
            {"loss_scale": {"scale": "big", "_growth_tracker": 0}},
            "\"loss_scale\" is {'scale': 'big', '_growth_tracker': 0}, not an object of the loss scale",
        ),
    ],
)
def test_a_manifest_edited_by_hand_is_one_line_naming_the_file_and_the_field(
    tmp_path: Path, fields: dict[str, Any], problem: str
) -> None:
    ck = _edited(tmp_path, **fields)
    for config in (RUN.replace(resume=str(ck)), RUN.replace(save=str(ck), resume="auto", steps=4)):
        with pytest.raises(UserError) as caught:
            prepare(config)  # before anything spawns
        text = str(caught.value)
        assert "\n" not in text and text.startswith(f"{ck / 'step-000002' / 'manifest.json'}: {problem}")
        assert re.search(r"; restore it as --save wrote it, or move .*step-000002 away$", text)


def test_what_a_save_writes_and_the_saved_fixture_keep_to_the_schema() -> None:
    written = checkpoint._manifest(RUN, [range(0, 2), range(2, 4)], 3, None, "0123456789ab")
    written.update(
        format="pipeweave-checkpoint/3", serial=1, files=[{"name": "__0_0.distcp", "bytes": 1, "sha256": ""}]
    )
    written["loss_scale"] = LossScale().state_dict()  # --precision fp16's, written by checkpoint.save
    checkpoint_manifest.check(written, Path("manifest.json"))
    assert set(written) - {"format"} <= set(checkpoint_manifest.SCHEMA)  # every field written has its check
    checkpoint_manifest.check(json.loads((SAVED / "step-000002" / "manifest.json").read_text()), SAVED)
