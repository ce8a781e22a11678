"""The one checkpoint format both backends write: arrays in ``.npz`` plus JSON, never pickle.

A checkpoint is a directory ``step-<epoch>-<step>/`` holding ``arrays.npz`` (model weights,
optimizer and metric variables, in a fixed order), ``state.json`` (where training stands and
how it was set up) and ``manifest.json`` (format version, and the SHA-256 and byte size of each
file, the dtype and shape of each array). It is written under a temporary name, every file
flushed and fsynced, then renamed into place, so a reader sees a whole checkpoint or none.

Reading assumes the directory may have been damaged or crafted, checksums resealed included:
only regular files are opened (never through a symlink, never a FIFO or device), every size is
checked before anything is read or allocated (JSON files are capped, array members are stored
uncompressed and must add up to the file's real size), and every structural surprise (schema,
array names, dtypes, shapes) is a ``CheckpointError``. ``latest_checkpoint`` then falls back to
the previous checkpoint, so a damaged one costs a warning, not a crash, a hang or the memory.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import stat
import tempfile
import time
import warnings
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import IO, Any

import numpy as np

FORMAT_VERSION = 1
_FORMAT = "keras-dp-checkpoint"
_NAME = re.compile(r"^step-(\d{6})-(\d{9})$")
_GROUPS = ("weights", "optimizer_variables", "metric_variables")
_FILES = ("arrays.npz", "state.json")
# state.json and manifest.json: a History of thousands of epochs is well under this
_JSON_LIMIT = 16 << 20
_NUMERIC_KINDS = "biufc"  # bool, signed, unsigned, float, complex
# A .tmp-* staging directory nobody wrote to for this long was left by a killed writer.
_STALE_STAGING_SECONDS = 15 * 60
_STATE_REQUIRED = ("epoch", "step", "seed", "global_batch_size", "num_replicas", "counts")
_STATE_OPTIONAL = ("lr_policy", "extra")
# O_NOFOLLOW: a symlink is refused, not followed; O_NONBLOCK: opening a FIFO cannot block.
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)


@dataclass
class Checkpoint:
    """Everything needed to continue a run exactly where it stopped.

    ``epoch`` is the epoch being trained and ``step`` the number of its steps already
    applied (``step == 0`` at an epoch boundary).
    """

    epoch: int
    step: int
    seed: int
    global_batch_size: int
    num_replicas: int
    weights: list[np.ndarray]
    optimizer_variables: list[np.ndarray] = field(default_factory=list)
    metric_variables: list[np.ndarray] = field(default_factory=list)
    lr_policy: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"step-{self.epoch:06d}-{self.step:09d}"


class CheckpointError(ValueError):
    """A checkpoint that cannot be used: damaged, of another format, or another model."""


def save_checkpoint(directory: str | os.PathLike[str], checkpoint: Checkpoint, *, keep: int = 3) -> Path:
    """Write ``checkpoint`` atomically under ``directory``; keep the newest ``keep`` (and always this one).

    A write that fails (a full disk) removes its partial files and raises an ``OSError`` saying
    so; the checkpoints written before are untouched. Staging directories left by killed
    writers are removed once nobody has written to them for 15 minutes.
    """
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    _remove_stale_staging(root)
    final = root / checkpoint.name
    arrays = {
        f"{group}/{i}": _plain_array(group, i, value)
        for group in _GROUPS
        for i, value in enumerate(getattr(checkpoint, group))
    }
    staging: Path | None = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        _write_files(staging, checkpoint, arrays)
        _make_room(final)
        os.replace(staging, final)
        _fsync_directory(root)
    except OSError as error:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        full = error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))
        hint = " Free disk space, or point checkpoint_dir at another disk." if full else ""
        raise OSError(
            error.errno,
            f"Could not write checkpoint {final.name} in {root}: {error.strerror or error}. The partial checkpoint "
            f"was removed; the checkpoints written before are intact.{hint}",
        ) from error
    except BaseException:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        raise
    for old in list_checkpoints(root)[:-keep] if keep > 0 else []:
        if old != final:  # a checkpoint named later than this one (say, damaged, skipped) never evicts it
            shutil.rmtree(old, ignore_errors=True)
    return final


def list_checkpoints(directory: str | os.PathLike[str]) -> list[Path]:
    """Checkpoint directories under ``directory``, oldest first.

    Temporary ``.tmp-*`` directories are ignored; a ``step-*`` entry that is not a real
    directory (a symlink, a plain file) is ignored with a warning.
    """
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match is None:
            continue
        try:
            mode = os.lstat(path).st_mode
        except OSError:  # removed meanwhile (pruned by the writer)
            continue
        if not stat.S_ISDIR(mode):
            warnings.warn(
                f"Ignoring {path}: it is {_kind(mode)}, not a checkpoint directory. Checkpoints are real "
                "directories; remove it.",
                stacklevel=2,
            )
            continue
        found.append((match.groups(), path))
    return [path for _, path in sorted(found)]


def load_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify one checkpoint directory; a ``CheckpointError`` says what is wrong."""
    path = Path(path)
    try:
        return _load(path)
    except CheckpointError:
        raise
    except (OSError, ValueError, EOFError, RecursionError, zipfile.BadZipFile, NotImplementedError) as error:
        raise CheckpointError(f"{path}: unreadable ({type(error).__name__}: {error}).") from error


