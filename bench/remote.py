"""Object stores: load_file of a file of 64 tensors from an HTTP server in three shapes
(unshaped; each connection capped at 40 MB/s with 30 ms to its first byte; capped at
20 MB/s with 30 ms), and from S3 (moto in server mode), all on the loopback interface.

    python bench/remote.py [--mib 256] [--repeats 3] [--shapes unshaped,40,20] [--no-s3]
    python bench/remote.py --shapes ""          # the S3 tables alone

The HTTP server is tests/servers.py's RangeServer in a process of its own (as a real
store is: the timings do not share the benchmark's interpreter); the 20 MB/s shape
serves half the bytes (a single GET of them takes as long as one of the whole file at
40 MB/s). Ways, each run once to warm up, then interleaved (the order rotated each
round), the median of `repeats`:

* single GET: one plain ``urllib`` GET of the whole object (no tensors made);
* 32 threads: a plain client of 32 ``urllib`` threads, each taking the next 2 MiB
  range GET from a queue (no tensors made);
* fastst: ``fastst.load_file(url)`` (its own HTTP client: ``http.client`` in threads,
  each part read from its socket into its array, with ``Pace``);
* fastst, fsspec transport: the same with ``storage_options={"transport": "fsspec"}``
  (fsspec's HTTP file system on aiohttp, with the same ``Pace``): what fastst did
  before it had a client of its own;
* raw fs.cat: fsspec's ``fs.cat(url)``, the whole object in one request (no tensors);
* obstore get_ranges: obstore's ``get_ranges`` of the 64 tensors' byte ranges (its own
  coalescing and concurrency; no tensors made);
* aiohttp / obstore / http.client threads, 16 x 8 MiB parts: three transports on the
  same plan, 8 MiB ranged GETs, 16 in flight, each into its place in one buffer (no
  tensors made; http.client reads each body into its place with ``readinto``);
* reference: ``safetensors.numpy.load(fs.cat(url))`` (download, then parse).

Ratios are the best plain client's time (single GET or 32 threads) / the way's time,
and raw fs.cat's / fastst's: above 1, fastst is faster. Then the requests and bytes the
server counts for reading one tensor, fastst against the reference's way, and the S3
table (fastst, raw fs.cat, obstore, the reference).
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.client
import os
import queue
import statistics
import sys
import time
import urllib.parse
import urllib.request

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fastst  # noqa: E402
from servers import RangeServer, moto_s3  # noqa: E402

MiB = 1 << 20
TENSORS = 64
SHAPES = {"unshaped": (None, 0.0, 1), "40": (40e6, 0.03, 1), "20": (20e6, 0.03, 2)}
SHAPE_NAMES = {"unshaped": "unshaped", "40": "40 MB/s a connection, 30 ms to first byte",
               "20": "20 MB/s a connection, 30 ms to first byte"}


def build(mib: int) -> bytes:
    each = mib * MiB // TENSORS // 4
    return fastst.save({f"t{k:04d}": np.full(each, k, np.float32) for k in range(TENSORS)})


def single_get(url):
    with urllib.request.urlopen(url, timeout=120) as answer:
        return answer.read()


def threaded_ranges(url, size, threads=32, part=2 * MiB):
    out = bytearray(size)
    parts = queue.SimpleQueue()
    for offset in range(0, size, part):
        parts.put(offset)

    def work():
        while True:
            try:
                offset = parts.get_nowait()
            except queue.Empty:
                return
            end = min(size, offset + part)
            request = urllib.request.Request(url, headers={"Range": f"bytes={offset}-{end - 1}"})
            with urllib.request.urlopen(request, timeout=120) as answer:
                out[offset:end] = answer.read()

    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        for future in [pool.submit(work) for _ in range(threads)]:
            future.result()
    return out


def tensor_ranges(data: bytes):
    """The (start, end) in the file of each tensor's bytes."""
    import json
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    return [(8 + length + a, 8 + length + b) for a, b in
            (entry["data_offsets"] for entry in header.values())]


def parts_in_parallel(transport, size, at_once=16, part=8 * MiB):
    """The whole object by ranged GETs of `part` bytes, `at_once` in flight, each
    taking the next part as it ends; `transport()` is an async context giving
    ``await fetch_into(offset, view)``, which fills one."""
    out = np.empty(size, np.uint8)
    offsets = list(range(0, size, part))[::-1]

    async def everything():
        async with transport() as fetch_into:
            async def work():
                while offsets:
                    offset = offsets.pop()
                    await fetch_into(offset, memoryview(out)[offset:offset + part])
            await asyncio.gather(*[work() for _ in range(at_once)])

    asyncio.run(everything())   # returns None: a big result would be repr'd at exit
    return out


