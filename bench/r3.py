"""R3 (routed experts) encodings: bytes on the wire and CPU time to encode and decode.

Why this exists: the contract carries routed experts as `RoutedExperts{bytes data, dtype, shape}`
instead of vLLM's base64 `.npy` inside JSON or a `repeated int32`. This benchmark measures the
three side by side on arrays of the sizes an RL trainer sees (4k and 32k tokens x 48 layers x top-8,
expert ids < 256, so uint8), in one process, so the claim "proto bytes <= 0.76 x vLLM JSON" and the
CPU cost of each encoding are numbers rather than folklore.

Encodings (each one measured end to end, from the numpy array the producer has to the numpy array
the consumer wants):

* `vllm_json_orjson` / `vllm_json_stdlib` — what vLLM does (`numpy2base64`): `np.save` into a buffer
  (uint8, `allow_pickle=False`), base64, inside a JSON body; decoded with a JSON parse, `b64decode`
  and `np.load`. Encoded/decoded once with orjson (the service's parser) and once with the standard
  `json` module (what a plain Python client such as vime's httpx `.json()` uses).
* `proto_bytes` — this service: `rollout_pb2.RoutedExperts(data=raw uint8 bytes, dtype, shape)`,
  `SerializeToString`, then `FromString` and `np.frombuffer(...).reshape(shape)`.
* `proto_repeated_int32` — a scratch message `{repeated int32 values = 1; repeated int64 shape = 2;}`
  built at run time with `descriptor_pb2` (packed varints, proto3's default), filled with
  `extend(arr.ravel().tolist())` and read back with `np.array(msg.values, dtype=uint8)`: the honest
  cost of a repeated scalar field through the protobuf runtime (upb).

CPU time is `time.process_time_ns` around each step (single-threaded work, so it equals the wall
time on an idle machine; both are recorded). Medians over `--repeats` runs.

Run: `python -m bench.r3` (about 30 s); `--quick` for a smoke run. Writes `docs/benchmarks.r3.json`
and `docs/r3.md`.
"""

from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import google.protobuf
import numpy as np
import orjson
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from google.protobuf.internal import api_implementation
from google.protobuf.message import Message

from rollout_grpc._proto import rollout_pb2 as pb

DOCS = Path(__file__).resolve().parent.parent / "docs"

LAYERS = 48
TOPK = 8
NUM_EXPERTS = 256
#: (label, tokens, repeats); the 32k case is ~12.6 M values, so it gets fewer repeats.
SIZES: tuple[tuple[str, int, int], ...] = (("4k", 4096, 21), ("32k", 32768, 7))
TARGET_RATIO = 0.76

Array = np.ndarray[Any, np.dtype[np.uint8]]


@dataclass(frozen=True, slots=True)
class Encoding:
    """One way to move the array: `encode` makes the wire bytes, `decode` gets the array back."""

    name: str
    label: str
    encode: Callable[[Array], bytes]
    decode: Callable[[bytes], Array]


# ----------------------------------------------------------------------------------- (a) vLLM JSON


def _npy_b64(array: Array) -> str:
    """vLLM's `numpy2base64`: `np.save(allow_pickle=False)` then base64."""
    buffer = io.BytesIO()
    np.save(buffer, array, allow_pickle=False)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def _from_npy_b64(encoded: str) -> Array:
    """vime's `_decode_vllm_routed_experts`: `b64decode(validate=True)` then `np.load`."""
    array: Array = np.load(io.BytesIO(base64.b64decode(encoded, validate=True)), allow_pickle=False)
    return array


def _vllm_orjson_encode(array: Array) -> bytes:
    return orjson.dumps({"routed_experts": _npy_b64(array)})


def _vllm_orjson_decode(body: bytes) -> Array:
    return _from_npy_b64(orjson.loads(body)["routed_experts"])


def _vllm_stdlib_encode(array: Array) -> bytes:
    return json.dumps({"routed_experts": _npy_b64(array)}, separators=(",", ":")).encode()


def _vllm_stdlib_decode(body: bytes) -> Array:
    return _from_npy_b64(json.loads(body)["routed_experts"])


# ----------------------------------------------------------------------------------- (b) proto bytes


def _proto_bytes_encode(array: Array) -> bytes:
    message = pb.RoutedExperts(
        data=np.ascontiguousarray(array).tobytes(), dtype=pb.D_TYPE_UINT8, shape=list(array.shape)
    )
    return message.SerializeToString()