def latest_checkpoint(directory: str | os.PathLike[str]) -> Checkpoint | None:
    """The newest checkpoint that verifies; damaged ones are reported and skipped.

    None when there is none; when every one is damaged, a warning says the run starts from
    the beginning.
    """
    paths = list_checkpoints(directory)
    for remaining, path in reversed(list(enumerate(paths))):
        try:
            return load_checkpoint(path)
        except CheckpointError as error:
            then = "Falling back to the previous one." if remaining else "No earlier checkpoint is left."
            warnings.warn(f"Skipping checkpoint: {error} {then}", stacklevel=2)
    if paths:
        warnings.warn(
            f"No usable checkpoint in {directory}: all {len(paths)} are damaged, so training starts from the "
            "beginning. Move them away to silence this.",
            stacklevel=2,
        )
    return None


def check_compatible(checkpoint: Checkpoint, weights: list[Any], *, model_name: str = "the model") -> None:
    """Fail clearly when a checkpoint belongs to another architecture."""
    saved = [tuple(w.shape) for w in checkpoint.weights]
    current = [tuple(w.shape) for w in weights]
    if saved == current:
        return
    if len(saved) != len(current):
        detail = f"it holds {len(saved)} weight arrays, {model_name} has {len(current)}"
    else:
        i = next(i for i, (a, b) in enumerate(zip(saved, current, strict=True)) if a != b)
        detail = f"weight {i} has shape {saved[i]} in the checkpoint but {current[i]} in {model_name}"
    raise CheckpointError(
        f"The checkpoint at epoch {checkpoint.epoch}, step {checkpoint.step} was written by another architecture: "
        f"{detail}. Point checkpoint_dir at an empty directory to start fresh."
    )


def _plain_array(group: str, index: int, value: Any) -> np.ndarray:
    array = np.asarray(value)
    if array.dtype == object:
        raise TypeError(f"{group}[{index}] is an object array, which would need pickle; checkpoints hold numbers only.")
    if array.dtype.kind not in _NUMERIC_KINDS:
        raise TypeError(
            f"{group}[{index}] has dtype {array.dtype}, which .npy files do not keep as numbers (it would come back "
            "as raw bytes); checkpoints hold bool, integer, float and complex arrays only."
        )
    return array


def _write_files(staging: Path, checkpoint: Checkpoint, arrays: dict[str, Any]) -> None:
    with open(staging / "arrays.npz", "wb") as f:
        np.savez(f, **arrays)  # stored, not compressed: the reader refuses compressed members
        f.flush()
        os.fsync(f.fileno())
    state = {key: value for key, value in asdict(checkpoint).items() if key not in _GROUPS}
    state["counts"] = {group: len(getattr(checkpoint, group)) for group in _GROUPS}
    _write_text(staging / "state.json", json.dumps(state, indent=1, sort_keys=True))
    manifest = {
        "format": _FORMAT,
        "format_version": FORMAT_VERSION,
        "files": {name: _sha256(staging / name) for name in _FILES},
        # added after dp-core 0.2.1, whose reader ignores them; this reader does without them
        "sizes": {name: os.stat(staging / name).st_size for name in _FILES},
        "arrays": {
            key: {"dtype": np.lib.format.dtype_to_descr(array.dtype), "shape": list(array.shape)}
            for key, array in arrays.items()
        },
    }
    _write_text(staging / "manifest.json", json.dumps(manifest, indent=1, sort_keys=True))


