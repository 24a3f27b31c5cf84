"""The implementations under test, and the code that measures one of them.

Every measurement runs in a child process forked from a server that has already
imported numpy, fastst, safetensors and torch (see run.py), so a child starts in
milliseconds with a clean memory high-water mark. This module is what that server
preloads: it must import cleanly whether or not the optional peers are installed.
"""
from __future__ import annotations

import gc
import inspect
import mmap
import os
import pickle
import shutil
import statistics
import time
import timeit
from typing import Any, Callable, Dict, List, Literal, NamedTuple, Optional, Tuple

import numpy as np
import orjson

import fastst

try:
    import safetensors
    import safetensors.numpy as st_np
except ImportError:  # the reference is optional
    safetensors = None  # type: ignore[assignment]
    st_np = None  # type: ignore[assignment]

try:
    import torch
except ImportError:  # so is torch
    torch = None  # type: ignore[assignment]

st_pt: Any = None
if torch is not None and safetensors is not None:
    import safetensors.torch as st_pt


def _has_parameter(function: Callable[..., Any], name: str) -> bool:
    try:
        return name in inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False


# What each optional row needs. fastst features newer than its first release are
# detected, so the harness also runs against older trees (--fastst DIR).
AVAILABLE = {
    "safetensors": safetensors is not None,
    "torch": torch is not None,
    "fastst load_file(copy=)": _has_parameter(fastst.load_file, "copy"),
}


def versions() -> Dict[str, Optional[str]]:
    return {
        "fastst": fastst.__version__,
        "numpy": np.__version__,
        "orjson": orjson.__version__,
        "safetensors": safetensors.__version__ if safetensors is not None else None,
        "torch": torch.__version__ if torch is not None else None,
    }


class Peer(NamedTuple):
    """One row of a table. `role` is "fastst", "peer", "raw" (the raw I/O limit) or
    "ref" (a reference point that is not a competing implementation)."""
    key: str
    label: str
    role: str
    needs: Tuple[str, ...]
    fn: Callable[..., Any]


def available(peer: Peer, disabled: Tuple[str, ...] = ()) -> bool:
    return all(AVAILABLE[need] and need not in disabled for need in peer.needs)


ST = ("safetensors",)
PT = ("torch",)
ST_PT = ("safetensors", "torch")

# ---------------------------------------------------------------------------
# Memory accounting (Linux)
# ---------------------------------------------------------------------------


def _status_kib(*fields: str) -> Dict[str, int]:
    out = {}
    with open("/proc/self/status") as status:
        for line in status:
            name, _, value = line.partition(":")
            if name in fields:
                out[name] = int(value.split()[0])
    return out


def reset_peak() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS; False where the
    kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")
        return True
    except OSError:
        return False


class MemoryProbe:
    """Peak RSS growth and private (anonymous) memory growth across a block."""

    def __enter__(self) -> "MemoryProbe":
        gc.collect()
        self.can_reset = reset_peak()
        now = _status_kib("VmRSS", "VmHWM", "RssAnon")
        self.rss0 = now["VmRSS"]
        self.hwm0 = now["VmHWM"]
        self.anon0 = now["RssAnon"]
        return self

    def __exit__(self, *exc: object) -> None:
        now = _status_kib("VmHWM", "RssAnon")
        self.peak = max(0, now["VmHWM"] - self.rss0) * 1024
        if not self.can_reset and now["VmHWM"] == self.hwm0:
            self.peak = None  # below an older high-water mark: unknown
        self.private = (now["RssAnon"] - self.anon0) * 1024


def timed(fn: Callable[..., Any], *args: Any) -> Dict[str, Any]:
    """Run fn once, timing it and probing memory; its result stays alive until the
    probe has read the memory it holds."""
    with MemoryProbe() as probe:
        start = time.perf_counter()
        result = fn(*args)
        elapsed = time.perf_counter() - start
    return {"time": elapsed, "peak": probe.peak, "private": probe.private, "result": result}


# ---------------------------------------------------------------------------
# Workload 1: open + get every tensor of a 1 GiB file (64 F32 tensors)
# `d` is a dataset: {"st", "npy", "npz", "pt", "pkl", "count"} (see inputs.py)
# ---------------------------------------------------------------------------


def _npy_files(folder: str) -> List[Tuple[str, str]]:
    return [(name[:-4], os.path.join(folder, name))
            for name in sorted(os.listdir(folder)) if name.endswith(".npy")]