def aiohttp_transport(url):
    import aiohttp

    @contextlib.asynccontextmanager
    async def transport():
        async with aiohttp.ClientSession() as session:
            async def fetch_into(offset, view):
                headers = {"Range": f"bytes={offset}-{offset + len(view) - 1}"}
                async with session.get(url, headers=headers) as answer:
                    done = 0
                    while chunk := await answer.content.read(MiB):
                        view[done:done + len(chunk)] = chunk
                        done += len(chunk)
            yield fetch_into
    return transport


def obstore_transport(store, path):
    import obstore

    @contextlib.asynccontextmanager
    async def transport():
        async def fetch_into(offset, view):
            got = await obstore.get_range_async(store, path, start=offset,
                                                end=offset + len(view))
            view[:] = memoryview(got)
        yield fetch_into
    return transport


def threads_in_parallel(url, size, at_once=16, part=8 * MiB):
    """The whole object by ranged GETs of `part` bytes on `at_once` threads, each
    keeping its ``http.client`` connection and reading each body into its place."""
    where = urllib.parse.urlsplit(url)
    out = np.empty(size, np.uint8)
    offsets = queue.SimpleQueue()
    for offset in range(0, size, part):
        offsets.put(offset)

    def work():
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        try:
            while True:
                try:
                    offset = offsets.get_nowait()
                except queue.Empty:
                    return
                end = min(size, offset + part)
                connection.request("GET", where.path,
                                   headers={"Range": f"bytes={offset}-{end - 1}"})
                answer = connection.getresponse()
                view, done = memoryview(out)[offset:end], 0
                while done < end - offset:
                    got = answer.readinto(view[done:])
                    if not got:
                        raise OSError(f"bytes [{offset}, {end}) cut short")
                    done += got
                answer.read()
        finally:
            connection.close()

    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        for future in [pool.submit(work) for _ in range(at_once)]:
            future.result()
    return out


def obstore_ranges(store, path, ranges):
    import obstore
    starts, ends = [a for a, _ in ranges], [b for _, b in ranges]
    return obstore.get_ranges(store, path, starts=starts, ends=ends)


def timed(ways, repeats):
    times = {label: [] for label, _ in ways}
    for label, run in ways:     # warm-up: connections, caches, first-use imports
        run()
    for repeat in range(repeats):
        # the order rotated each round: a way's time depends on what ran just before it
        # (on 2 cores, the memory and connections the last way leaves to be given back)
        shift = repeat % len(ways)
        for label, run in ways[shift:] + ways[:shift]:
            started = time.perf_counter()
            result = run()
            times[label].append(time.perf_counter() - started)
            del result
    return {label: statistics.median(values) for label, values in times.items()}


def table(title, times, size):
    best_plain = min(times["single GET"], times["32 threads, 2 MiB ranges"])
    raw = times.get("raw fs.cat(url)")
    print(f"\n### {title}\n")
    print("| way | time | throughput | best plain / time |")
    print("| --- | --- | --- | --- |")
    for label, seconds in times.items():
        print(f"| {label} | {seconds:.3f} s | {size / seconds / MiB:.0f} MiB/s | "
              f"{best_plain / seconds:.2f}x |")
    fastst_time = times["fastst load_file(url)"]
    print(f"\nfastst: {best_plain / fastst_time:.2f}x the best plain client, "
          f"{times['single GET'] / fastst_time:.2f}x one GET"
          + (f", {raw / fastst_time:.2f}x raw fs.cat" if raw else "") + ".")


def serve(data: bytes, rate, delay, ready, stop) -> None:
    with RangeServer({"/model.safetensors": data}) as server:
        server.rate, server.delay = rate, delay
        ready.put(server.url)
        stop.wait()


