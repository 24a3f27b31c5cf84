#!/usr/bin/env python
"""A checkpoint loaded over a network file system: sshfs from an sshd in a network
namespace of the benchmark's own, over a shaped veth pair. Needs root, /dev/fuse,
``ip``, ``tc``, ``sshd`` and ``sshfs`` (Debian: ``apt-get install sshfs openssh-server``).

    python bench/netfs.py                   # 1 Gbit/s; 1 ms, then 10 ms more round trip
    python bench/netfs.py --delays-ms 10 --rounds 3
    python bench/netfs.py --only "link,fastst default"

Set up, and taken down on every exit (an error, Ctrl-C, SIGTERM, or the --timeout
bound): a namespace joined to this one by a veth pair whose server end is shaped with
``tc netem`` (``rate``, and ``delay``: the round trip's, as the client's end adds
none). Where the kernel has no netem, ``tbf`` shapes the rate and a relay on
127.0.0.1 in front of the server holds each piece of bytes, either way, half the
delay (``DelayingRelay``); the table says which. sshd runs in the namespace on a free
port with a host key and an authorized key made in a temporary folder; sshfs mounts
the checkpoint's folder read-only (aes128-gcm, no compression).

The checkpoint: 3 shards of BF16 tensors (--mib in all) written by fastst. Every run
is cold and a child process of its own: the folder is mounted afresh (the client's
page cache goes with the mount), the server's pages of the shards are dropped
(bench/page_cache.py) and fincore checks that none is cached on either side; the
child imports what it needs, then times loading the three shards and touching every
page of every tensor. Rounds are interleaved (the order rotated each round); each
row is the median. The link's limit is ``dd`` of the three shards over the mount,
each in four parts read at once (12 streams of 4 MiB blocks). Ways:

* reference mmap: ``safetensors.torch.load_file`` of each shard;
* reference read: ``safetensors.torch.load(open(shard, "rb").read())``;
* fastst default: ``fastst.torch.load_file`` of each shard, nothing passed;
* fastst mmap: the same with ``backend="mmap"`` (the default before fastst told
  network file systems apart);
* fastst threads=N: the default with ``read_options(threads=N)``;
* fastsafetensors and Run:ai's streamer, on the CPU, where they are importable.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Dict, Iterator, List, Optional, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
SHARDS = 3
TENSORS_A_SHARD = 16
SERVER_ADDRESS, CLIENT_ADDRESS = "10.231.0.2", "10.231.0.1"
STEP_SECONDS = 30           # the most one set-up step (a mount, sshd's start) may take
CHILD_SECONDS = 300         # the most one load may take

CHILD_LOADS = {
    "link": "import os, subprocess\n"
            "def load(paths):\n"
            "    blocks = [(p, os.path.getsize(p) // (4 << 20) + 1) for p in paths]\n"
            "    parts = [(p, n * k // 4, n * (k + 1) // 4) for p, n in blocks for k in range(4)]\n"
            "    dds = [subprocess.Popen(['dd', f'if={p}', 'of=/dev/null', 'bs=4M', f'skip={a}',\n"
            "                             f'count={b - a}', 'status=none']) for p, a, b in parts]\n"
            "    assert all(dd.wait() == 0 for dd in dds)\n"
            "    return []\n",
    "reference mmap": "import safetensors.torch\n"
                      "def load(paths):\n"
                      "    return [safetensors.torch.load_file(p) for p in paths]\n",
    "reference read": "import safetensors.torch\n"
                      "def load(paths):\n"
                      "    return [safetensors.torch.load(open(p, 'rb').read()) for p in paths]\n",
    "fastst default": "import fastst.torch\n"
                      "def load(paths):\n"
                      "    return [fastst.torch.load_file(p) for p in paths]\n",
    "fastst mmap": "import fastst.torch\n"
                   "def load(paths):\n"
                   "    return [fastst.torch.load_file(p, backend='mmap') for p in paths]\n",
    "fastsafetensors": "import fastsafetensors\n"
                       "def load(paths):\n"
                       "    loader = fastsafetensors.SafeTensorsFileLoader(\n"
                       "        fastsafetensors.SingleGroup(), 'cpu', nogds=True)\n"
                       "    loader.add_filenames({0: paths})\n"
                       "    buffers = loader.copy_files_to_device()\n"
                       "    load.kept = loader, buffers   # what the tensors' memory is\n"
                       "    return [{k: buffers.get_tensor(k) for k in loader.get_keys()}]\n",
    "runai streamer": "from runai_model_streamer import SafetensorsStreamer\n"
                      "def load(paths):\n"
                      "    with SafetensorsStreamer() as streamer:\n"
                      "        streamer.stream_files(paths)\n"
                      "        return [dict(streamer.get_tensors())]\n",
}
PEERS = {"fastsafetensors": "fastsafetensors", "runai streamer": "runai_model_streamer"}
CHILD = """
import sys, time
sys.path.insert(0, {here!r})
{load}
import torch
def touch(loaded):
    for tensors in loaded:
        for tensor in tensors.values():
            tensor.reshape(-1).view(torch.uint8)[::4096].sum()
