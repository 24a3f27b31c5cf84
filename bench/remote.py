"""Object stores: load_file of a 256 MiB file from an HTTP server and from S3 (moto in
server mode), both on the loopback interface, and what reading one tensor moves.

    python bench/remote.py [--mib 256] [--repeats 5]

Ways, interleaved, the median of `repeats` runs each:

* raw: ``fs.cat(url)``, the whole object into memory in one request (the limit for
  getting the bytes at all through fsspec; no tensors made);
* fastst: ``fastst.load_file(url)``: header, then the tensors in parallel ranges;
* safetensors: its ``_safe_open_handle`` over an fsspec file object where it can
  open one, else ``safetensors.numpy.load(fs.cat(url))`` (download, then parse).

Ratios are time / fastst's time (above 1: slower than fastst). Then the bytes and
requests the HTTP server counted for reading one 1 MiB tensor, fastst against the
reference's way. The servers come from tests/servers.py.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fastst  # noqa: E402
from servers import RangeServer, moto_s3  # noqa: E402

MiB = 1 << 20


def build(mib: int) -> bytes:
    return fastst.save({f"t{k:04d}": np.full(MiB // 4, k, np.float32) for k in range(mib)})


def reference_way(fs, url):
    """The reference's best way to read a URL: a file object if it takes one."""
    import safetensors
    import safetensors.numpy

    handle_open = getattr(safetensors, "_safe_open_handle", None)
    if handle_open is not None:
        try:
            with fs.open(url, "rb") as file, handle_open(file, framework="numpy") as f:
                f.keys()

            def read():
                with fs.open(url, "rb") as file, handle_open(file, framework="numpy") as f:
                    return {name: f.get_tensor(name) for name in f.keys()}
            return "safetensors _safe_open_handle(fs.open(url))", read
        except (AttributeError, TypeError, OSError):
            pass
    return ("safetensors.numpy.load(fs.cat(url))",
            lambda: safetensors.numpy.load(fs.cat(url)))


def timed(ways, repeats):
    times = {label: [] for label, _ in ways}
    for _ in range(repeats):
        for label, run in ways:
            started = time.perf_counter()
            result = run()
            times[label].append(time.perf_counter() - started)
            del result
    return {label: statistics.median(values) for label, values in times.items()}


def table(title, times, size):
    first = times["fastst load_file(url)"]
    print(f"\n### {title}\n")
    print("| way | time | throughput | time / fastst |")
    print("| --- | --- | --- | --- |")
    for label, seconds in times.items():
        print(f"| {label} | {seconds:.3f} s | {size / seconds / MiB:.0f} MiB/s | "
              f"{seconds / first:.2f}x |")


def store_ways(fs, url, options):
    reference_label, reference = reference_way(fs, url)
    return [("raw fs.cat(url)", lambda: fs.cat(url)),
            ("fastst load_file(url)", lambda: fastst.load_file(url, storage_options=options)),
            (reference_label, reference)]


def one_tensor(server, fs, url, data):
    name = f"t{len(data) // MiB // 2:04d}"   # one in the middle
    rows = []
    server.reset_counts()
    with fastst.safe_open(url) as f:
        f.get_tensor(name)
    rows.append(("fastst safe_open(url).get_tensor", len(server.requests), server.bytes_sent))
    label, _ = reference_way(fs, url)
    server.reset_counts()
    if "_safe_open_handle" in label:
        import safetensors
        with fs.open(url, "rb") as file, safetensors._safe_open_handle(file, framework="numpy") as f:
            f.get_tensor(name)
    else:
        import safetensors.numpy
        safetensors.numpy.load(fs.cat(url))[name]
    rows.append((label.replace("numpy.load(fs.cat(url))", "numpy.load(fs.cat(url))[name]"),
                 len(server.requests),
                 server.bytes_sent))
    print(f"\n### Reading one 1 MiB tensor of the {len(data) // MiB} MiB file over HTTP\n")
    print("| way | requests | bytes moved | bytes / (header + tensor) |")
    print("| --- | --- | --- | --- |")
    with fastst.safe_open(url) as f:
        needed = f.data_start + MiB
    for label, requests, sent in rows:
        print(f"| {label} | {requests} | {sent:,} | {sent / needed:.2f}x |")


def serve(data: bytes, ready, stop) -> None:
    with RangeServer({"/model.safetensors": data}) as server:
        ready.put(server.url)
        stop.wait()


def http_server_process(data: bytes):
    """The HTTP server in a process of its own (forked), as a real store is: the
    timings then do not share the benchmark's interpreter. Returns (URL, stop)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    ready, stop = context.Queue(), context.Event()
    process = context.Process(target=serve, args=(data, ready, stop), daemon=True)
    process.start()
    return ready.get(timeout=30) + "/model.safetensors", stop, process


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    import fsspec

    data = build(args.mib)
    print(f"Produced by `python bench/remote.py --mib {args.mib} --repeats {args.repeats}` on "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}: {args.mib} tensors of "
          f"1 MiB, median of {args.repeats}.")
    url, stop, process = http_server_process(data)
    try:
        fs = fsspec.filesystem("http")
        table(f"HTTP on loopback (aiohttp; the server a Python process of its own), "
              f"{args.mib} MiB", timed(store_ways(fs, url, None), args.repeats), len(data))
    finally:
        stop.set()
        process.join(10)
    with RangeServer({"/model.safetensors": data}) as server:   # in process, to count
        one_tensor(server, fsspec.filesystem("http"), f"{server.url}/model.safetensors", data)
    with moto_s3("bench") as options:
        fs = fsspec.filesystem("s3", **options)
        url = "s3://bench/model.safetensors"
        fs.pipe(url, data)
        table(f"S3 on loopback (moto server, s3fs), {args.mib} MiB",
              timed(store_ways(fs, url, options), args.repeats), len(data))
        small = timed([("1 KiB", lambda: fs.cat_file(url, start=0, end=1024))], args.repeats)
        print(f"\nOne ranged GET of 1 KiB of this object on moto: {small['1 KiB']:.3f} s "
              f"(moto reads the whole object to answer any range).")


if __name__ == "__main__":
    main()