def _proto_bytes_decode(wire: bytes) -> Array:
    message = pb.RoutedExperts.FromString(wire)
    array: Array = np.frombuffer(message.data, dtype=np.uint8).reshape(tuple(message.shape))
    return array


# ----------------------------------------------------------------------------------- (c) repeated int32


def _repeated_int32_class() -> type[Message]:
    """A scratch `message RepeatedExperts { repeated int32 values = 1; repeated int64 shape = 2; }`.

    Built from a `FileDescriptorProto` in a private pool, so the benchmark measures the real
    protobuf runtime (upb) on a proto3 packed repeated field without adding it to the contract.
    """
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="bench_r3_scratch.proto", package="bench.r3", syntax="proto3"
    )
    message_proto = file_proto.message_type.add(name="RepeatedExperts")
    label = descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
    message_proto.field.add(
        name="values", number=1, label=label, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT32
    )
    message_proto.field.add(
        name="shape", number=2, label=label, type=descriptor_pb2.FieldDescriptorProto.TYPE_INT64
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    cls: type[Message] = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("bench.r3.RepeatedExperts")
    )
    return cls


_RepeatedExperts = _repeated_int32_class()


def _repeated_encode(array: Array) -> bytes:
    message: Any = _RepeatedExperts()
    message.values.extend(array.ravel().tolist())
    message.shape.extend(array.shape)
    wire: bytes = message.SerializeToString()
    return wire


def _repeated_decode(wire: bytes) -> Array:
    message: Any = _RepeatedExperts.FromString(wire)
    array: Array = np.array(message.values, dtype=np.uint8).reshape(tuple(message.shape))
    return array


ENCODINGS: tuple[Encoding, ...] = (
    Encoding("vllm_json_orjson", "vLLM JSON, base64 .npy (orjson)", _vllm_orjson_encode, _vllm_orjson_decode),
    Encoding("vllm_json_stdlib", "vLLM JSON, base64 .npy (json)", _vllm_stdlib_encode, _vllm_stdlib_decode),
    Encoding("proto_bytes", "proto `bytes` uint8 (this service)", _proto_bytes_encode, _proto_bytes_decode),
    Encoding("proto_repeated_int32", "proto `repeated int32` (packed)", _repeated_encode, _repeated_decode),
)


def _median_ms(values_ns: list[int]) -> float:
    return round(statistics.median(values_ns) / 1e6, 3)


def measure(encoding: Encoding, array: Array, repeats: int) -> dict[str, Any]:
    """Wire size and median encode/decode CPU and wall time of one encoding on one array."""
    wire = encoding.encode(array)
    back = encoding.decode(wire)
    if back.shape != array.shape or not np.array_equal(back, array):
        raise AssertionError(f"{encoding.name} did not round-trip")
    enc_cpu: list[int] = []
    enc_wall: list[int] = []
    dec_cpu: list[int] = []
    dec_wall: list[int] = []
    for _ in range(repeats):
        gc.collect()
        c0, w0 = time.process_time_ns(), time.perf_counter_ns()
        wire = encoding.encode(array)
        c1, w1 = time.process_time_ns(), time.perf_counter_ns()
        back = encoding.decode(wire)
        c2, w2 = time.process_time_ns(), time.perf_counter_ns()
        enc_cpu.append(c1 - c0)
        enc_wall.append(w1 - w0)
        dec_cpu.append(c2 - c1)
        dec_wall.append(w2 - w1)
        del back
    return {
        "encoding": encoding.name,
        "label": encoding.label,
        "wire_bytes": len(wire),
        "encode_cpu_ms": _median_ms(enc_cpu),
        "decode_cpu_ms": _median_ms(dec_cpu),
        "total_cpu_ms": _median_ms([a + b for a, b in zip(enc_cpu, dec_cpu, strict=True)]),
        "encode_wall_ms": _median_ms(enc_wall),
        "decode_wall_ms": _median_ms(dec_wall),
        "repeats": repeats,
    }


