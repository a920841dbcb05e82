"""Data-plane benchmark: put+get against raw pyarrow, bytes against padding, meta size, per-op latency.

Local disk and a loopback S3 server (moto) side by side; writes bench/results/dataplane.md.
Run from the repository root: ``python bench/dataplane.py`` (``--quick``: a smoke run; ``--out FILE``: write there).
"""

from __future__ import annotations

import collections
import gc
import os
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataplane import fields as F  # noqa: E402
from dataplane.client import DataPlane  # noqa: E402
from dataplane.codec import nested_from_values  # noqa: E402
from dataplane.meta import KVBatchMeta  # noqa: E402

warnings.filterwarnings("ignore", message="The given NumPy array is not writable")  # read-only Arrow buffers
QUICK = "--quick" in sys.argv
SIZES = [256] if QUICK else [1024, 8192]
REPEATS = {256: 2, 1024: 5, 8192: 5}
LAT_REPEATS = 5 if QUICK else 25
META_SIZES = [8, 64, 512, 1024, 8192] if QUICK else [8, 64, 256, 1024, 4096, 8192, 32768]
MIN_LEN, MAX_LEN, VOCAB, GROUP = 64, 4096, 49152, 8
TOKEN = {F.INPUT_IDS: "int64", F.GENERATION_LOGPROBS: "float32", F.TOKEN_MASK: "bool"}
SAMPLE = {F.INPUT_LENGTHS: "int64", F.REWARDS: "float32", F.SAMPLE_MASK: "bool"}
SCHEMA = {**TOKEN, **SAMPLE, F.PREV_LOGPROBS: "float32"}
FIELDS = [*TOKEN, *SAMPLE]
HISTORY = "## Before and after"  # a hand-written section at the end of OUT that a new run keeps
OUT = (
    Path(sys.argv[sys.argv.index("--out") + 1])
    if "--out" in sys.argv
    else Path(__file__).resolve().parent / "results" / "dataplane.md"
)