def http_server_process(data: bytes, rate, delay):
    """The HTTP server in a process of its own (forked). Returns (URL, stop, process)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    ready, stop = context.Queue(), context.Event()
    process = context.Process(target=serve, args=(data, rate, delay, ready, stop), daemon=True)
    process.start()
    return ready.get(timeout=60) + "/model.safetensors", stop, process


def http_ways(url, data):
    import fsspec
    import safetensors.numpy
    from obstore.store import HTTPStore

    fs = fsspec.filesystem("http", skip_instance_cache=True)
    folder, name = url.rsplit("/", 1)
    store = HTTPStore.from_url(folder, client_options={"allow_http": True})
    ranges = tensor_ranges(data)
    return [("single GET", lambda: single_get(url)),
            ("32 threads, 2 MiB ranges", lambda: threaded_ranges(url, len(data))),
            ("fastst load_file(url)", lambda: fastst.load_file(url)),
            ("fastst load_file, fsspec transport", lambda: fastst.load_file(
                url, storage_options={"transport": "fsspec"})),
            ("raw fs.cat(url)", lambda: fs.cat(url)),
            ("obstore get_ranges (64 tensors)", lambda: obstore_ranges(store, name, ranges)),
            ("aiohttp, 16 x 8 MiB parts", lambda: parts_in_parallel(
                aiohttp_transport(url), len(data))),
            ("obstore, 16 x 8 MiB parts", lambda: parts_in_parallel(
                obstore_transport(store, name), len(data))),
            ("http.client threads, 16 x 8 MiB parts", lambda: threads_in_parallel(
                url, len(data))),
            ("safetensors.numpy.load(fs.cat(url))",
             lambda: safetensors.numpy.load(fs.cat(url)))]


def s3_table(data, repeats):
    import fsspec
    import safetensors.numpy
    from obstore.store import S3Store

    tensors = fastst.load(data)
    with moto_s3("bench") as options:
        fs = fsspec.filesystem("s3", **options)
        url = "s3://bench/model.safetensors"
        fs.pipe(url, data)
        store = S3Store("bench", endpoint=options["client_kwargs"]["endpoint_url"],
                        access_key_id="testing", secret_access_key="testing",
                        region="eu-west-1", client_options={"allow_http": True})
        ranges = tensor_ranges(data)
        ways = [("fastst load_file(url)", lambda: fastst.load_file(url, storage_options=options)),
                ("raw fs.cat(url)", lambda: fs.cat(url)),
                ("obstore get_ranges (64 tensors)",
                 lambda: obstore_ranges(store, "model.safetensors", ranges)),
                ("safetensors.numpy.load(fs.cat(url))",
                 lambda: safetensors.numpy.load(fs.cat(url)))]
        saves = [("fastst save_file(url): parts at once", lambda: fastst.save_file(
                     tensors, "s3://bench/saved.safetensors", storage_options=options)),
                 ("fastst save_file(url): one part at a time (as before)",
                  lambda: fastst.save_file(tensors, "s3://bench/saved.safetensors",
                                           storage_options={**options, "part_size": 1 << 40})),
                 ("s3fs fs.pipe(url, bytes)", lambda: fs.pipe("s3://bench/piped.safetensors",
                                                              data))]
        times = timed(ways, repeats)
        save_times = timed(saves, repeats)
    for title, measured in ((f"S3 on loopback (moto server), {len(data) // MiB} MiB", times),
                            (f"Saving to S3 on loopback (moto server), {len(data) // MiB} MiB",
                             save_times)):
        first = next(iter(measured.values()))
        print(f"\n### {title}\n")
        print("| way | time | throughput | time / fastst |")
        print("| --- | --- | --- | --- |")
        for label, seconds in measured.items():
            print(f"| {label} | {seconds:.3f} s | {len(data) / seconds / MiB:.0f} MiB/s | "
                  f"{seconds / first:.2f}x |")


def one_tensor(data: bytes) -> None:
    """The requests and bytes the server counts for reading one tensor: fastst against
    the reference's way (download, then parse)."""
    import fsspec
    import safetensors.numpy

    name = f"t{TENSORS // 2:04d}"    # one in the middle
    rows = []
    with RangeServer({"/model.safetensors": data}) as server:   # in process, to count
        url = f"{server.url}/model.safetensors"
        start, end = tensor_ranges(data)[TENSORS // 2]
        needed = 8 + int.from_bytes(data[:8], "little") + end - start   # header + tensor
        server.reset_counts()
        with fastst.safe_open(url) as f:
            f.get_tensor(name)
        rows.append(("fastst safe_open(url).get_tensor", len(server.requests),
                     server.bytes_sent))
        server.reset_counts()
        safetensors.numpy.load(fsspec.filesystem("http").cat(url))[name]
        rows.append(("safetensors.numpy.load(fs.cat(url))[name]", len(server.requests),
                     server.bytes_sent))
    print(f"\n### Reading one tensor of the {len(data) // MiB} MiB file over HTTP\n")
    print("| way | requests | bytes moved | bytes / (header + tensor) |")
    print("| --- | --- | --- | --- |")
    for label, requests, sent in rows:
        print(f"| {label} | {requests} | {sent:,} | {sent / needed:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shapes", default="unshaped,40,20")
    parser.add_argument("--no-s3", action="store_true")
    args = parser.parse_args()
    print(f"Produced by `python bench/remote.py --mib {args.mib} --repeats {args.repeats}"
          f"{' --shapes ' + args.shapes if args.shapes != 'unshaped,40,20' else ''}"
          f"{' --no-s3' if args.no_s3 else ''}` on "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}: {TENSORS} tensors, median of {args.repeats} after a "
          f"warm-up, interleaved, the order rotated each round.")
    for shape in filter(None, args.shapes.split(",")):    # --shapes "": S3 alone
        rate, delay, divide = SHAPES[shape]
        data = build(args.mib // divide)
        url, stop, process = http_server_process(data, rate, delay)
        try:
            times = timed(http_ways(url, data), args.repeats)
        finally:
            stop.set()
            process.join(10)
        table(f"HTTP, {SHAPE_NAMES[shape]}, {len(data) // MiB} MiB", times, len(data))
    one_tensor(build(args.mib))
    if not args.no_s3:
        s3_table(build(args.mib), args.repeats)


if __name__ == "__main__":
    main()