def run(quick: bool = False, repeats: int | None = None) -> dict[str, Any]:
    """Measure every encoding at every size; return a JSON-ready dict."""
    rng = np.random.default_rng(20261129)
    cases: list[dict[str, Any]] = []
    for label, tokens, default_repeats in SIZES:
        n = repeats or (3 if quick else default_repeats)
        array: Array = rng.integers(0, NUM_EXPERTS, size=(tokens, LAYERS, TOPK), dtype=np.uint8)
        rows = [measure(encoding, array, n) for encoding in ENCODINGS]
        base = next(r for r in rows if r["encoding"] == "vllm_json_orjson")
        for row in rows:
            row["size_vs_vllm_json"] = round(row["wire_bytes"] / base["wire_bytes"], 4)
            row["cpu_vs_vllm_json"] = round(row["total_cpu_ms"] / base["total_cpu_ms"], 4)
        proto_ratio = next(r for r in rows if r["encoding"] == "proto_bytes")["size_vs_vllm_json"]
        cases.append(
            {
                "size": label,
                "shape": [tokens, LAYERS, TOPK],
                "values": tokens * LAYERS * TOPK,
                "rows": rows,
                "proto_bytes_vs_vllm_json": proto_ratio,
                "meets_target": proto_ratio <= TARGET_RATIO,
            }
        )
    return {
        "benchmark": "r3_encodings",
        "target": f"proto bytes <= {TARGET_RATIO} x vLLM JSON size",
        "expert_ids": f"uniform random in [0, {NUM_EXPERTS}), uint8",
        "environment": {
            "python": platform.python_version(),
            "numpy": np.__version__,
            "protobuf": google.protobuf.__version__,
            "protobuf_backend": api_implementation.Type(),
            "orjson": orjson.__version__,
            "machine": platform.machine(),
        },
        "cases": cases,
    }


def _kib(n: int) -> str:
    return f"{n / 1024:,.0f} KiB" if n < 1024 * 1024 else f"{n / 1024 / 1024:,.2f} MiB"


def markdown(results: dict[str, Any], heading: str = "##") -> str:
    """The R3 results as a Markdown section (one table per array size)."""
    env = results["environment"]
    out = [
        f"{heading} R3 routed experts: wire size and CPU per encoding",
        "",
        f"Arrays of `[tokens, {LAYERS}, {TOPK}]` expert ids ({results['expert_ids']}); each encoding "
        "measured from the producer's numpy array to the consumer's numpy array. CPU time is the "
        "median over the repeats (single-threaded). "
        f"Python {env['python']}, numpy {env['numpy']}, protobuf {env['protobuf']} "
        f"({env['protobuf_backend']}), orjson {env['orjson']}. Produced by `python -m bench.r3`.",
        "",
    ]
    for case in results["cases"]:
        shape = " x ".join(str(d) for d in case["shape"])
        verdict = "meets" if case["meets_target"] else "MISSES"
        out += [
            f"**{case['size']} tokens** (`{shape}` = {case['values']:,} values; proto bytes = "
            f"{case['proto_bytes_vs_vllm_json']:.3f} x vLLM JSON, {verdict} the <= {TARGET_RATIO} target)",
            "",
            "| encoding | wire bytes | vs vLLM JSON | encode CPU ms | decode CPU ms | total CPU ms |",
            "| --- | ---: | ---: | ---: | ---: | ---: |",
        ]
        for row in case["rows"]:
            out.append(
                f"| {row['label']} | {row['wire_bytes']:,} ({_kib(row['wire_bytes'])}) "
                f"| {row['size_vs_vllm_json']:.3f} | {row['encode_cpu_ms']:.2f} "
                f"| {row['decode_cpu_ms']:.2f} | {row['total_cpu_ms']:.2f} |"
            )
        out.append("")
    return "\n".join(out)


def write(results: dict[str, Any], out_dir: Path) -> None:
    """`docs/benchmarks.r3.json` and `docs/r3.md` (also written by `bench.run`, so one
    `make bench` leaves every R3 output consistent with `docs/benchmarks.md`)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "benchmarks.r3.json").write_text(json.dumps(results, indent=2) + "\n")
    (out_dir / "r3.md").write_text(markdown(results, heading="#") + "\n")


def main(argv: list[str] | None = None) -> int:
    """CLI: measure, print the table, write `docs/benchmarks.r3.json` and `docs/r3.md`."""
    parser = argparse.ArgumentParser(prog="python -m bench.r3", description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="3 repeats per case (smoke run)")
    parser.add_argument("--repeats", type=int, default=None, help="override the repeats per case")
    parser.add_argument("--out-dir", type=Path, default=DOCS)
    parser.add_argument("--no-write", action="store_true", help="print only")
    args = parser.parse_args(argv)
    results = run(quick=args.quick, repeats=args.repeats)
    print(markdown(results, heading="#"))
    if not args.no_write:
        write(results, args.out_dir)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