paths = sys.argv[1:]
{threads}
start = time.perf_counter()
touch(load(paths))
print(time.perf_counter() - start)
"""


# ---------------------------------------------------------------------------
# Set-up, each step undone on leaving
# ---------------------------------------------------------------------------

def run(*command: str, namespace: Optional[str] = None) -> subprocess.CompletedProcess:
    prefix = ["ip", "netns", "exec", namespace] if namespace else []
    return subprocess.run(prefix + list(command), capture_output=True, text=True,
                          timeout=STEP_SECONDS, check=False)


def checked(*command: str, namespace: Optional[str] = None) -> str:
    done = run(*command, namespace=namespace)
    if done.returncode:
        raise SystemExit(f"{' '.join(command)}: {done.stderr.strip()}")
    return done.stdout


@contextlib.contextmanager
def shaped_link(rate: str) -> Iterator[Tuple[str, str, bool]]:
    """A namespace joined by a veth pair, its server end's rate shaped: (namespace,
    that end, whether netem shapes it and can add a delay)."""
    namespace = f"fastst-netfs-{os.getpid()}"
    client_end, server_end = f"fnc{os.getpid() % 100000}", f"fns{os.getpid() % 100000}"
    checked("ip", "netns", "add", namespace)
    try:
        checked("ip", "link", "add", client_end, "type", "veth", "peer", "name", server_end)
        checked("ip", "link", "set", server_end, "netns", namespace)
        checked("ip", "addr", "add", f"{CLIENT_ADDRESS}/24", "dev", client_end)
        checked("ip", "link", "set", client_end, "up")
        for command in (("ip", "addr", "add", f"{SERVER_ADDRESS}/24", "dev", server_end),
                        ("ip", "link", "set", server_end, "up"),
                        ("ip", "link", "set", "lo", "up")):
            checked(*command, namespace=namespace)
        yield namespace, server_end, shape(namespace, server_end, rate)
    finally:
        for pid in run("ip", "netns", "pids", namespace).stdout.split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)    # sshd's sessions, which outlive it
        run("ip", "link", "del", client_end)     # takes its peer along
        run("ip", "netns", "del", namespace)


def shape(namespace: str, device: str, rate: str) -> bool:
    """Shape `device`'s egress to `rate` with netem (True), else with tbf (the kernel
    has no netem: a DelayingRelay adds the delay)."""
    if run("tc", "qdisc", "add", "dev", device, "root", "netem", "rate", rate, "limit",
           "100000", namespace=namespace).returncode == 0:
        return True
    checked("tc", "qdisc", "add", "dev", device, "root", "tbf", "rate", rate, "burst",
            "4mb", "latency", "100ms", namespace=namespace)
    return False


class DelayingRelay:
    """A TCP relay on 127.0.0.1 to (host, port) that holds every piece of bytes it
    passes, either way, half the round trip's `delay_ms` before passing it on, in
    order: the delay, where the kernel has no netem to add it on the veth pair. Run by
    a thread of its own with an asyncio loop."""

    def __init__(self, host: str, port: int, delay_ms: float) -> None:
        import asyncio

        self.target, self.hold = (host, port), delay_ms / 2000
        self.loop = asyncio.new_event_loop()
        self.port = free_port()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._serve, args=(ready,), daemon=True)
        self.thread.start()
        if not ready.wait(STEP_SECONDS):
            raise SystemExit("the delaying relay did not start")

    def _serve(self, ready: threading.Event) -> None:
        import asyncio

        async def start() -> None:
            self.server = await asyncio.start_server(self._relay, "127.0.0.1", self.port)
            ready.set()

        self.loop.run_until_complete(start())
        self.loop.run_forever()

    async def _relay(self, reader, writer) -> None:
        import asyncio

        upstream_reader, upstream_writer = await asyncio.open_connection(*self.target)
        with contextlib.suppress(asyncio.CancelledError):    # the relay closing
            await asyncio.gather(self._pass(reader, upstream_writer),
                                 self._pass(upstream_reader, writer))

    async def _pass(self, reader, writer) -> None:
        """Bytes from `reader` to `writer`, each piece held `hold` seconds from its
        arrival (a queue keeps them in order, and the reading going on meanwhile)."""
        import asyncio

        queue: asyncio.Queue = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await queue.get()
                await asyncio.sleep(max(0.0, due - self.loop.time()))
                if not data:
                    break
                writer.write(data)
                await writer.drain()
            writer.close()

        delivering = asyncio.ensure_future(deliver())
        while True:
            data = await reader.read(1 << 20)
            queue.put_nowait((self.loop.time() + self.hold, data))
            if not data:
                break
        await delivering

    def close(self) -> None:
        import asyncio

        async def cancel_all() -> None:
            self.server.close()
            tasks = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(STEP_SECONDS)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(STEP_SECONDS)
        self.loop.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def ssh_server(namespace: str, keys: str) -> Iterator[int]:
    """sshd in `namespace` on a free port, taking the key made in `keys`."""
    for name in ("host", "client"):
        checked("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", os.path.join(keys, name))
    shutil.copy(os.path.join(keys, "client.pub"), os.path.join(keys, "authorized_keys"))
    port = free_port()
    config = os.path.join(keys, "sshd_config")
    with open(config, "w") as file:
        file.write(f"Port {port}\nListenAddress {SERVER_ADDRESS}\n"
                   f"HostKey {keys}/host\nAuthorizedKeysFile {keys}/authorized_keys\n"
                   "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                   "StrictModes no\nUsePAM no\nPidFile none\n"
                   "Subsystem sftp internal-sftp\n")
    os.makedirs("/run/sshd", exist_ok=True)     # its privilege separation folder
    # its log in a file: a pipe would stay open as long as any session it forked
    with open(os.path.join(keys, "sshd.log"), "w") as log:
        daemon = subprocess.Popen(["ip", "netns", "exec", namespace, shutil.which("sshd")
                                   or "/usr/sbin/sshd", "-D", "-e", "-f", config],
                                  stdout=subprocess.DEVNULL, stderr=log)
    try:
        wait_for(lambda: answers(SERVER_ADDRESS, port), "sshd to listen", daemon)
        yield port
    finally:
        daemon.terminate()
        try:
            daemon.wait(timeout=STEP_SECONDS)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()


def answers(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=1).close()
        return True
    except OSError:
        return False


def wait_for(ready, what: str, process: Optional[subprocess.Popen] = None) -> None:
    deadline = time.monotonic() + STEP_SECONDS
    while not ready():
        if process is not None and process.poll() is not None:
            raise SystemExit(f"waiting for {what}: it ended with status {process.returncode}")
        if time.monotonic() > deadline:
            raise SystemExit(f"waiting for {what}: not within {STEP_SECONDS} s")
        time.sleep(0.05)


@contextlib.contextmanager
def delayed(namespace: str, device: str, netem: bool, rate: str, port: int,
            delay_ms: float) -> Iterator[Tuple[str, int]]:
    """Where sshfs connects to reach sshd on `port` with a round trip of `delay_ms`
    more: the server itself, its end's netem told the delay, or a DelayingRelay."""
    if netem:
        checked("tc", "qdisc", "change", "dev", device, "root", "netem", "delay",
                f"{delay_ms}ms", "rate", rate, "limit", "100000", namespace=namespace)
    if netem or not delay_ms:
        yield SERVER_ADDRESS, port
        return
    relay = DelayingRelay(SERVER_ADDRESS, port, delay_ms)
    try:
        yield "127.0.0.1", relay.port
    finally:
        relay.close()


