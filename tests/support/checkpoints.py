"""Safetensors checkpoints for weight-update tests, written with the format's own layout.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and `data_offsets` into the data that follows, then the data. Written here by hand
(numpy only) so the tests need neither torch nor the safetensors package.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

_DTYPES = {np.dtype(np.float32): "F32", np.dtype(np.float16): "F16", np.dtype(np.int64): "I64"}


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Write `tensors` as one safetensors file at `path`."""
    header: dict[str, object] = {}
    chunks: list[bytes] = []
    offset = 0
    for name, array in tensors.items():
        data = np.ascontiguousarray(array).tobytes()
        header[name] = {
            "dtype": _DTYPES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(data)],
        }
        chunks.append(data)
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # the format pads the header to 8 bytes with spaces
    path.write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(chunks))


def toy_checkpoint(directory: Path, seed: int) -> Path:
    """A small checkpoint directory whose weights depend on `seed` (different seeds: different
    simulated models)."""
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    write_safetensors(
        directory / "model.safetensors",
        {
            "embed.weight": rng.standard_normal((16, 8)).astype(np.float32),
            "norm.weight": np.ones(8, np.float32),
        },
    )
    return directory


def truncate(file: Path) -> None:
    """Cut `file` in half, as an interrupted copy leaves it."""
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _bf16(values: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (round to nearest even), as uint16."""
    bits = values.astype(np.float32).view(np.uint32)
    rounded = bits + 0x7FFF + ((bits >> 16) & 1)
    return (rounded >> 16).astype(np.uint16)


def reweighted_copy(source: Path, target: Path, seed: int, scale: float = 0.05) -> Path:
    """A copy of the model directory `source` (config, tokenizer) whose `model.safetensors` has new
    random weights of the same names, shapes and dtype: matrices drawn from N(0, scale), vectors
    (norms) kept. A different checkpoint of the same model, as a training step would write."""
    target.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        if file.is_file() and not file.name.endswith(".safetensors"):
            (target / file.name).write_bytes(file.read_bytes())
    raw = (source / "model.safetensors").read_bytes()
    n = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    rng = np.random.default_rng(seed)
    out: list[bytes] = []
    new_header: dict[str, object] = {}
    offset = 0
    for name, meta in header.items():
        if name == "__metadata__":
            new_header[name] = meta
            continue
        begin, end = meta["data_offsets"]
        chunk = data[begin:end]
        if len(meta["shape"]) > 1:
            drawn = rng.standard_normal(meta["shape"]).astype(np.float32) * scale
            if meta["dtype"] == "BF16":
                chunk = _bf16(drawn).tobytes()
            elif meta["dtype"] == "F32":
                chunk = drawn.tobytes()
            elif meta["dtype"] == "F16":
                chunk = drawn.astype(np.float16).tobytes()
            else:
                raise ValueError(f"{name}: dtype {meta['dtype']} not supported")
        new_header[name] = {**meta, "data_offsets": [offset, offset + len(chunk)]}
        out.append(chunk)
        offset += len(chunk)
    text = json.dumps(new_header).encode()
    text += b" " * (-len(text) % 8)
    (target / "model.safetensors").write_bytes(len(text).to_bytes(8, "little") + text + b"".join(out))
    return target