def fastst_views(d):
    with fastst.safe_open(d["st"], framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def fastst_load_file(d):
    return fastst.load_file(d["st"])


def fastst_copy(d):
    with fastst.safe_open(d["st"], framework="np") as f:
        return {k: f.get_tensor(k).copy() for k in f.keys()}


def fastst_pread(d):
    with fastst.safe_open(d["st"], framework="np", backend="pread") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def fastst_pt_load_file(d):
    import fastst.torch
    return fastst.torch.load_file(d["st"])


def st_np_get(d):
    with safetensors.safe_open(d["st"], framework="np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def st_np_pread(d):
    with safetensors.safe_open(d["st"], framework="np", backend="pread") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def st_np_load_file(d):
    return st_np.load_file(d["st"])


def st_pt_get(d):
    with safetensors.safe_open(d["st"], framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def st_pt_clone(d):
    with safetensors.safe_open(d["st"], framework="pt") as f:
        return {k: f.get_tensor(k).clone() for k in f.keys()}


def st_pt_pread(d):
    with safetensors.safe_open(d["st"], framework="pt", backend="pread") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def st_pt_load_file(d):
    return st_pt.load_file(d["st"])


def npy_load(d):
    return {k: np.load(path) for k, path in _npy_files(d["npy"])}


def npy_mmap(d):
    return {k: np.load(path, mmap_mode="r") for k, path in _npy_files(d["npy"])}


def npy_mmap_copy(d):
    return {k: np.array(np.load(path, mmap_mode="r")) for k, path in _npy_files(d["npy"])}


def npz_load(d):
    with np.load(d["npz"]) as z:
        return {k: z[k] for k in z.files}


def torch_load_mmap(d):
    return torch.load(d["pt"], mmap=True, weights_only=True)


def torch_load_mmap_clone(d):
    return {k: v.clone() for k, v in torch.load(d["pt"], mmap=True, weights_only=True).items()}


def torch_load(d):
    return torch.load(d["pt"], weights_only=True)


def fastst_load_file_copy(d):
    return fastst.load_file(d["st"], copy=True)


def pickle_load(d):
    with open(d["pkl"], "rb") as f:
        return pickle.load(f)


def raw_readinto(d):
    """The raw limit for reading: the whole file into one fresh buffer."""
    path = d["st"]
    size = os.path.getsize(path)
    buffer = np.empty(size, np.uint8)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        done = 0
        while done < size:
            got = f.readinto(view[done:])
            if not got:
                raise EOFError(path)
            done += got
    return buffer


READ_LAZY = [
    Peer("fastst_views", "fastst safe_open + get_tensor (mmap views)", "fastst", (), fastst_views),
    Peer("fastst_load_file", "fastst load_file (mmap views)", "fastst", (), fastst_load_file),
    Peer("st_np_get", "safetensors np safe_open + get_tensor (copies)", "peer", ST, st_np_get),
    Peer("st_np_load_file", "safetensors np load_file (copies)", "peer", ST, st_np_load_file),
    Peer("fastst_pt_load_file", "fastst.torch load_file (views of the map)", "fastst", PT,
         fastst_pt_load_file),
    Peer("st_pt_get", "safetensors pt safe_open + get_tensor (lazy mmap)", "peer", ST_PT,
         st_pt_get),
    Peer("st_pt_load_file", "safetensors pt load_file (lazy mmap)", "peer", ST_PT, st_pt_load_file),
    Peer("npy_mmap", "np.load mmap_mode='r' (.npy folder)", "peer", (), npy_mmap),
    Peer("torch_load_mmap", "torch.load mmap=True, weights_only=True", "peer", PT, torch_load_mmap),
]

READ_PRIVATE = [
    Peer("fastst_copy", "fastst get_tensor + .copy()", "fastst", (), fastst_copy),
    Peer("fastst_pread", "fastst backend='pread'", "fastst", (), fastst_pread),
    Peer("fastst_load_file_copy", "fastst load_file(copy=True)", "fastst",
         ("fastst load_file(copy=)",), fastst_load_file_copy),
    Peer("st_np_get", "safetensors np safe_open + get_tensor", "peer", ST, st_np_get),
    Peer("st_np_pread", "safetensors np backend='pread'", "peer", ST, st_np_pread),
    Peer("st_pt_clone", "safetensors pt get_tensor + .clone()", "peer", ST_PT, st_pt_clone),
    Peer("st_pt_pread", "safetensors pt backend='pread'", "peer", ST_PT, st_pt_pread),
    Peer("npy_load", "np.load (.npy folder)", "peer", (), npy_load),
    Peer("npy_mmap_copy", "np.load mmap_mode='r' + np.array copy (.npy folder)", "peer", (),
         npy_mmap_copy),
    Peer("npz_load", "np.load (.npz, np.savez) + every member", "peer", (), npz_load),
    Peer("torch_load", "torch.load weights_only=True", "peer", PT, torch_load),
    Peer("torch_load_mmap_clone", "torch.load mmap=True + .clone()", "peer", PT,
         torch_load_mmap_clone),
    Peer("pickle_load", "pickle.load (protocol 5)", "peer", (), pickle_load),
    Peer("raw_readinto", "raw limit: readinto a fresh np.empty", "raw", (), raw_readinto),
]

# ---------------------------------------------------------------------------
# Workload 3: a file of many tiny tensors: keys(), and load_file
# ---------------------------------------------------------------------------


def fastst_keys(d):
    with fastst.safe_open(d["st"], framework="np") as f:
        return f.keys()


def st_np_keys(d):
    with safetensors.safe_open(d["st"], framework="np") as f:
        return list(f.keys())


def st_pt_keys(d):
    with safetensors.safe_open(d["st"], framework="pt") as f:
        return list(f.keys())


def npz_keys(d):
    with np.load(d["npz"]) as z:
        return list(z.files)


def header_json_keys(d):
    """What keys() costs at least in Python: read the header and parse it, with no
    validation."""
    with open(d["st"], "rb", buffering=0) as f:
        n = int.from_bytes(f.read(8), "little")
        header = orjson.loads(f.read(n))
    header.pop("__metadata__", None)
    return sorted(header)


def fastst_load_file_pread(d):
    return fastst.load_file(d["st"], backend="pread")


TINY_KEYS = [
    Peer("fastst_keys", "fastst safe_open + keys()", "fastst", (), fastst_keys),
    Peer("st_np_keys", "safetensors np safe_open + keys()", "peer", ST, st_np_keys),
    Peer("st_pt_keys", "safetensors pt safe_open + keys()", "peer", ST_PT, st_pt_keys),
    Peer("npz_keys", "np.load (.npz) .files", "peer", (), npz_keys),
    Peer("header_json_keys", "ref: read header + orjson.loads + sorted (no checks)", "ref", (),
         header_json_keys),
]

TINY_LOAD = [
    Peer("fastst_load_file", "fastst load_file (mmap views)", "fastst", (), fastst_load_file),
    Peer("fastst_load_file_pread", "fastst load_file backend='pread'", "fastst", (),
         fastst_load_file_pread),
    Peer("st_np_load_file", "safetensors np load_file", "peer", ST, st_np_load_file),
    Peer("st_pt_load_file", "safetensors pt load_file", "peer", ST_PT, st_pt_load_file),
    Peer("npz_load", "np.load (.npz) + every member", "peer", (), npz_load),
    Peer("torch_load_mmap", "torch.load mmap=True, weights_only=True", "peer", PT, torch_load_mmap),
    Peer("pickle_load", "pickle.load (protocol 5)", "peer", (), pickle_load),
    Peer("raw_readinto", "raw limit: readinto a fresh np.empty", "raw", (), raw_readinto),
]

# ---------------------------------------------------------------------------
# Workload 4: one get_tensor call on an open handle (setup returns the call)
# ---------------------------------------------------------------------------


def _tiny_target(d) -> str:
    return d["probe"]


def call_fastst(d):
    f = fastst.safe_open(d["st"], framework="np")
    name = _tiny_target(d)
    return lambda: f.get_tensor(name)


def call_fastst_pread(d):
    f = fastst.safe_open(d["st"], framework="np", backend="pread")
    name = _tiny_target(d)
    return lambda: f.get_tensor(name)


def call_fastst_slice(d):
    f = fastst.safe_open(d["st"], framework="np")
    name = _tiny_target(d)
    return lambda: f.get_slice(name)[:1]


def call_st_np(d):
    f = safetensors.safe_open(d["st"], framework="np")
    name = _tiny_target(d)
    return lambda: f.get_tensor(name)


def call_st_np_slice(d):
    f = safetensors.safe_open(d["st"], framework="np")
    name = _tiny_target(d)
    return lambda: f.get_slice(name)[:1]


def call_st_pt(d):
    f = safetensors.safe_open(d["st"], framework="pt")
    name = _tiny_target(d)
    return lambda: f.get_tensor(name)


def call_npz(d):
    z = np.load(d["npz"])
    name = _tiny_target(d)
    return lambda: z[name]


def _tiny_offset(d) -> Tuple[int, int]:
    with open(d["st"], "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        entry = orjson.loads(f.read(n))[_tiny_target(d)]
    begin, end = entry["data_offsets"]
    return 8 + n + begin, end - begin


def call_np_view(d):
    offset, length = _tiny_offset(d)
    with open(d["st"], "rb") as f:
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    count = length // 4
    return lambda: np.frombuffer(mapping, np.float32, count, offset)


def call_raw_pread(d):
    offset, length = _tiny_offset(d)
    fd = os.open(d["st"], os.O_RDONLY)
    count = length // 4
    preadv, empty, f32 = os.preadv, np.empty, np.float32

    def call():
        out = empty(count, f32)
        preadv(fd, [out], offset)
        return out
    return call


PER_CALL = [
    Peer("fastst", "fastst get_tensor (mmap view)", "fastst", (), call_fastst),
    Peer("fastst_pread", "fastst get_tensor, backend='pread'", "fastst", (), call_fastst_pread),
    Peer("fastst_slice", "fastst get_slice(name)[:1]", "fastst", (), call_fastst_slice),
    Peer("st_np", "safetensors np get_tensor", "peer", ST, call_st_np),
    Peer("st_np_slice", "safetensors np get_slice(name)[:1]", "peer", ST, call_st_np_slice),
    Peer("st_pt", "safetensors pt get_tensor", "peer", ST_PT, call_st_pt),
    Peer("npz", "np.load (.npz) handle: z[name]", "peer", (), call_npz),
    Peer("np_view", "ref: np.frombuffer over an mmap (view, no checks)", "ref", (), call_np_view),
    Peer("raw_pread", "raw limit: os.preadv into a fresh np.empty", "raw", (), call_raw_pread),
]

# ---------------------------------------------------------------------------
# Workloads 2 and 5: saving. fn(arrays, torch_tensors, out) returns what it made.
# ---------------------------------------------------------------------------


def save_fastst_file(a, t, out):
    fastst.save_file(a, out + ".safetensors")


def save_fastst_bytes(a, t, out):
    return fastst.save(a)


def save_fastst_pt_file(a, t, out):
    import fastst.torch
    fastst.torch.save_file(t, out + ".safetensors")


def save_st_np_file(a, t, out):
    st_np.save_file(a, out + ".safetensors")


def save_st_np_bytes(a, t, out):
    return st_np.save(a)


def save_st_pt_file(a, t, out):
    st_pt.save_file(t, out + ".safetensors")


def save_st_pt_bytes(a, t, out):
    return st_pt.save(t)


def save_npy_folder(a, t, out):
    os.makedirs(out, exist_ok=True)
    for k, v in a.items():
        np.save(os.path.join(out, k + ".npy"), v)


def save_npz(a, t, out):
    np.savez(out + ".npz", **a)


def save_torch(a, t, out):
    torch.save(t, out + ".pt")


def save_pickle_file(a, t, out):
    with open(out + ".pkl", "wb") as f:
        pickle.dump(a, f, protocol=5)


def save_pickle_bytes(a, t, out):
    return pickle.dumps(a, protocol=5)


def save_raw(a, t, out):
    """The raw limit for writing: each array's memory, in order, with f.write()."""
    with open(out + ".raw", "wb") as f:
        for k in sorted(a):
            v = a[k]
            f.write(v if v.flags.c_contiguous else v.T)


SAVE_FILE = [
    Peer("fastst_file", "fastst save_file", "fastst", (), save_fastst_file),
    Peer("fastst_pt_file", "fastst.torch save_file", "fastst", PT, save_fastst_pt_file),
    Peer("st_np_file", "safetensors np save_file", "peer", ST, save_st_np_file),
    Peer("st_pt_file", "safetensors pt save_file", "peer", ST_PT, save_st_pt_file),
    Peer("npy_folder", "np.save (.npy folder)", "peer", (), save_npy_folder),
    Peer("npz", "np.savez (.npz)", "peer", (), save_npz),
    Peer("torch_save", "torch.save", "peer", PT, save_torch),
    Peer("pickle_file", "pickle.dump (protocol 5)", "peer", (), save_pickle_file),
    Peer("raw_write", "raw limit: f.write of each array", "raw", (), save_raw),
]

SAVE_MEMORY = [
    SAVE_FILE[0],
    Peer("fastst_bytes", "fastst save -> bytes", "fastst", (), save_fastst_bytes),
    SAVE_FILE[1],
    SAVE_FILE[2],
    Peer("st_np_bytes", "safetensors np save -> bytes", "peer", ST, save_st_np_bytes),
    SAVE_FILE[3],
    Peer("st_pt_bytes", "safetensors pt save -> bytes", "peer", ST_PT, save_st_pt_bytes),
    *SAVE_FILE[4:8],
    Peer("pickle_bytes", "pickle.dumps (protocol 5) -> bytes", "peer", (), save_pickle_bytes),
    SAVE_FILE[8],
]


def make_tensors(count: int, rows: int,
                 order: Literal["C", "F"] = "C") -> Dict[str, np.ndarray]:
    tensors = {}
    for i in range(count):
        array = np.empty((rows, 1024), np.float32, order=order)
        array.fill(i)
        array[0] = np.arange(1024)   # not constant, so a transposed write shows
        tensors[f"layer{i:03d}.weight"] = array
    return tensors


def _as_torch(arrays: Dict[str, np.ndarray]):
    return {k: torch.from_numpy(v) for k, v in arrays.items()}


def _clear(out: str) -> None:
    for suffix in ("", ".safetensors", ".npz", ".pt", ".pkl", ".raw"):
        path = out + suffix
        if os.path.isdir(path):
            shutil.rmtree(path)
        elif os.path.exists(path):
            os.unlink(path)


def _check_saved(peer_key: str, result: Any, out: str,
                 arrays: Dict[str, np.ndarray]) -> Optional[str]:
    """Read back what a safetensors writer produced; a note when it differs."""
    if isinstance(result, (bytes, bytearray)) and peer_key.startswith(("fastst", "st_")):
        loaded = fastst.load(result)
    elif os.path.exists(out + ".safetensors"):
        loaded = fastst.load_file(out + ".safetensors")
    else:
        return None
    for k, v in arrays.items():
        if not np.array_equal(loaded[k], v):
            return f"WRONG DATA: tensor {k!r} reads back different from the input"
    return None


# ---------------------------------------------------------------------------
# Workload 7: random row batches from one big [N, 1024] F32 tensor.
# setup(d) returns gather(index) -> batch.
# ---------------------------------------------------------------------------


def gather_fastst(d):
    f = fastst.safe_open(d["st"], framework="np")
    return lambda index: f.get_slice("x")[index]


def gather_fastst_pread(d):
    f = fastst.safe_open(d["st"], framework="np", backend="pread")
    return lambda index: f.get_slice("x")[index]


def gather_numpy_memory(d):
    array = np.load(d["npy"])
    return lambda index: array[index]


def gather_npy_mmap(d):
    array = np.load(d["npy"], mmap_mode="r")
    return lambda index: array[index]


def gather_torch_mmap(d):
    tensor = torch.load(d["pt"], mmap=True, weights_only=True)["x"]
    return lambda index: tensor[torch.from_numpy(index)]


def gather_st_pt_tensor(d):
    f = safetensors.safe_open(d["st"], framework="pt")
    return lambda index: f.get_tensor("x")[torch.from_numpy(index)]


def gather_st_np_rows(d):
    f = safetensors.safe_open(d["st"], framework="np")

    def gather(index):
        rows = f.get_slice("x")
        return np.concatenate([rows[i:i + 1] for i in index.tolist()])
    return gather


def gather_st_pt_rows(d):
    f = safetensors.safe_open(d["st"], framework="pt")

    def gather(index):
        rows = f.get_slice("x")
        return torch.cat([rows[i:i + 1] for i in index.tolist()])
    return gather


def gather_raw(d):
    with open(d["st"], "rb") as f:
        start = 8 + int.from_bytes(f.read(8), "little")
    fd = os.open(d["st"], os.O_RDONLY)
    row_bytes = d["row_bytes"]

    def gather(index):
        out = np.empty((len(index), row_bytes // 4), np.float32)
        for j, i in enumerate(index.tolist()):
            os.preadv(fd, [out[j]], start + i * row_bytes)
        return out
    return gather


LOADER = [
    Peer("fastst", "fastst get_slice(name)[index] (mmap)", "fastst", (), gather_fastst),
    Peer("fastst_pread", "fastst get_slice(name)[index], backend='pread'", "fastst", (),
         gather_fastst_pread),
    Peer("numpy_memory", "ref: NumPy fancy indexing, array in memory", "ref", (),
         gather_numpy_memory),
    Peer("npy_mmap", "np.load mmap_mode='r' (.npy) [index]", "peer", (), gather_npy_mmap),
    Peer("torch_mmap", "torch.load mmap=True [index]", "peer", PT, gather_torch_mmap),
    Peer("st_pt_tensor", "safetensors pt get_tensor(name)[index] (lazy mmap)", "peer", ST_PT,
         gather_st_pt_tensor),
    Peer("st_np_rows", "safetensors np get_slice: row by row + concatenate", "peer", ST,
         gather_st_np_rows),
    Peer("st_pt_rows", "safetensors pt get_slice: row by row + torch.cat", "peer", ST_PT,
         gather_st_pt_rows),
    Peer("raw", "raw limit: os.preadv per row into a fresh np.empty", "raw", (), gather_raw),
]

# ---------------------------------------------------------------------------
# Workload 8: a header of many metadata keys whose last key repeats
# ---------------------------------------------------------------------------


def reject_fastst(blob):
    try:
        fastst.load(blob)
    except fastst.SafetensorError:
        return "rejected"
    return "accepted"


def reject_st_np(blob):
    try:
        st_np.load(blob)
    except Exception:   # safetensors_rust.SafetensorError, or whatever the peer raises
        return "rejected"
    return "accepted"


REJECT = [
    Peer("fastst", "fastst.load", "fastst", (), reject_fastst),
    Peer("st_np", "safetensors.numpy.load", "peer", ST, reject_st_np),
]


# Rows that may read most of the tensor per batch get only this many batches.
SLOW_LOADERS = {"fastst_pread": 10}

REGISTRY = {
    "read_lazy": READ_LAZY, "read_private": READ_PRIVATE, "tiny_keys": TINY_KEYS,
    "tiny_load": TINY_LOAD, "per_call": PER_CALL, "save_file": SAVE_FILE,
    "save_memory": SAVE_MEMORY, "loader": LOADER, "reject": REJECT,
}


def find(group: str, key: str) -> Peer:
    for peer in REGISTRY[group]:
        if peer.key == key:
            return peer
    raise KeyError(f"{group}/{key}")


# ---------------------------------------------------------------------------
# What a child runs. Each returns a plain dict that the parent tabulates.
# ---------------------------------------------------------------------------


def _length(result: Any) -> int:
    return len(result) if hasattr(result, "__len__") else -1


def measure_read(group: str, key: str, data: dict, warm: dict) -> Dict[str, Any]:
    """One timed call of a reading peer after a warm-up call on a small file of the
    same format (so one-off lazy imports are not timed)."""
    fn = find(group, key).fn
    fn(warm)
    got = timed(fn, data)
    result = got.pop("result")
    if key != "raw_readinto" and _length(result) != data["count"]:
        raise AssertionError(f"{key} returned {_length(result)} entries, expected {data['count']}")
    del result
    return got


def measure_per_call(key: str, data: dict, repeats: int, min_time: float) -> Dict[str, Any]:
    call = find("per_call", key).fn(data)
    call()
    timer = timeit.Timer(call)
    number = 1
    while True:   # timeit's autorange, with our own minimum duration
        if timer.timeit(number) >= min_time:
            break
        number *= 2 if number < 8 else 4
    runs = timer.repeat(repeat=repeats, number=number)
    per_call = [run / number for run in runs]
    return {"time": statistics.median(per_call), "times": per_call, "number": number}


def measure_reject(key: str, path: str) -> Dict[str, Any]:
    with open(path, "rb") as f:
        blob = f.read()
    got = timed(find("reject", key).fn, blob)
    got["note"] = got.pop("result")
    return got


def measure_save_memory(key: str, count: int, rows: int, order: Literal["C", "F"],
                        out: str) -> Dict[str, Any]:
    """Peak memory of one save, beyond the input tensors (allocated before the probe)."""
    peer = find("save_memory", key)
    torch_needed = "torch" in peer.needs
    warm_arrays = make_tensors(2, 8, order)
    peer.fn(warm_arrays, _as_torch(warm_arrays) if torch_needed else None, out)
    _clear(out)
    arrays = make_tensors(count, rows, order)
    tensors = _as_torch(arrays) if torch_needed else None
    got = timed(peer.fn, arrays, tensors, out)
    result = got.pop("result")
    got["note"] = _check_saved(key, result, out, arrays)
    del result
    _clear(out)
    return got


def measure_save_time(keys: List[str], count: int, rows: int, repeats: int,
                      out_dir: str) -> Dict[str, Any]:
    """Time each writer `repeats` times, interleaved (the order rotates each round),
    with os.sync() before every run so one run's writeback does not land on the next."""
    peers = [find("save_file", key) for key in keys]
    arrays = make_tensors(count, rows)
    tensors = _as_torch(arrays) if torch is not None else None
    warm = make_tensors(2, 8)
    warm_t = _as_torch(warm) if torch is not None else None
    times: Dict[str, List[float]] = {key: [] for key in keys}
    errors: Dict[str, str] = {}
    for peer in peers:
        out = os.path.join(out_dir, peer.key)
        try:
            peer.fn(warm, warm_t, out)
        except Exception as error:   # noqa: BLE001 - reported in the table
            errors[peer.key] = f"{type(error).__name__}: {error}"
        _clear(out)
    for round_ in range(repeats):
        order = peers[round_ % len(peers):] + peers[:round_ % len(peers)]
        for peer in order:
            if peer.key in errors:
                continue
            out = os.path.join(out_dir, peer.key)
            _clear(out)
            os.sync()
            start = time.perf_counter()
            try:
                peer.fn(arrays, tensors, out)
            except Exception as error:   # noqa: BLE001
                errors[peer.key] = f"{type(error).__name__}: {error}"
                continue
            times[peer.key].append(time.perf_counter() - start)
            _clear(out)
    os.sync()
    return {"times": times, "errors": errors}


def measure_loader(key: str, data: dict, warm: dict, batches: int, batch: int,
                   seed: int) -> Dict[str, Any]:
    peer = find("loader", key)
    batches = min(batches, SLOW_LOADERS.get(key, batches))
    warm_gather = peer.fn(warm)
    warm_gather(np.arange(4))
    del warm_gather
    gather = peer.fn(data)
    rng = np.random.default_rng(seed)
    indices = [rng.choice(data["rows"], batch, replace=False) for _ in range(batches)]
    times = []
    read_before = _io_read_bytes()
    with MemoryProbe() as probe:
        for index in indices:
            start = time.perf_counter()
            out = gather(index)
            times.append(time.perf_counter() - start)
            if out.shape[0] != batch:
                raise AssertionError(f"{key}: batch of {out.shape[0]} rows")
    first = np.asarray(out[:, 0])   # row i holds the value i (datasets.py)
    if not np.array_equal(first, index.astype(np.float32)):
        raise AssertionError(f"{key}: gathered the wrong rows")
    read = _io_read_bytes() - read_before
    return {"time": statistics.median(times), "times": times, "peak": probe.peak,
            "private": probe.private, "batches": batches, "read_per_batch": read / batches}


def _io_read_bytes() -> int:
    """Bytes this process has read through read-like system calls (rchar)."""
    with open("/proc/self/io") as io:
        for line in io:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def child_main(conn, func_name: str, args: tuple, settings: Dict[str, Any]) -> None:
    """Entry point of a measurement child: run one function, send back its dict."""
    # Everything inherited from the server is long-lived: keep the collector off it
    # (walking it costs time and copies the shared pages).
    gc.freeze()
    try:
        if torch is not None and settings.get("torch_threads"):
            torch.set_num_threads(settings["torch_threads"])
        result = globals()[func_name](*args)
    except BaseException as error:   # noqa: BLE001 - everything goes back to the table
        message = str(error).strip().splitlines()
        text = f"{type(error).__name__}: {message[0] if message else ''}"
        result = {"error": text if len(text) <= 100 else text[:99] + "…"}
    conn.send(result)
    conn.close()