@contextlib.contextmanager
def mounted(folder: str, mountpoint: str, host: str, port: int, keys: str) -> Iterator[None]:
    checked("sshfs", f"root@{host}:{folder}", mountpoint, "-o",
            f"ro,port={port},IdentityFile={keys}/client,StrictHostKeyChecking=no,"
            f"UserKnownHostsFile=/dev/null,Ciphers=aes128-gcm@openssh.com,Compression=no,"
            f"LogLevel=ERROR")
    try:
        wait_for(lambda: os.path.ismount(mountpoint), "the sshfs mount")
        yield
    finally:
        run("fusermount3", "-u", "-z", mountpoint)


@contextlib.contextmanager
def bounded(seconds: int) -> Iterator[None]:
    """SIGTERM, and the end of `seconds`, leave as SystemExit does: through every
    clean-up on the way out."""
    def leave(signum, frame):
        raise SystemExit(f"stopped by signal {signum} (--timeout {seconds} s)")

    previous = {number: signal.signal(number, leave)
                for number in (signal.SIGTERM, signal.SIGALRM)}
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        for number, handler in previous.items():
            signal.signal(number, handler)


# ---------------------------------------------------------------------------
# The checkpoint and the runs
# ---------------------------------------------------------------------------

def make_checkpoint(folder: str, mib: int) -> List[str]:
    import torch

    import fastst.torch

    names = [f"model-{i:05d}-of-{SHARDS:05d}.safetensors" for i in range(1, SHARDS + 1)]
    elements = (mib << 20) // (SHARDS * TENSORS_A_SHARD * 2)
    generator = torch.Generator().manual_seed(0)
    for shard, name in enumerate(names):
        path = os.path.join(folder, name)
        if not os.path.exists(path):
            tensors = {f"layers.{shard}.{i}.weight": torch.randn(
                elements, generator=generator).to(torch.bfloat16)
                for i in range(TENSORS_A_SHARD)}
            fastst.torch.save_file(tensors, path, fsync=True)
    return names