def _make_room(final: Path) -> None:
    try:
        mode = os.lstat(final).st_mode
    except FileNotFoundError:
        return
    if stat.S_ISDIR(mode):  # same step written again (a resumed run): replace it whole
        shutil.rmtree(final)
    else:  # the entry itself goes, never what a symlink points to
        warnings.warn(f"Replacing {final}: it was {_kind(mode)}, not a checkpoint directory.", stacklevel=3)
        os.unlink(final)


def _remove_stale_staging(root: Path) -> None:
    """``.tmp-*`` directories of killed writers. Only the primary process writes, but another run
    may be writing into the same directory now: a staging directory is removed only once nothing
    in it changed for ``_STALE_STAGING_SECONDS``. Readers never remove anything."""
    now = time.time()
    with os.scandir(root) as entries:
        staging = [e.path for e in entries if e.name.startswith(".tmp-") and e.is_dir(follow_symlinks=False)]
    for path in staging:
        try:
            with os.scandir(path) as files:
                changed = max([os.lstat(path).st_mtime, *(f.stat(follow_symlinks=False).st_mtime for f in files)])
        except OSError:  # removed meanwhile
            continue
        if now - changed > _STALE_STAGING_SECONDS:
            shutil.rmtree(path, ignore_errors=True)


def _write_text(path: Path, text: str) -> None:
    data = text.encode()
    if len(data) > _JSON_LIMIT:
        raise ValueError(
            f"{path.name} would take {len(data)} bytes, over the {_JSON_LIMIT} a reader accepts; "
            "keep extra (the History) smaller."
        )
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_directory(path: Path) -> None:
    # The rename is durable only once the directory entry is on disk.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return _sha256_of(f)


def _sha256_of(f: IO[bytes]) -> str:
    digest = hashlib.sha256()
    for chunk in iter(lambda: f.read(1 << 20), b""):
        digest.update(chunk)
    return digest.hexdigest()


# Reading. Every check below runs before the bytes it guards are read or allocated.


def _load(path: Path) -> Checkpoint:
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such checkpoint directory.") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointError(f"{path}: it is {_kind(mode)}, not a checkpoint directory.")
    manifest = _manifest(path)
    with _verified(path, "state.json", manifest) as (f, size):
        state = _state(path, _parse_json(path, "state.json", f.read(size + 1)))
    with _verified(path, "arrays.npz", manifest) as (f, size):
        groups = _arrays(path, f, size, state["counts"], manifest.get("arrays"))
    return Checkpoint(
        epoch=state["epoch"],
        step=state["step"],
        seed=state["seed"],
        global_batch_size=state["global_batch_size"],
        num_replicas=state["num_replicas"],
        lr_policy=state.get("lr_policy"),
        extra=state.get("extra", {}),
        **groups,
    )


def _damaged(path: Path, name: str, problem: str) -> CheckpointError:
    return CheckpointError(f"{path}: {name} is damaged: {problem}.")


def _kind(mode: int) -> str:
    kinds = [
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISREG, "a regular file"),
    ]
    return next((kind for test, kind in kinds if test(mode)), "a special file")


@contextmanager
def _regular_file(path: Path, name: str) -> Iterator[tuple[IO[bytes], int]]:
    """``path / name`` open for reading, and its size, if it is a regular file in ``path``."""
    try:
        before = os.lstat(path / name)
    except FileNotFoundError:
        raise _damaged(path, name, "the file is missing") from None
    if not stat.S_ISREG(before.st_mode):  # refused before opening: opening a device can have effects
        raise _damaged(path, name, f"it is {_kind(before.st_mode)}, not a regular file (not read)")
    fd = os.open(path / name, _OPEN_FLAGS)
    with os.fdopen(fd, "rb") as f:
        after = os.fstat(fd)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino) or not stat.S_ISREG(after.st_mode):
            raise CheckpointError(f"{path}: {name} was replaced while being opened.")
        yield f, after.st_size