# ---------------------------------------------------------------- data
def step_columns(n: int, seed: int = 0, min_len: int = MIN_LEN, max_len: int = MAX_LEN) -> dict[str, torch.Tensor]:
    """One GRPO step's rollout columns: N samples, lengths uniform in min_len..max_len (seeded)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(min_len, max_len + 1, (n,), generator=g)  # [N]
    total = int(lens.sum())
    prompt = torch.minimum(torch.randint(16, 257, (n,), generator=g), lens - 1)  # [N] prompt tokens per row
    pos = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)  # [T] position in row
    return {
        F.INPUT_IDS: nested_from_values(torch.randint(0, VOCAB, (total,), generator=g), lens),
        F.GENERATION_LOGPROBS: nested_from_values(-torch.rand(total, generator=g) * 5, lens),
        F.TOKEN_MASK: nested_from_values(pos >= torch.repeat_interleave(prompt, lens), lens),  # response tokens
        F.INPUT_LENGTHS: lens,
        F.REWARDS: torch.randint(0, 2, (n,), generator=g).float(),
        F.SAMPLE_MASK: torch.ones(n, dtype=torch.bool),
    }


def padded_bytes(cols: dict[str, torch.Tensor]) -> int:
    """Bytes of the same columns as dense tensors padded to the longest row ([N, S] per-token, [N] per-sample)."""
    lens = cols[F.INPUT_LENGTHS]
    n, s = lens.shape[0], int(lens.max())
    return sum(
        n * s * v.values().element_size() if v.is_nested else v.numel() * v.element_size() for v in cols.values()
    )


def jagged_bytes(cols: dict[str, torch.Tensor]) -> int:
    return sum(v.values().nbytes + v.offsets().nbytes if v.is_nested else v.nbytes for v in cols.values())


# ---------------------------------------------------------------- raw pyarrow baseline
def raw_table(cols: dict[str, torch.Tensor]) -> pa.Table:
    """The same columns as an Arrow table: per-token -> large_list (offsets + values, zero-copy), per-sample -> flat."""
    arrays = {}
    for name, v in cols.items():
        if v.is_nested:
            arrays[name] = pa.LargeListArray.from_arrays(pa.array(v.offsets().numpy()), pa.array(v.values().numpy()))
        else:
            arrays[name] = pa.array(v.numpy())
    return pa.table(arrays)


def raw_to_torch(table: pa.Table) -> dict[str, torch.Tensor]:
    """What a consumer does with a read table: list columns -> jagged nested tensors, flat -> 1-D tensors."""
    out = {}
    for name in table.column_names:
        col = table.column(name)
        arr = col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()  # combine_chunks copies even one chunk
        if pa.types.is_large_list(arr.type):
            offsets = torch.from_numpy(arr.offsets.to_numpy())
            values = torch.from_numpy(arr.values.to_numpy(zero_copy_only=False))
            out[name] = torch.nested.nested_tensor_from_jagged(values, offsets=offsets)
        else:
            out[name] = torch.from_numpy(arr.to_numpy(zero_copy_only=False))
    return out


def raw_put(fs, path: str, cols: dict[str, torch.Tensor], **options) -> None:  # noqa: ANN001
    with fs.open(path, "wb") as fh:
        pq.write_table(raw_table(cols), fh, **options)


def raw_get(fs, path: str) -> dict[str, torch.Tensor]:  # noqa: ANN001
    with fs.open(path, "rb") as fh:
        return raw_to_torch(pq.read_table(fh, columns=FIELDS))


# ---------------------------------------------------------------- helpers
def timed(fn: Callable[[], object], *, collect: bool = True) -> tuple[float, object]:
    if collect:  # before big operations only: a full collection here takes ~0.1 s
        gc.collect()
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    for name, v in a.items():
        w = b[name]
        if v.is_nested:
            if not (torch.equal(v.offsets(), w.offsets()) and torch.equal(v.values(), w.values())):
                return False
        elif not torch.equal(v, w):
            return False
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Counter:
    """Counts the HTTP requests an s3fs filesystem sends (every call of its botocore client, by operation)."""

    def __init__(self, fs) -> None:  # noqa: ANN001
        self.calls: collections.Counter[str] = collections.Counter()
        self.log: list[str] = []
        fs.connect()  # creates the botocore client
        client = fs.s3
        real = client._make_api_call

        async def call(operation, params):  # noqa: ANN001, ANN202
            self.calls[operation] += 1
            self.log.append(f"{operation} {params.get('Key', params.get('Prefix', ''))}")
            return await real(operation, params)

        client._make_api_call = call

    def take(self) -> int:
        n = sum(self.calls.values())
        self.calls.clear()
        self.log.clear()
        return n


# ---------------------------------------------------------------- (1) + (2) throughput and bytes
def dp_write_options() -> dict:
    """The Parquet options the data plane writes with (for the second raw baseline)."""
    try:
        from dataplane.client import _parquet_options

        return _parquet_options(raw_table(step_columns(2, min_len=1, max_len=2)).schema)
    except ImportError:  # the data plane before it chose per-type encodings
        return {"compression": "lz4", "use_dictionary": False}


def bench_throughput(store: str, root: str, options: dict, n: int, *, warm_up: bool) -> dict[str, float]:
    """Median put / get seconds of the data plane and of raw pyarrow (defaults, and dp's write options)."""
    dp = DataPlane(root, "bench", storage_options=options)
    cols = step_columns(n, seed=n)
    reps = REPEATS[n]
    enc = dp_write_options()
    t = collections.defaultdict(list)
    sizes = {}
    for r in range(0 if warm_up else 1, reps + 1):  # round 0 warms up (connections, allocator) and is not counted
        part = f"tp_{n}_{r}"
        raw_path = {"raw": f"{dp._part(part)}-raw.parquet", "raw_enc": f"{dp._part(part)}-raw-enc.parquet"}
        dp.register_partition(part, fields=SCHEMA)
        order = ["dp", "raw", "raw_enc"]
        order = order[r % 3 :] + order[: r % 3]  # rotate who goes first
        for side in order:
            if side == "dp":
                dt_put, meta = timed(lambda: dp.put(part, cols, group_size=GROUP))
                dt_get, got = timed(lambda: dp.read(meta, FIELDS, layout="jagged"))
                if store == "local" and r:  # padding is CPU work on the read tensors: measured on local disk only
                    t["dp_pad"].append(timed(lambda: dp.read(meta, FIELDS))[0])
            else:
                opts = enc if side == "raw_enc" else {}
                dt_put, _ = timed(lambda: raw_put(dp.fs, raw_path[side], cols, **opts))
                dt_get, got = timed(lambda: raw_get(dp.fs, raw_path[side]))
            assert same(cols, got), f"{side} read back different data"
            del got
            if r:
                t[f"{side}_put"].append(dt_put)
                t[f"{side}_get"].append(dt_get)
        data = dp.fs.ls(f"{dp._part(part)}/data", detail=True)
        sizes = {"dp_bytes": sum(f["size"] for f in data), **{f"{k}_bytes": dp.fs.size(v) for k, v in raw_path.items()}}
        dp.clear(part)
        for path in raw_path.values():
            dp.fs.rm(path)
    m = {k: med(v) for k, v in t.items()}
    dp_s = m["dp_put"] + m["dp_get"]
    rounds = [(rp + rg) / (dp_ + dg) for rp, rg, dp_, dg in zip(t["raw_put"], t["raw_get"], t["dp_put"], t["dp_get"])]
    return {
        "store": store,
        "n": n,
        "tokens": int(cols[F.INPUT_LENGTHS].sum()),
        "reps": reps,
        "mb": jagged_bytes(cols) / 1e6,
        **m,
        **sizes,
        "padded_bytes": padded_bytes(cols),
        "jagged_bytes": jagged_bytes(cols),
        "ratio_put": m["raw_put"] / m["dp_put"],
        "ratio_get": m["raw_get"] / m["dp_get"],
        "ratio": (m["raw_put"] + m["raw_get"]) / dp_s,
        "ratio_enc": (m["raw_enc_put"] + m["raw_enc_get"]) / dp_s,
        "ratio_min": min(rounds),
        "ratio_max": max(rounds),
    }


# ---------------------------------------------------------------- (3) meta size
def bench_meta() -> list[dict[str, float]]:
    from flytekit.core.context_manager import FlyteContextManager
    from flytekit.core.type_engine import TypeEngine

    ctx = FlyteContextManager.current_context()
    lt = TypeEngine.to_literal_type(KVBatchMeta)
    rows = []
    TypeEngine.to_literal(ctx, KVBatchMeta("warm_up", ["a_g0"]), KVBatchMeta, lt)
    for n in META_SIZES:
        g = torch.Generator().manual_seed(n)
        ids = [f"{uuid.uuid4().hex}_g{i}" for _ in range(n // GROUP) for i in range(GROUP)]
        meta = KVBatchMeta(
            partition_id="step_000001",
            sample_ids=ids,
            task_name="rollout",
            fields=list(F.ROLLOUT_FIELDS),
            sequence_lengths=torch.randint(MIN_LEN, MAX_LEN + 1, (n,), generator=g).tolist(),
            extra_info={f"rollout/metric_{i}": 0.1 * i for i in range(10)} | {"global_forward_pad_seqlen": 4096.0},
        ).stamp_pad_seqlen()
        tagged = meta.stamp_tags(
            {"baseline": torch.rand(n, generator=g).tolist(), "std": torch.rand(n, generator=g).tolist()}
        )
        row: dict[str, float] = {"n": n}
        for key, m in (("plain", meta), ("tagged", tagged)):
            t0 = time.perf_counter()
            blob = TypeEngine.to_literal(ctx, m, KVBatchMeta, lt).to_flyte_idl().SerializeToString()
            row[f"{key}_s"] = time.perf_counter() - t0
            row[key] = len(blob)
            back = TypeEngine.to_python_value(ctx, TypeEngine.to_literal(ctx, m, KVBatchMeta, lt), KVBatchMeta)
            assert back.sample_ids == m.sample_ids
        rows.append(row)
    return rows


# ---------------------------------------------------------------- (4) fixed per-operation latency
def bench_latency(store: str, root: str, options: dict) -> dict[str, tuple[float, float]]:
    dp = DataPlane(root, "lat", storage_options=options)
    counter = S3Counter(dp.fs) if store == "s3" else None
    cols = step_columns(8, seed=1, min_len=64, max_len=64)
    lp = {F.PREV_LOGPROBS: nested_from_values(torch.zeros(8 * 64), torch.full((8,), 64))}
    read_fields = [F.INPUT_IDS, F.INPUT_LENGTHS, F.TOKEN_MASK, F.SAMPLE_MASK, F.PREV_LOGPROBS]
    t = collections.defaultdict(list)
    req: dict[str, int] = {}
    for r in range(LAT_REPEATS + 2):
        part = f"lat_{r}"
        ops = [
            ("register", lambda: dp.register_partition(part, fields=SCHEMA)),
            ("put", lambda: dp.put(part, cols, group_size=GROUP)),
            ("delta write", lambda: dp.write_columns(state["meta"], lp)),
            ("read (5 fields, padded)", lambda: dp.read(state["meta"], read_fields)),
            ("clear", lambda: dp.clear(part)),
        ]
        state: dict[str, KVBatchMeta] = {}
        for name, fn in ops:
            if counter:
                counter.take()
            dt, out = timed(fn, collect=False)
            if name == "put":
                state["meta"] = out
            if counter:
                req[name] = counter.take()
            if r >= 2:  # two warm-up rounds
                t[name].append(dt)
    return {k: (med(v) * 1e3, req.get(k, float("nan"))) for k, v in t.items()}


# ---------------------------------------------------------------- report
def machine() -> str:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines()
            if ln.startswith("Model name")
        ),
        "?",
    )
    return (
        f"nproc {os.cpu_count()}, CPU {cpu}, Python {platform.python_version()}, torch {torch.__version__}, "
        f"pyarrow {pa.__version__}, torch threads {torch.get_num_threads()}, arrow threads {pa.cpu_count()}"
    )


def report(tp: list[dict], meta_rows: list[dict], lat: dict[str, dict], cmd: str, wall_s: float) -> str:
    lines = [
        "# Data-plane benchmark",
        "",
        f"Command: `{cmd}` (from the repository root; {wall_s:.0f} s wall in all)  ",
        f"Machine: {machine()}  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        "Columns of one GRPO step: `input_ids` int64, `generation_logprobs` float32, `token_mask` bool (per-token,",
        f"jagged), `input_lengths` int64, `rewards` float32, `sample_mask` bool (per-sample); lengths uniform in "
        f"{MIN_LEN}..{MAX_LEN} tokens (seeded), token ids uniform in 0..{VOCAB - 1}. Times are medians of the repeats "
        "shown (one warm-up round before the first size, not counted; the order of the sides rotates each round).",
        "",
        "## 1. put + get throughput against raw pyarrow (same columns, same fsspec filesystem)",
        "",
        "| store | N | tokens | MB (jagged, in memory) | reps | dp put s | dp get s | raw put s | raw get s | put "
        "ratio | get ratio | **put+get ratio** | per-round range | dp put+get MB/s | raw (dp's encodings) put+get s "
        "| ratio to it |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in tp:
        mbps = r["mb"] / (r["dp_put"] + r["dp_get"])
        lines.append(
            f"| {r['store']} | {r['n']} | {r['tokens']:,} | {r['mb']:.1f} | {r['reps']} | {r['dp_put']:.3f} | "
            f"{r['dp_get']:.3f} | {r['raw_put']:.3f} | {r['raw_get']:.3f} | {r['ratio_put']:.2f}x | "
            f"{r['ratio_get']:.2f}x | **{r['ratio']:.2f}x** | {r['ratio_min']:.2f}-{r['ratio_max']:.2f}x | {mbps:.0f} "
            f"| {r['raw_enc_put'] + r['raw_enc_get']:.3f} | {r['ratio_enc']:.2f}x |"
        )
    pads = [f"N={r['n']}: {r['dp_pad']:.3f} s" for r in tp if "dp_pad" in r]
    lines += [
        "",
        "Ratio = raw time / data-plane time (throughput of the data plane relative to raw pyarrow; 1.0 = as fast, goal",
        ">= 0.8), from the medians; per-round range = the same ratio in each round alone (this 2-core VM is noisy:",
        "page faults on fresh memory cost as much as the work, so single rounds swing by 2x).",
        "",
        "- **dp put** = `DataPlane.put(partition, columns, group_size=8)`: reads `_schema.json`, checks every column",
        "  (dtype, row count, per-token lengths), mints N sample ids, builds the Arrow table (zero-copy from the",
        "  jagged tensors) plus a `sample_id` string column, writes one Parquet file through `fs.open(path, 'wb')`",
        "  (lz4; floats BYTE_STREAM_SPLIT, integers DELTA_BINARY_PACKED) and then its commit record (local: temp",
        "  file + rename; S3: one PUT).",
        "- **dp get** = `DataPlane.read(meta, 6 fields, layout='jagged')`: lists the partition once, fetches the",
        "  schema and commit records in one batch, opens the data file with `fs.open(path, 'rb')`,",
        "  `pq.read_table(columns=...)`, checks the sample ids against the meta, and returns jagged nested tensors /",
        "  1-D tensors (zero-copy except bool).",
        "- **raw put** = build the same Arrow table from the same tensors (large_list columns over the tensors'",
        "  offsets and values, no `sample_id`) and `pq.write_table(table, fh)` with pyarrow's defaults (snappy,",
        "  dictionary encoding) into `fs.open(path, 'wb')` on the same filesystem.",
        "- **raw get** = `pq.read_table(fs.open(path, 'rb'), columns=...)`, then the same conversion a consumer",
        "  does: list columns -> `torch.nested.nested_tensor_from_jagged(values, offsets)`, flat -> "
        "`torch.from_numpy`.",
        "- **raw (dp's encodings)**: the raw baseline again, written with the data plane's Parquet options instead",
        "  of pyarrow's defaults: the ratio to it is the cost of the data plane's own bookkeeping alone.",
        "- Every side is checked to return exactly the written tensors. Not in the ratio: the default padded",
        "  read (`DataPlane.read(meta, 6 fields)`, which also pads every per-token field to dense [N, S] tensors,",
        "  what the train and logprob tasks consume) takes, on local disk, " + "; ".join(pads) + ".",
        "",
        "## 2. bytes stored against the same data padded to the longest row",
        "",
        "| store | N | padded (dense [N, S] tensors) MB | jagged in memory MB | dp Parquet MB | **dp / "
        "padded** | raw pyarrow (defaults) MB | raw / padded |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in tp:
        p = r["padded_bytes"]
        lines.append(
            f"| {r['store']} | {r['n']} | {p / 1e6:.1f} | {r['jagged_bytes'] / 1e6:.1f} | {r['dp_bytes'] / 1e6:.1f} | "
            f"**{r['dp_bytes'] / p:.3f}** | {r['raw_bytes'] / 1e6:.1f} | {r['raw_bytes'] / p:.3f} |"
        )
    lines += [
        "",
        "Padded = N x max(length) x itemsize per per-token column (bool as 1 byte, as torch stores it) plus the",
        "per-sample columns. dp Parquet = the data file of the put (commit record and schema add < 1 KB).",
        "",
        "## 3. serialized size of a meta as Flyte passes it",
        "",
        "`TypeEngine.to_literal(ctx, meta, KVBatchMeta, "
        "TypeEngine.to_literal_type(KVBatchMeta)).to_flyte_idl().SerializeToString()`;",
        "a rollout meta (14 field names, `sequence_lengths`, 11 `extra_info` numbers) and the same meta with the",
        "per-row `tags` the advantages task adds (`baseline`, `std`).",
        "",
        "| N samples | bytes | bytes / sample | to_literal+serialize ms | with tags: bytes | bytes / sample | ms |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in meta_rows:
        lines.append(
            f"| {r['n']} | {r['plain']:,} | {r['plain'] / r['n']:.1f} | {r['plain_s'] * 1e3:.1f} | "
            f"{r['tagged']:,} | {r['tagged'] / r['n']:.1f} | {r['tagged_s'] * 1e3:.1f} |"
        )
    lines += [
        "",
        f"## 4. fixed per-operation latency (8 samples x 64 tokens, median of {LAT_REPEATS})",
        "",
        "| operation | local ms | loopback S3 ms | S3 requests |",
        "|---|---|---|---|",
    ]
    for op in lat["local"]:
        lo, s3 = lat["local"][op], lat["s3"][op]
        lines.append(f"| {op} | {lo[0]:.2f} | {s3[0]:.2f} | {s3[1]} |")
    total_lo = sum(v[0] for v in lat["local"].values())
    total_s3 = sum(v[0] for v in lat["s3"].values())
    lines.append(
        f"| **all five (one step's data-plane floor)** | **{total_lo:.2f}** | **{total_s3:.2f}** | "
        f"{sum(v[1] for v in lat['s3'].values())} |"
    )
    lines += [
        "",
        "S3 requests = HTTP requests s3fs sends during the operation (counted at its botocore client). The loopback",
        "server (moto, in this process) answers a request in ~5-15 ms, so these are request counts more than",
        "realistic S3 latencies; a step pays the five operations about once per task (register and put once, one",
        "delta write per logprob/advantage task, one read per consumer, one clear).",
        "",
    ]
    return "\n".join(lines)


def main() -> None:
    from moto.server import ThreadedMotoServer

    start = time.perf_counter()
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    tmp = Path(tempfile.mkdtemp(prefix="dp-bench-"))
    try:
        endpoint = f"http://127.0.0.1:{port}"
        import boto3

        boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket="bench")
        stores = {"local": (str(tmp / "dp"), {}), "s3": ("s3://bench/dp", {"endpoint_url": endpoint})}
        tp = []
        for n in SIZES:
            for store, (root, options) in stores.items():
                row = bench_throughput(store, root, options, n, warm_up=n == SIZES[0])
                print(
                    f"[bench] {store} N={n}: put+get ratio {row['ratio']:.2f}x ({time.perf_counter() - start:.0f} s)",
                    flush=True,
                )
                tp.append(row)
        lat = {store: bench_latency(store, root, options) for store, (root, options) in stores.items()}
        print(f"[bench] latency done ({time.perf_counter() - start:.0f} s)", flush=True)
        meta_rows = bench_meta()
        cmd = " ".join(["python bench/dataplane.py", *sys.argv[1:]])
        text = report(tp, meta_rows, lat, cmd, time.perf_counter() - start)
        print(text)
        if not QUICK or "--out" in sys.argv:
            OUT.parent.mkdir(parents=True, exist_ok=True)
            kept = OUT.read_text().partition(HISTORY)[2] if OUT.exists() else ""
            OUT.write_text(text + (f"\n{HISTORY}{kept}" if kept else ""))
            print(f"[bench] wrote {OUT}")
    finally:
        server.stop()
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
