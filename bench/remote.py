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
* obstore get_ranges: obstore's ``get_ranges`` of the tensors' byte ranges (its own
  coalescing and concurrency; no tensors made);
* aiohttp / obstore / http.client threads, 16 x 8 MiB parts: three transports on the
  same plan, 8 MiB ranged GETs, 16 in flight, each into its place in one buffer (no
  tensors made; http.client reads each body into its place with ``readinto``);
* reference: ``safetensors.numpy.load(fs.cat(url))`` (download, then parse).

Ratios are the best plain client's time (single GET or 32 threads) / the way's time,
and raw fs.cat's / fastst's: above 1, fastst is faster. Then the requests and bytes the
server counts for reading one tensor, fastst against the reference's way, and the S3
table (fastst, raw fs.cat, obstore, the reference).

    python bench/remote.py --checkpoint-mib 512 --servers rangeserver,nginx

adds two sharded checkpoints (a transformer's tensors in float16, in shards of at most
128 MiB and their index: one 1024 wide, from 2 KiB norms to 8 MiB matrices, one 256 wide,
its matrices 128-512 KiB, thousands of tensors) loaded by their index's URL,
from the test server (unshaped) and from Debian's nginx (``apt-get install nginx``;
sendfile on, keep-alive, a configuration of the bench's own in a temporary folder, on
127.0.0.1 and a free port, started and stopped by the bench). Ways: fastst's
``load_file(index URL)``; the best plain client, ranged GETs of 8 MiB parts of every
shard from one queue, 16 or 32 ``http.client`` threads each keeping its connection and
reading each body into its place in a buffer allocated beforehand (no tensors made),
and one GET of each shard in turn; the reference's way, one GET of each shard, then
``safetensors.numpy.load`` of it.
"""
from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import contextlib
import http.client
import json
import os
import queue
import statistics
import sys
import time
import urllib.parse
import urllib.request
from typing import List, Sequence

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

import fastst  # noqa: E402
from servers import RangeServer, moto_s3  # noqa: E402

MiB = 1 << 20
TENSORS = 64
SHAPES = {"unshaped": (None, 0.0, 1), "40": (40e6, 0.03, 1), "20": (20e6, 0.03, 2)}
SHAPE_NAMES = {"unshaped": "unshaped", "40": "40 MB/s a connection, 30 ms to first byte",
               "20": "20 MB/s a connection, 30 ms to first byte"}


def build(mib: int, tensors: int = TENSORS) -> bytes:
    each = mib * MiB // tensors // 4
    return fastst.save({f"t{k:04d}": np.full(each, k, np.float32) for k in range(tensors)})


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
    return plain_shards([(url, size)], at_once, part)[0]


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


def serve(data, rate, delay, ready, stop) -> None:
    objects = ({f"/{name}": content for name, content in data.items()}
               if isinstance(data, dict) else {"/model.safetensors": data})
    with RangeServer(objects) as server:
        server.rate, server.delay = rate, delay
        ready.put(server.url)
        stop.wait()


def http_server_process(data, rate, delay, many=False):
    """The HTTP server in a process of its own (forked), serving `data` as
    /model.safetensors, or, with `many`, each file of `data` (name -> bytes) under its
    name. Returns (URL: of the file, or of the folder with `many`, stop, process)."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    ready, stop = context.Queue(), context.Event()
    process = context.Process(target=serve, args=(data, rate, delay, ready, stop), daemon=True)
    process.start()
    return ready.get(timeout=60) + ("" if many else "/model.safetensors"), stop, process


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
            ("obstore get_ranges (a range a tensor)",
             lambda: obstore_ranges(store, name, ranges)),
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


