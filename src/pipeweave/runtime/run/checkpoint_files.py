"""The files of ``--save DIR``: a folder per checkpoint with its manifest, made current atomically, K kept.

Layout (``runtime.run.checkpoint`` says what the files hold)::

    DIR/
      step-000060/          the newest complete checkpoint
        manifest.json       what was trained, the run, and every file's name, bytes and sha256
        .metadata           torch.distributed.checkpoint's index of the keys
        __0_0.distcp        its data, one file per rank that wrote any
        __1_0.distcp
      step-000058/          the one before (--keep-checkpoints K, default 2)
      latest                "step-000060": the newest, for tools (written after each save)
      pipeweave.lock        the run saving here now (``runtime.run.save_lock``)
      .tmp-step-000062/     a save under way, or abandoned by a killed run

A save (``begin``, ``describe``, ``commit``): rank 0 clears the folders
earlier saves abandoned (``.tmp-step-*``, only pipeweave's own file names in
them) and creates ``.tmp-step-NNNNNN``; every rank writes its share there
with DCP, fsynced; the ranks hash the files between them (``describe``);
once every file is hashed, rank 0 writes the manifest, fsyncs the folder
and renames it to ``step-NNNNNN`` (``step-NNNNNN-S`` where that name is
taken): this rename is the moment the checkpoint exists, atomically. DIR is
fsynced, ``latest`` replaced atomically, and this run's checkpoints beyond
the K newest (with ``--overwrite``: every other run's) removed, each by the
files its manifest lists (a folder holding anything else stays). The newest complete
checkpoint is the one with the highest ``serial`` (saves count up in DIR);
``latest`` names it unless a save died between its two renames.

A run is identified by ``run`` in the manifest: set at its first save,
carried on by every run resumed from it. ``--save DIR`` refuses a DIR whose
newest checkpoint is another run's (``check_save``). Checkpoints of the
part-file format (``pipeweave-checkpoint/2``: ``part-NNN.pt`` in
``step-NNNNNN/``) are found, resumed and pruned like the current ones; one of
the first format (``meta.json`` beside ``part-NNN-stepS.pt`` in DIR itself)
is resumed, never written or removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeweave.durable import fsync_dir, reason, remove_stale_temporaries, write_atomic
from pipeweave.errors import UserError
from pipeweave.runtime.run import checkpoint_manifest

FORMAT = "pipeweave-checkpoint/3"
"""Written by DCP (``runtime.run.checkpoint``)."""
PARTS = "pipeweave-checkpoint/2"
"""One ``torch.save`` file per part (``runtime.run.checkpoint_parts``): read, no longer written."""
LEGACY = "pipeweave-checkpoint/1"
MANIFEST = "manifest.json"
LEGACY_META = "meta.json"
LATEST = "latest"
STAGING = ".tmp-step-"
_COMPLETE = re.compile(r"step-\d{6,}(-\d+)?")
_OWN_FILE = re.compile(r"(manifest\.json|__\d+_\d+\.distcp|(__\d+)?\.metadata(\.tmp)?|part-\d{3,}\.pt)")


class SaveFailed(Exception):
    """A checkpoint could not be written; ``str()`` is the one line: the path and the OS's reason."""


@dataclass(frozen=True)
class Checkpoint:
    """A complete checkpoint: its folder and its manifest (``files``: name, bytes and sha256 of each file)."""

    folder: Path
    manifest: dict[str, Any]
    legacy: bool = False
    """The first format: ``meta.json`` and its parts in DIR itself, no sizes or checksums."""

    @property
    def steps(self) -> int:
        return int(self.manifest["steps"])

    @property
    def serial(self) -> int:
        return int(self.manifest.get("serial", 0))

    @property
    def run(self) -> str | None:
        return self.manifest.get("run")

    @property
    def files(self) -> list[dict[str, Any]]:
        return list(self.manifest["files"])

    @property
    def root(self) -> Path:
        """The ``--save`` folder it is in."""
        return self.folder if self.legacy else self.folder.parent


def new_run_id() -> str:
    return uuid.uuid4().hex[:12]


# ---- finding and checking ---------------------------------------------------------------------
def checkpoints(root: Path) -> list[Checkpoint]:
    """The complete checkpoints in ``root`` (folders ``step-*`` with a manifest), oldest first."""
    try:
        entries = [e for e in root.iterdir() if _COMPLETE.fullmatch(e.name) and e.is_dir()]
    except OSError:
        return []
    found = [Checkpoint(e, m) for e in entries if (m := _read_manifest(e / MANIFEST)) is not None]
    return sorted(found, key=lambda c: (c.serial, c.steps))