def cached_bytes(path: str) -> int:
    return int(checked("fincore", "--bytes", "--noheadings", "--output", "RES", path))


def available_ways(threads: List[int], only: Optional[List[str]]) -> Dict[str, str]:
    import importlib.util

    ways = {}
    for name, load in CHILD_LOADS.items():
        module = PEERS.get(name)
        if module is None or importlib.util.find_spec(module) is not None:
            ways[name] = CHILD.format(here=HERE, load=load, threads="")
    for count in threads:
        ways[f"fastst threads={count}"] = CHILD.format(
            here=HERE, load=CHILD_LOADS["fastst default"],
            threads=f"import fastst\nfastst.read_options(threads={count})")
    return {name: code for name, code in ways.items() if only is None or name in only}


def timed_cold(code: str, served: List[str], mounted_paths: List[str]) -> float:
    from page_cache import drop_pages

    for path in served:
        drop_pages(path)
    cached = {path: cached_bytes(path) for path in served + mounted_paths}
    if any(cached.values()):
        raise SystemExit(f"pages still cached before a cold run: {cached}")
    done = subprocess.run([sys.executable, "-c", code] + mounted_paths, capture_output=True,
                          text=True, timeout=CHILD_SECONDS)
    if done.returncode:
        raise RuntimeError(done.stderr.strip()[-2000:])
    return float(done.stdout.split()[-1])