def checkpoint(mib: int, width: int, folder: str) -> List[str]:
    """A transformer's tensors in float16, `width` wide (layers of 4 attention matrices
    of width**2 and 2 MLP matrices of 4 * width**2, biases and norms, an embedding of
    16384 rows), about `mib` MiB, saved in `folder` as shards of at most 128 MiB and
    their index; returns the shards' names."""
    rng = np.random.default_rng(0)
    tensors = {"embed.weight": rng.standard_normal((16384, width)).astype(np.float16)}
    embedding, layer_bytes = 16384 * width * 2, 12 * width * width * 2
    for layer in range(max(1, (mib * MiB - embedding) // layer_bytes)):
        for name, shape in (("q", (width, width)), ("k", (width, width)),
                            ("v", (width, width)), ("o", (width, width)),
                            ("up", (4 * width, width)), ("down", (width, 4 * width)),
                            ("up_bias", (4 * width,)), ("o_bias", (width,)),
                            ("norm1", (width,)), ("norm2", (width,))):
            tensors[f"layers.{layer}.{name}"] = rng.standard_normal(shape).astype(np.float16)
    fastst.save_file(tensors, folder, max_shard_size=128 * MiB)
    return sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))


def plain_shards(urls_sizes, at_once, part=8 * MiB):
    """Every shard by ranged GETs of `part` bytes from one queue, on `at_once` threads
    each keeping its ``http.client`` connection and reading each body into its place
    in the shard's buffer, allocated beforehand."""
    outs = [np.empty(size, np.uint8) for _, size in urls_sizes]
    parts = queue.SimpleQueue()
    for k, (_, size) in enumerate(urls_sizes):
        for offset in range(0, size, part):
            parts.put((k, offset))
    where = urllib.parse.urlsplit(urls_sizes[0][0])

    def work():
        connection = http.client.HTTPConnection(where.hostname, where.port, timeout=120)
        try:
            while True:
                try:
                    k, offset = parts.get_nowait()
                except queue.Empty:
                    return
                url, size = urls_sizes[k]
                end = min(size, offset + part)
                connection.request("GET", urllib.parse.urlsplit(url).path,
                                   headers={"Range": f"bytes={offset}-{end - 1}"})
                answer = connection.getresponse()
                view, done = memoryview(outs[k])[offset:end], 0
                while done < end - offset:
                    got = answer.readinto(view[done:])
                    if not got:
                        raise OSError(f"{url}: bytes [{offset}, {end}) cut short")
                    done += got
                answer.read()
        finally:
            connection.close()

    with concurrent.futures.ThreadPoolExecutor(at_once) as pool:
        for future in [pool.submit(work) for _ in range(at_once)]:
            future.result()
    return outs