def _manifest(path: Path) -> dict[str, Any]:
    with _regular_file(path, "manifest.json") as (f, size):
        if size > _JSON_LIMIT:
            raise _damaged(path, "manifest.json", f"{size} bytes, more than the {_JSON_LIMIT} a manifest may have")
        manifest = _parse_json(path, "manifest.json", f.read(size + 1), unreadable=True)
    if manifest.get("format") != _FORMAT or manifest.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(
            f"{path}: format {manifest.get('format')!r} version {manifest.get('format_version')!r}, "
            f"expected {_FORMAT} version {FORMAT_VERSION}."
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or set(files) != set(_FILES) or not all(isinstance(v, str) for v in files.values()):
        raise _damaged(path, "manifest.json", f"'files' is {_short(files)}, expected a SHA-256 for each of {_FILES}")
    sizes = manifest.get("sizes")  # absent in checkpoints of dp-core 0.2.1 and before
    if sizes is not None and (
        not isinstance(sizes, dict) or set(sizes) != set(_FILES) or not all(map(_count, sizes.values()))
    ):
        raise _damaged(path, "manifest.json", f"'sizes' is {_short(sizes)}, expected a byte count for each of {_FILES}")
    records = manifest.get("arrays")
    if records is not None and (not isinstance(records, dict) or not all(map(_is_record, records.values()))):
        raise _damaged(path, "manifest.json", "'arrays' is not a {name: {dtype, shape}} mapping")
    return manifest


@contextmanager
def _verified(path: Path, name: str, manifest: dict[str, Any]) -> Iterator[tuple[IO[bytes], int]]:
    """``name`` open at its start after its size and SHA-256 matched the manifest."""
    with _regular_file(path, name) as (f, size):
        recorded = (manifest.get("sizes") or {}).get(name)
        if recorded is not None and size != recorded:
            raise _damaged(path, name, f"{size} bytes, but the manifest says {recorded}")
        if name.endswith(".json") and size > _JSON_LIMIT:
            raise _damaged(path, name, f"{size} bytes, more than the {_JSON_LIMIT} a JSON file may have")
        actual, expected = _sha256_of(f), manifest["files"][name]
        if actual != expected:
            raise CheckpointError(f"{path}: {name} is damaged (SHA-256 {actual[:12]}, manifest says {expected[:12]}).")
        f.seek(0)
        yield f, size


def _parse_json(path: Path, name: str, data: bytes, *, unreadable: bool = False) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as error:  # RecursionError: nested too deep to be ours
        if unreadable:
            raise CheckpointError(f"{path}: unreadable {name} ({type(error).__name__}: {error}).") from error
        raise _damaged(path, name, f"not JSON ({type(error).__name__}: {error})") from error
    if not isinstance(value, dict):
        raise _damaged(path, name, f"it holds {type(value).__name__}, expected an object")
    return value


def _state(path: Path, state: dict[str, Any]) -> dict[str, Any]:
    """``state.json`` checked against the one schema ``save_checkpoint`` writes."""
    missing = [key for key in _STATE_REQUIRED if key not in state]
    unknown = sorted(set(state) - {*_STATE_REQUIRED, *_STATE_OPTIONAL})
    if missing or unknown:
        raise _damaged(path, "state.json", f"keys missing: {missing}, unknown: {unknown}")
    for key, minimum in (("epoch", 0), ("step", 0), ("seed", None), ("global_batch_size", 1), ("num_replicas", 1)):
        value = state[key]
        if isinstance(value, bool) or not isinstance(value, int) or (minimum is not None and value < minimum):
            expected = "an integer" if minimum is None else f"an integer >= {minimum}"
            raise _damaged(path, "state.json", f"{key} is {_short(value)}, expected {expected}")
    counts = state["counts"]
    if not isinstance(counts, dict) or set(counts) != set(_GROUPS) or not all(map(_count, counts.values())):
        raise _damaged(path, "state.json", f"counts is {_short(counts)}, expected a count for each of {_GROUPS}")
    if not isinstance(state.get("lr_policy"), (dict, type(None))) or not isinstance(state.get("extra", {}), dict):
        raise _damaged(path, "state.json", "lr_policy must be an object or null, extra an object")
    match = _NAME.match(path.name)
    if match is not None and (int(match[1]), int(match[2])) != (state["epoch"], state["step"]):
        raise _damaged(
            path, "state.json", f"it is of epoch {state['epoch']}, step {state['step']}, not those the name says"
        )
    return state


def _arrays(
    path: Path, f: IO[bytes], size: int, counts: dict[str, int], records: dict[str, Any] | None
) -> dict[str, list[np.ndarray]]:
    """The arrays of ``arrays.npz`` (``size`` bytes on disk), by group. Members are stored, not
    compressed, so no member can unpack to more than its share of the file: nothing read here
    adds up to more than ``size`` bytes."""
    archive = zipfile.ZipFile(f)
    members = archive.infolist()
    total = sum(counts.values())
    if total > len(members):  # checked first: ``expected`` is never longer than the archive's list
        raise _damaged(path, "arrays.npz", f"state.json counts {total} arrays, it holds {len(members)}")
    expected = [f"{group}/{i}" for group in _GROUPS for i in range(counts[group])]
    names, wanted = [member.filename for member in members], {f"{key}.npy" for key in expected}
    if len(names) != len(wanted) or set(names) != wanted:
        unknown, missing = sorted(set(names) - wanted), sorted(wanted - set(names))
        raise _damaged(path, "arrays.npz", f"arrays not in state.json: {unknown[:5]}, missing: {missing[:5]}")
    if records is not None and set(records) != set(expected):
        raise _damaged(path, "arrays.npz", "its arrays are not those the manifest lists")
    for member in members:
        if member.flag_bits & 0x1:
            raise _damaged(path, "arrays.npz", f"{member.filename} is encrypted; checkpoints never are")
        if member.compress_type != zipfile.ZIP_STORED or member.file_size != member.compress_size:
            raise _damaged(path, "arrays.npz", f"{member.filename} is compressed; checkpoints never are")
        if member.header_offset + member.compress_size > size:
            raise _damaged(path, "arrays.npz", f"{member.filename} claims {member.file_size} bytes past the file's end")
    if sum(member.file_size for member in members) > size:
        raise _damaged(path, "arrays.npz", f"its members claim more bytes than the file's {size}")
    by_name = {member.filename: member for member in members}
    arrays = {key: _array(path, archive, by_name[f"{key}.npy"], (records or {}).get(key)) for key in expected}
    return {group: [arrays[f"{group}/{i}"] for i in range(counts[group])] for group in _GROUPS}


def _array(path: Path, archive: zipfile.ZipFile, member: zipfile.ZipInfo, record: dict[str, Any] | None) -> np.ndarray:
    """One ``.npy`` member; its header is checked against its size and the manifest's record
    before the array is allocated."""
    with archive.open(member) as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise _damaged(path, "arrays.npz", f"{member.filename} is .npy version {version}, not 1.0 or 2.0")
        if not all(n >= 0 for n in shape):
            raise _damaged(path, "arrays.npz", f"{member.filename} has shape {shape}")
        if dtype.kind not in _NUMERIC_KINDS or dtype.hasobject or dtype.subdtype is not None:
            raise _damaged(path, "arrays.npz", f"{member.filename} has dtype {dtype}, not a number type")
        nbytes = math.prod(shape) * dtype.itemsize
        if f.tell() + nbytes != member.file_size:
            raise _damaged(
                path, "arrays.npz", f"{member.filename} says shape {shape} of {dtype}, which is not its size"
            )
        if record is not None and (record["shape"], record["dtype"]) != (
            list(shape),
            np.lib.format.dtype_to_descr(dtype),
        ):
            raise _damaged(path, "arrays.npz", f"{member.filename} is {dtype} {shape}, the manifest says otherwise")
        flat = np.empty(math.prod(shape), dtype=dtype)
        raw = flat.view(np.uint8)
        done = 0
        while done < nbytes:
            chunk = f.read(min(nbytes - done, 1 << 20))
            if not chunk:
                raise _damaged(path, "arrays.npz", f"{member.filename} ends early")
            raw[done : done + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            done += len(chunk)
    return flat.reshape(shape[::-1]).transpose() if fortran_order else flat.reshape(shape)


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_record(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and isinstance(value.get("dtype"), str)
        and isinstance(value.get("shape"), list)
        and all(map(_count, value["shape"]))
    )


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def check_checkpoint_arguments(checkpoint_dir: Any, checkpoint_every_steps: Any) -> None:
    """``fit``'s checkpoint arguments, checked before anything starts."""
    if checkpoint_every_steps is None:
        return
    if isinstance(checkpoint_every_steps, bool) or not isinstance(checkpoint_every_steps, int):
        raise ValueError(f"checkpoint_every_steps must be a positive integer or None, got {checkpoint_every_steps!r}.")
    if checkpoint_every_steps < 1:
        raise ValueError(f"checkpoint_every_steps must be a positive integer or None, got {checkpoint_every_steps!r}.")
    if checkpoint_dir is None:
        raise ValueError(
            f"checkpoint_every_steps={checkpoint_every_steps} needs a checkpoint_dir to write to; pass "
            "checkpoint_dir='path/to/dir' as well."
        )