def measure(ways: Dict[str, str], folder: str, names: List[str], rounds: int, host: str,
            port: int, keys: str, mountpoint: str) -> Dict[str, List[float]]:
    served = [os.path.join(folder, name) for name in names]
    over_mount = [os.path.join(mountpoint, name) for name in names]
    times: Dict[str, List[float]] = {name: [] for name in ways}
    order = list(ways)
    for round_number in range(rounds):
        for name in order[round_number % len(order):] + order[:round_number % len(order)]:
            with mounted(folder, mountpoint, host, port, keys):
                try:
                    times[name].append(timed_cold(ways[name], served, over_mount))
                except RuntimeError as error:
                    print(f"{name}: failed: {error}", file=sys.stderr)
    return {name: seconds for name, seconds in times.items() if seconds}


def table(times: Dict[float, Dict[str, List[float]]], mib: int, shaping: str,
          loads: Tuple[str, str], command: str) -> str:
    """One row a way, a time and a share of the link's limit a delay."""
    delays = list(times)
    rounds = max(len(seconds) for by_way in times.values() for seconds in by_way.values())
    lines = [f"{mib} MiB of BF16 in {SHARDS} shards over sshfs ({shaping}); cold: a "
             f"fresh mount and a fresh process a run; median of {rounds} interleaved "
             f"rounds; load average {loads[0]} before, {loads[1]} after. `{command}`", "",
             "| way | " + " | ".join(f"{d:g} ms: time | {d:g} ms: of the link's limit"
                                       for d in delays) + " |",
             "| --- |" + " ---: | ---: |" * len(delays)]
    for name in times[delays[0]]:
        cells = []
        for delay in delays:
            seconds = times[delay].get(name)
            link = times[delay].get("link")
            if not seconds:
                cells += ["failed", ""]
                continue
            median = statistics.median(seconds)
            share = statistics.median(link) / median if link else None
            cells += [f"{median:.2f} s", f"{share:.2f}x" if share else ""]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def load_average() -> str:
    return f"{os.getloadavg()[0]:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=384)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", default="1gbit")
    parser.add_argument("--delays-ms", default="1,10",
                        help="the round trips added, in ms, comma-separated")
    parser.add_argument("--threads", default="16,64", help="fastst read_options(threads=) rows")
    parser.add_argument("--only", help="the ways to run, comma-separated")
    parser.add_argument("--folder", help="where the checkpoint is kept (default: a temp one)")
    parser.add_argument("--timeout", type=int, default=1800, help="the bound on the whole run")
    args = parser.parse_args()
    threads = [int(count) for count in args.threads.split(",") if count]
    ways = available_ways(threads, args.only.split(",") if args.only else None)
    with contextlib.ExitStack() as stack:
        stack.enter_context(bounded(args.timeout))
        scratch = stack.enter_context(tempfile.TemporaryDirectory(prefix="fastst-netfs-"))
        folder = args.folder or os.path.join(scratch, "served")
        os.makedirs(folder, exist_ok=True)
        names = make_checkpoint(folder, args.mib)
        keys, mountpoint = os.path.join(scratch, "keys"), os.path.join(scratch, "mount")
        os.makedirs(keys)
        os.makedirs(mountpoint)
        namespace, device, netem = stack.enter_context(shaped_link(args.rate))
        port = stack.enter_context(ssh_server(namespace, keys))
        before = load_average()
        times = {}
        for delay in [float(ms) for ms in args.delays_ms.split(",")]:
            with delayed(namespace, device, netem, args.rate, port, delay) as (host, reached):
                times[delay] = measure(ways, os.path.abspath(folder), names, args.rounds,
                                       host, reached, keys, mountpoint)
        shaping = (f"{args.rate} by netem, which adds the delay" if netem else
                   f"{args.rate} by tbf; no netem in this kernel: a relay adds the delay")
        command = "python bench/netfs.py " + " ".join(sys.argv[1:])
        print(table(times, args.mib, shaping, (before, load_average()), command.strip()))


if __name__ == "__main__":
    main()