@contextlib.contextmanager
def nginx_serving(folder: str):
    """Debian's nginx serving `folder` on 127.0.0.1 and a free port (sendfile on,
    keep-alive), with a configuration, logs and pid file of its own in a temporary
    folder; yields its URL and stops it."""
    import shutil
    import socket
    import subprocess
    import tempfile

    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    with tempfile.TemporaryDirectory(prefix="fastst-nginx-") as prefix:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        os.chmod(folder, 0o755)     # its workers run as nobody
        for name in os.listdir(folder):
            os.chmod(os.path.join(folder, name), 0o644)
        temp = {kind: os.path.join(prefix, kind) for kind in
                ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")}
        config = os.path.join(prefix, "nginx.conf")
        with open(config, "w") as file:
            file.write(f"""worker_processes 2;
pid {prefix}/nginx.pid;
error_log {prefix}/error.log;
events {{ worker_connections 256; }}
http {{
    access_log off;
    sendfile on;
    tcp_nopush on;
    keepalive_timeout 65;
    keepalive_requests 100000;
    {"".join(f"{kind}_temp_path {path}; " for kind, path in temp.items())}
    server {{
        listen 127.0.0.1:{port};
        root {folder};
    }}
}}
""")
        server = subprocess.Popen([binary, "-p", prefix, "-c", config, "-g", "daemon off;"])
        try:
            url = f"http://127.0.0.1:{port}"
            while server.poll() is None:
                with contextlib.suppress(OSError):
                    socket.create_connection(("127.0.0.1", port), timeout=1).close()
                    break
                time.sleep(0.05)
            if server.poll() is not None:
                raise RuntimeError(f"nginx ended with status {server.returncode}")
            yield url
        finally:
            server.terminate()
            server.wait(10)


def checkpoint_ways(url: str, shards, sizes):
    import safetensors.numpy

    urls_sizes = [(f"{url}/{name}", sizes[name]) for name in shards]
    return [("one GET of each shard", lambda: [single_get(u) for u, _ in urls_sizes]),
            ("16 threads, 8 MiB ranges", lambda: plain_shards(urls_sizes, 16)),
            ("32 threads, 8 MiB ranges", lambda: plain_shards(urls_sizes, 32)),
            ("fastst load_file(index URL)",
             lambda: fastst.load_file(f"{url}/model.safetensors.index.json")),
            ("reference: safetensors.numpy.load(GET) of each shard",
             lambda: [safetensors.numpy.load(single_get(u)) for u, _ in urls_sizes])]


def checkpoint_tables(mib: int, width: int, servers: Sequence[str], repeats: int) -> None:
    import tempfile

    with tempfile.TemporaryDirectory(prefix="fastst-checkpoint-") as folder:
        shards = checkpoint(mib, width, folder)
        sizes = {name: os.path.getsize(os.path.join(folder, name)) for name in shards}
        total = sum(sizes.values())
        with open(os.path.join(folder, "model.safetensors.index.json")) as index:
            tensors = len(json.load(index)["weight_map"])
        for server in servers:
            if server == "nginx":
                with nginx_serving(folder) as url:
                    times = timed(checkpoint_ways(url, shards, sizes), repeats)
            else:
                objects = {}
                for name in os.listdir(folder):
                    with open(os.path.join(folder, name), "rb") as file:
                        objects[name] = file.read()
                url, stop, process = http_server_process(objects, None, 0.0, many=True)
                try:
                    times = timed(checkpoint_ways(url, shards, sizes), repeats)
                finally:
                    stop.set()
                    process.join(10)
            best = min(times[way] for way in times if "threads" in way or "one GET" in way)
            print(f"\n### A checkpoint {width} wide: {tensors} tensors, {len(shards)} shards, "
                  f"{total // MiB} MiB, from "
                  f"{'nginx' if server == 'nginx' else 'the test server'} (unshaped)\n")
            print("| way | time | throughput | best plain / time |")
            print("| --- | --- | --- | --- |")
            for label, seconds in times.items():
                print(f"| {label} | {seconds:.3f} s | {total / seconds / MiB:.0f} MiB/s | "
                      f"{best / seconds:.2f}x |")
            print(f"\nload average {os.getloadavg()[0]:.2f} after the table.")


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
    parser.add_argument("--tensors", type=int, default=TENSORS,
                        help="how many tensors the file of the HTTP tables holds")
    parser.add_argument("--checkpoint-mib", type=int, default=0,
                        help="also a sharded checkpoint of about this size (0: none)")
    parser.add_argument("--servers", default="rangeserver,nginx",
                        help="the servers of the checkpoint: rangeserver, nginx")
    args = parser.parse_args()
    checkpoint_flags = (f" --checkpoint-mib {args.checkpoint_mib} --servers {args.servers}"
                        if args.checkpoint_mib else "")
    print(f"Produced by `python bench/remote.py --mib {args.mib} --repeats {args.repeats}"
          f"{' --shapes ' + args.shapes if args.shapes != 'unshaped,40,20' else ''}"
          f"{' --no-s3' if args.no_s3 else ''}"
          f"{f' --tensors {args.tensors}' if args.tensors != TENSORS else ''}"
          f"{checkpoint_flags}` on "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, load average "
          f"{os.getloadavg()[0]:.2f}: {args.tensors} tensors, median of {args.repeats} after a "
          f"warm-up, interleaved, the order rotated each round.")
    for shape in filter(None, args.shapes.split(",")):    # --shapes "": S3 alone
        rate, delay, divide = SHAPES[shape]
        data = build(args.mib // divide, args.tensors)
        url, stop, process = http_server_process(data, rate, delay)
        try:
            times = timed(http_ways(url, data), args.repeats)
        finally:
            stop.set()
            process.join(10)
        table(f"HTTP, {SHAPE_NAMES[shape]}, {len(data) // MiB} MiB", times, len(data))
    if args.checkpoint_mib:
        for width in (1024, 256):
            checkpoint_tables(args.checkpoint_mib, width, args.servers.split(","),
                              args.repeats)
    if not args.shapes and args.checkpoint_mib and args.no_s3:
        return
    one_tensor(build(args.mib))
    if not args.no_s3:
        s3_table(build(args.mib), args.repeats)


if __name__ == "__main__":
    main()