def newest(root: Path) -> Checkpoint | None:
    """The newest complete checkpoint in ``root``, else one of the first format there, else None."""
    found = checkpoints(root)
    return found[-1] if found else _legacy(root)


def find(where: str) -> Checkpoint:
    """The checkpoint ``--resume where`` names: the folder itself, else the newest in it (one line where none).

    A ``step-*`` folder without a readable manifest, newer than the newest complete checkpoint, is refused
    (it was damaged after it was saved) rather than silently passed over.
    """
    folder = Path(where)
    if (folder / MANIFEST).is_file():
        manifest = _read_manifest(folder / MANIFEST)
        if manifest is None:
            raise UserError(
                f"--resume {where}: its {MANIFEST} is unreadable or not a {FORMAT} (or /2) manifest; "
                f"{_instead(folder.parent, None)}"
            )
        return Checkpoint(folder, manifest)
    found = newest(folder)
    damaged = [d for d in _damaged(folder) if found is None or _step_of(d) > found.steps]
    if damaged:
        instead = f"resume {found.folder} instead" if found is not None else "no complete checkpoint is there"
        raise UserError(f"--resume {where}: {damaged[-1] / MANIFEST} is missing or unreadable; {instead}")
    if found is None:
        abandoned = sorted(p.name for p in folder.glob(f"{STAGING}*")) if folder.is_dir() else []
        note = f" ({abandoned[-1]} is a save that never finished)" if abandoned else ""
        raise UserError(f"--resume {where}: no checkpoint there{note}; give a folder written by --save")
    return found


def _damaged(root: Path) -> list[Path]:
    """``step-*`` folders in ``root`` without a readable manifest, by step."""
    try:
        entries = [e for e in root.iterdir() if _COMPLETE.fullmatch(e.name) and e.is_dir()]
    except OSError:
        return []
    return sorted((e for e in entries if _read_manifest(e / MANIFEST) is None), key=_step_of)


def _step_of(folder: Path) -> int:
    return int(folder.name.split("-")[1])


def verify(found: Checkpoint, where: str) -> None:
    """Every file ``found``'s manifest lists is there, of its size and sha256 (one line naming the file if not)."""
    for entry in found.files:
        path = found.folder / entry["name"]
        problem = _problem(path, entry)
        if problem is not None:
            raise UserError(f"--resume {where}: {path} {problem}; {_instead(found.root, found)}")


def check_save(save: str, run: str, resumed: Checkpoint | None, overwrite: bool) -> None:
    """Refuse ``--save save`` where its newest checkpoint is another run's (not ``run``, not the one resumed)."""
    there = newest(Path(save))
    if overwrite or there is None or there.run == run:
        return
    if resumed is not None and resumed.folder.resolve() == there.folder.resolve():
        return
    name = LEGACY_META if there.legacy else there.folder.name
    raise UserError(
        f"--save {save} holds a checkpoint of another run ({name}, {there.steps} steps); resume it "
        f"with --resume {save}, or pass --overwrite to replace it"
    )


def _read_manifest(path: Path) -> dict[str, Any] | None:
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(manifest, dict) or manifest.get("format") not in (FORMAT, PARTS):
        return None
    checkpoint_manifest.check(manifest, path)  # edited by hand: one line, before anything reads a field
    return manifest


