"""A torch.distributed job on 127.0.0.1 for tests: one subprocess a rank, in a gloo
group on a free port, each bounded in time; a rank runs a job of this file and saves
what it returns for the test to compare.

``run_ranks(world, job, args)`` returns each rank's result, or raises an
AssertionError with the ranks' output when one did not end in time or cleanly.
"""
import datetime
import json
import os
import pickle
import signal
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def run_ranks(world, job, args, *, timeout=120, killed=None):
    """Run `job` on `world` ranks; each rank's result (a dict), in rank order (None for
    rank `killed`, which must end by SIGKILL)."""
    with tempfile.TemporaryDirectory() as folder:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()),
               "WORLD_SIZE": str(world), "GLOO_SOCKET_IFNAME": "lo",
               "PYTHONPATH": os.pathsep.join([os.path.dirname(HERE), HERE,
                                              os.environ.get("PYTHONPATH", "")])}
        arguments = os.path.join(folder, "args.json")
        with open(arguments, "w") as file:
            json.dump(args, file)
        ranks = [subprocess.Popen([sys.executable, __file__, job, arguments,
                                   os.path.join(folder, f"rank{rank}.pickle")],
                                  env={**env, "RANK": str(rank)}, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True)
                 for rank in range(world)]
        deadline = time.monotonic() + timeout
        outputs = []
        try:
            for process in ranks:
                out, _ = process.communicate(timeout=max(deadline - time.monotonic(), 1))
                outputs.append(out)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"ranks still running after {timeout} s") from None
        finally:
            for process in ranks:
                if process.poll() is None:
                    process.kill()
                    process.wait()
        failed = [(rank, process.returncode) for rank, process in enumerate(ranks)
                  if process.returncode != (-signal.SIGKILL if rank == killed else 0)]
        assert not failed, f"ranks {failed} failed:\n" + "\n".join(
            f"--- rank {rank}\n{out[-3000:]}" for rank, out in enumerate(outputs))
        results = []
        for rank in range(world):
            if rank == killed:
                results.append(None)
                continue
            with open(os.path.join(folder, f"rank{rank}.pickle"), "rb") as file:
                result = pickle.load(file)
            for load in result.get("results", []):
                load["tensors"] = {name: unportable(item) for name, item in
                                   load["tensors"].items()}
            results.append(result)
        return results


def read_bytes() -> int:
    """Bytes this process has read through read-like system calls (rchar)."""
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))


def counted(load):
    """(what `load()` returns, the bytes read while it ran)."""
    before = read_bytes()
    result = load()
    return result, read_bytes() - before


# --- jobs: each takes the parsed arguments and returns a picklable dict ----------------

def job_loads(args):
    """Each load the test names (a list of [mode, target, options]), its tensors and
    the bytes read."""
    import fastst._handles.slicing   # imported by a first get_slice: its bytes are not the file's
    import fastst.distributed as fd

    results = []
    for mode, target, options in args["loads"]:
        load = fd.load_tensor_parallel if mode == "tp" else fd.load_split
        options = dict(options)
        if mode == "tp":
            tensors, read = counted(lambda: load(target, options.pop("dims"), **options))
        else:
            tensors, read = counted(lambda: load(target, **options))
        results.append({"tensors": {name: portable(tensor) for name, tensor in tensors.items()},
                        "read": read})
    return {"results": results}


def portable(tensor):
    """A tensor as (dtype name, shape, bytes): every dtype pickles so."""
    raw = tensor.contiguous().reshape(-1).view(torch_module().uint8)
    return str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), raw.numpy().tobytes()


def unportable(item):
    torch = torch_module()
    dtype_name, shape, data = item
    dtype = getattr(torch, dtype_name)
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(dtype).reshape(shape)


def torch_module():
    import torch

    return torch


def job_failing(args):
    """Loads in which rank `args["failing"]` reads another target (or sleeps first),
    one a scenario: what each rank raises, and after how long."""
    import torch.distributed as dist

    import fastst.distributed as fd

    outcomes = []
    for scenario in args["scenarios"]:
        failing = dist.get_rank() == args["failing"]
        target = scenario["bad_target"] if failing else args["target"]
        if failing and scenario.get("sleep"):
            time.sleep(scenario["sleep"])
        load = fd.load_tensor_parallel if scenario["mode"] == "tp" else fd.load_split
        extra = {"dims": args["dims"]} if scenario["mode"] == "tp" else {}
        started = time.monotonic()
        try:
            load(target, timeout=scenario["timeout"], **extra)
            outcome = {"error": None}
        except Exception as error:
            outcome = {"error": type(error).__name__, "message": str(error)}
        outcomes.append({**outcome, "seconds": time.monotonic() - started})
    return {"outcomes": outcomes}


def job_killed(args):
    """A load in which rank `args["killed"]` kills itself (SIGKILL) at its
    `args["calls"]`-th call of `args["at"]` (a function of fastst.distributed, or
    "_Group.run", which runs each collective), the ranks exchanging their parts in
    rounds of `args["round_bytes"]`: what each other rank raises, and after how long."""
    import signal

    import torch.distributed as dist

    import fastst.distributed as fd

    fd.ROUND_BYTES = args["round_bytes"]
    if dist.get_rank() == args["killed"]:
        owner, name = (fd._Group, "run") if args["at"] == "_Group.run" else (fd, args["at"])
        real = getattr(owner, name)
        calls = []

        def killing(*positional, **keywords):
            calls.append(name)
            if len(calls) == args["calls"]:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*positional, **keywords)

        setattr(owner, name, killing)
    load = fd.load_tensor_parallel if args["mode"] == "tp" else fd.load_split
    extra = {"dims": args["dims"]} if args["mode"] == "tp" else {}
    started = time.monotonic()
    try:
        load(args["target"], timeout=args["timeout"], **extra)
        outcome = {"error": None}
    except Exception as error:
        outcome = {"error": type(error).__name__, "message": str(error)}
    return {**outcome, "seconds": time.monotonic() - started}


JOBS = {"loads": job_loads, "failing": job_failing, "killed": job_killed}


def warm_up(dist):
    """A first collective of each kind the loads use: what the group reads to set
    them up is not the file's bytes."""
    torch = torch_module()
    rows = [torch.zeros(4, dtype=torch.uint8) for _ in range(dist.get_world_size())]
    dist.all_gather(rows, torch.zeros(4, dtype=torch.uint8))


def main(job, arguments, out):
    import torch.distributed as dist

    # what the loads import on first use is imported now: its reads are not the file's
    import ml_dtypes  # noqa: F401
    import orjson  # noqa: F401

    import fastst._frameworks.cuda  # noqa: F401
    import fastst._json  # noqa: F401
    import fastst._frameworks.torch  # noqa: F401
    import fastst.checkpoint  # noqa: F401
    import fastst.distributed  # noqa: F401
    import fastst.remote  # noqa: F401

    with open(arguments) as file:
        args = json.load(file)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.get("group_timeout",
                                                                                 60)))
    warm_up(dist)
    try:
        result = JOBS[job](args)
    finally:
        if job == "loads":
            dist.destroy_process_group()
    with open(out, "wb") as file:
        pickle.dump(result, file)
    sys.stdout.flush()
    os._exit(0)   # a group left waiting by a failed collective must not hold the exit


if __name__ == "__main__":
    main(*sys.argv[1:])
