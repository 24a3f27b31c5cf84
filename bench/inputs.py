"""The benchmark's input files, written once per set of parameters.

Each dataset is one folder holding the same tensors in every format the peers read:
``model.safetensors``, ``npy/`` (one .npy per tensor), ``model.npz`` (np.savez,
uncompressed), ``model.pt`` (torch.save, when torch is installed) and ``model.pkl``
(pickle protocol 5). A ``params.json`` records what was written, so a later run with
the same parameters reuses the files.
"""
from __future__ import annotations

import json
import os
import pickle
import shutil
from typing import Any, Dict, Iterable

import numpy as np

import fastst
from peers import make_tensors, torch

FORMATS_ALL = ("st", "npy", "npz", "pt", "pkl")


def _paths(folder: str) -> Dict[str, str]:
    return {
        "st": os.path.join(folder, "model.safetensors"),
        "npy": os.path.join(folder, "npy"),
        "npz": os.path.join(folder, "model.npz"),
        "pt": os.path.join(folder, "model.pt"),
        "pkl": os.path.join(folder, "model.pkl"),
    }


def _write(folder: str, tensors: Dict[str, np.ndarray], formats: Iterable[str]) -> None:
    paths = _paths(folder)
    formats = set(formats)
    if "st" in formats:
        fastst.save_file(tensors, paths["st"])
    if "npy" in formats:
        os.makedirs(paths["npy"], exist_ok=True)
        for name, array in tensors.items():
            np.save(os.path.join(paths["npy"], name + ".npy"), array)
    if "npz" in formats:
        np.savez(paths["npz"], **tensors)  # type: ignore[arg-type]
    if "pt" in formats and torch is not None:
        torch.save({k: torch.from_numpy(v) for k, v in tensors.items()}, paths["pt"])
    if "pkl" in formats:
        with open(paths["pkl"], "wb") as f:
            pickle.dump(tensors, f, protocol=5)


def _dataset(root: str, name: str, params: Dict[str, Any], build, formats) -> Dict[str, Any]:
    """Folder `root/name` holding `build()`'s tensors in `formats`, reused when its
    params.json matches."""
    folder = os.path.join(root, name)
    stamp = dict(params, formats=sorted(formats), torch=torch is not None)
    stamp_path = os.path.join(folder, "params.json")
    try:
        with open(stamp_path) as f:
            fresh = json.load(f) != stamp
    except (OSError, ValueError):
        fresh = True
    if fresh:
        shutil.rmtree(folder, ignore_errors=True)
        os.makedirs(folder)
        tensors = build()
        _write(folder, tensors, formats)
        del tensors
        with open(stamp_path, "w") as f:
            json.dump(stamp, f)
    info: Dict[str, Any] = {k: v for k, v in _paths(folder).items() if k in formats}
    info.update(params)
    info["folder"] = folder
    return info


def big(root: str, size_mib: int, count: int = 64, warm: bool = False) -> Dict[str, Any]:
    """`count` F32 tensors of [rows, 1024], `size_mib` MiB in all."""
    rows = 8 if warm else size_mib * 1024 * 1024 // (count * 4096)
    if not warm and rows * count * 4096 != size_mib * 1024 * 1024:
        raise ValueError(f"--size-mib {size_mib} does not split into {count} tensors of "
                         f"[rows, 1024] F32")
    name = "big_warm" if warm else "big"
    count = 2 if warm else count
    return _dataset(root, name, {"count": count, "rows": rows},
                    lambda: make_tensors(count, rows), FORMATS_ALL)


def tiny(root: str, count: int, warm: bool = False) -> Dict[str, Any]:
    """`count` tensors of shape [2] F32, one storage each."""
    count = 16 if warm else count

    def build():
        base = np.arange(2 * count, dtype=np.float32).reshape(count, 2)
        return {f"t{i:07d}": base[i].copy() for i in range(count)}
    info = _dataset(root, "tiny_warm" if warm else "tiny", {"count": count}, build,
                    ("st", "npz", "pt", "pkl"))
    info["probe"] = f"t{count // 2:07d}"
    return info


def loader(root: str, size_mib: int, warm: bool = False) -> Dict[str, Any]:
    """One F32 tensor "x" of [rows, 1024] whose row i holds the value i."""
    rows = 64 if warm else size_mib * 256
    if rows >= 1 << 24:
        raise ValueError("--size-mib too large for exact float32 row labels")

    def build():
        x = np.empty((rows, 1024), np.float32)
        x[:] = np.arange(rows, dtype=np.float32)[:, None]
        return {"x": x}
    info = _dataset(root, "loader_warm" if warm else "loader", {"rows": rows, "count": 1},
                    build, ("st", "npy", "pt"))
    info["npy"] = os.path.join(info["npy"], "x.npy")
    info["row_bytes"] = 4096
    return info


def repeated_metadata_key(root: str, keys: int) -> str:
    """A safetensors file with no tensors whose __metadata__ holds `keys` keys, the
    last of them twice: a hostile header for the error path."""
    path = os.path.join(root, f"repeated_key_{keys}.safetensors")
    if not os.path.exists(path):
        members = b",".join(b'"k%d":"v"' % i for i in range(keys))
        header = b'{"__metadata__":{' + members + b',"k%d":"v"}}' % (keys - 1)
        os.makedirs(root, exist_ok=True)
        with open(path, "wb") as f:
            f.write(len(header).to_bytes(8, "little") + header)
    return path


def warm_page_cache(*datasets: Dict[str, Any]) -> None:
    """Read every file of the datasets once, so timings see a hot page cache."""
    buffer = bytearray(16 << 20)
    view = memoryview(buffer)
    for info in datasets:
        for dirpath, _, files in os.walk(info["folder"]):
            for name in files:
                with open(os.path.join(dirpath, name), "rb", buffering=0) as f:
                    while f.readinto(view):
                        pass