def _legacy(root: Path) -> Checkpoint | None:
    try:
        meta = json.loads((root / LEGACY_META).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(meta, dict) or meta.get("format") != LEGACY:
        return None
    checkpoint_manifest.check({**meta, "files": [{"name": n} for n in meta.get("files", [])]}, root / LEGACY_META)
    return Checkpoint(root, {**meta, "files": [{"name": n} for n in meta["files"]]}, legacy=True)


def _problem(path: Path, entry: dict[str, Any]) -> str | None:
    """What is wrong with the file at ``path`` against its manifest ``entry`` (None: nothing)."""
    try:
        size = path.stat().st_size
        if "bytes" in entry and size != entry["bytes"]:
            return f"is {size} bytes, its manifest says {entry['bytes']} (truncated or overwritten)"
        if "sha256" in entry and _sha256(path) != entry["sha256"]:
            return "does not match the sha256 of its manifest (damaged)"
    except FileNotFoundError:
        return "is missing (its manifest names it)"
    except OSError as exc:
        return f"cannot be read ({reason(exc)})"
    return None


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _instead(root: Path, bad: Checkpoint | None) -> str:
    """What to resume instead of ``bad``: the newest complete checkpoint saved before it, if one is kept."""
    older = [c for c in checkpoints(root) if bad is None or c.serial < bad.serial]
    if older:
        return f"resume the previous checkpoint with --resume {older[-1].folder}"
    return f"no earlier checkpoint is kept in {root}"


# ---- writing ----------------------------------------------------------------------------------
def staging(root: Path, steps: int) -> Path:
    """Where the checkpoint of ``steps`` is written before it becomes one (the same on every rank)."""
    return root / f"{STAGING}{steps:06d}"


def begin(root: Path, steps: int) -> Path:
    """Rank 0, before any rank writes: clear what abandoned saves left, create this save's staging folder.

    Raises:
        SaveFailed: the folder cannot be created (its path and why).
    """
    folder = staging(root, steps)
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(root)  # e.g. a `latest` a killed save was replacing
        for old in root.glob(f"{STAGING}*"):
            if old.is_dir():
                _remove_own(old)
        folder.mkdir(exist_ok=True)
    except OSError as exc:
        raise SaveFailed(f"cannot create {folder}: {reason(exc)}") from exc
    return folder


def describe(path: Path) -> dict[str, Any]:
    """A written file's manifest entry: its name, bytes and sha256 (read back once the save has written it).

    Raises:
        OSError: it cannot be read.
    """
    return {"name": path.name, "bytes": path.stat().st_size, "sha256": _sha256(path)}


def commit(folder: Path, manifest: dict[str, Any], keep: int, overwrite: bool) -> Checkpoint:
    """Rank 0, every file in the staging ``folder``: make it the newest checkpoint, keep the ``keep`` newest.

    Raises:
        SaveFailed: the manifest or the rename failed (the previous checkpoints are untouched).
    """
    root = folder.parent
    manifest = {"format": FORMAT, **manifest, "serial": 1 + max((c.serial for c in checkpoints(root)), default=0)}
    try:
        with (folder / MANIFEST).open("w") as f:
            f.write(json.dumps(manifest, indent=2) + "\n")
            f.flush()
            os.fsync(f.fileno())
        fsync_dir(folder)
        name = f"step-{manifest['steps']:06d}"
        target = root / (name if not (root / name).exists() else f"{name}-{manifest['serial']}")
        os.rename(folder, target)
        fsync_dir(root)
    except OSError as exc:
        raise SaveFailed(f"cannot write {folder / MANIFEST}: {reason(exc)}") from exc
    done = Checkpoint(target, manifest)
    try:
        write_atomic(root / LATEST, target.name + "\n")
    except OSError:  # the checkpoint is whole and newest by its serial; a stale pointer would mislead
        try:
            (root / LATEST).unlink(missing_ok=True)
        except OSError:  # a folder made read-only: the pointer stays; --resume goes by the serials, not by it
            pass
    prune(done, keep, overwrite)
    return done


def abandon(folder: Path) -> str:
    """Rank 0, after a failed save: remove its staging folder (only pipeweave's own files in it); what is kept.

    Returns:
        What the user still has, to end the failure's line: "; the newest checkpoint kept is DIR/step-... (N
        steps)", or "; no checkpoint is kept in DIR".
    """
    try:
        _remove_own(folder)
    except OSError:  # never created, or unreadable: the next save clears it
        pass
    kept = newest(folder.parent)
    if kept is None:
        return f"; no checkpoint is kept in {folder.parent}"
    return f"; the newest checkpoint kept is {kept.folder} ({kept.steps} steps)"


def prune(current: Checkpoint, keep: int, overwrite: bool) -> None:
    """Remove the run's checkpoints beyond the ``keep`` newest (and every other run's with ``overwrite``).

    Each goes by the files its manifest lists; one that cannot be removed is left for the next save.
    """
    every = checkpoints(current.root)
    ours = [c for c in every if c.run == current.run]
    drop = ours[:-keep] if len(ours) > keep else []
    if overwrite:
        legacy = _legacy(current.root)
        drop += [c for c in every if c.run != current.run] + ([legacy] if legacy is not None else [])
    for old in drop:
        try:
            _remove(old)
        except OSError:
            continue


def _remove(old: Checkpoint) -> None:
    names = [f["name"] for f in old.files]
    if old.legacy:
        for name in [LEGACY_META, *names]:  # meta.json first: the rest is no checkpoint any more
            (old.folder / name).unlink(missing_ok=True)
        return
    hidden = old.root / f"{STAGING}{old.folder.name.removeprefix('step-')}-old"  # no longer complete
    os.rename(old.folder, hidden)
    _remove_own(hidden, [MANIFEST, *names])


def _remove_own(folder: Path, names: list[str] | None = None) -> None:
    """Remove ``names`` (default: pipeweave's own file names) from ``folder``, then the folder if it is empty."""
    if names is None:
        names = [p.name for p in folder.iterdir() if _OWN_FILE.fullmatch(p.name)]
    for name in names:
        (folder / name).unlink(missing_ok=True)
    try:
        folder.rmdir()
    except OSError:  # something else is in it: not ours to remove
        pass
