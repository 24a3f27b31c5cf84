"""What ``fastst inspect`` reports of a file, a sharded checkpoint or a URL: the
report as plain data (``describe``), as text (``render_inspect``,
``render_checkpoint``) and as JSON lines, and why a file that is not one cannot be
read (``diagnose``). The command line and the demo print it.
"""
from __future__ import annotations

import os
import re
import stat
import struct
from typing import Any, Dict, List, Optional, Sequence

from .._core import DEFAULT_MAX_HEADER_SIZE, SafetensorError, foreign_format
from .._format.names import is_checkpoint_path
from .._handles.handle import data_bytes, open_handle
from .._io.source import as_source

__all__ = ["describe", "describe_checkpoint", "diagnose", "explain", "format_table",
           "human_size", "inspect_file", "json_lines", "printable", "render_checkpoint",
           "render_inspect"]

# The alignments the report counts tensors at: a cache line, a GPU's widest loads, a
# page (direct I/O). See ``align=`` on the writers.
SHOWN_ALIGNMENTS = (64, 256, 4096)


def human_size(nbytes: int) -> str:
    """``1536`` -> ``"1.5 KiB"``; sizes under 1 KiB stay in bytes."""
    if nbytes < 1024:
        return f"{nbytes} B"
    value = float(nbytes)
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB"):
        value /= 1024.0
        if value < 1024.0 or unit == "PiB":
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def printable(text: str) -> str:
    """Text as one printable table cell: names with control characters are quoted."""
    return text if text.isprintable() else repr(text)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def aligned_counts(starts: Sequence[int]) -> Dict[str, int]:
    """How many of the tensors starting at file offsets `starts` start at a multiple
    of each of SHOWN_ALIGNMENTS, by alignment (as a JSON key)."""
    return {str(align): sum(start % align == 0 for start in starts)
            for align in SHOWN_ALIGNMENTS}


def _aligned_line(info: Dict[str, Any]) -> List[str]:
    if not info["tensor_count"]:
        return []
    counts = ", ".join(f"{count}/{info['tensor_count']} at {human_size(int(align))}"
                       for align, count in info["aligned"].items())
    return [f"aligned      {counts} (tensors starting at multiples of it)"]


def format_table(headers: Sequence[str], rows: Sequence[Sequence[str]],
                 right: Sequence[bool]) -> List[str]:
    """Align `rows` under `headers`: columns flagged in `right` are right-aligned."""
    widths = [len(h) for h in headers]
    for row in rows:
        for k, cell in enumerate(row):
            widths[k] = max(widths[k], len(cell))

    def line(cells: Sequence[str]) -> str:
        parts = [c.rjust(w) if r else c.ljust(w) for c, w, r in zip(cells, widths, right)]
        return "  ".join(parts).rstrip()

    return [line(headers), line(["-" * w for w in widths])] + [line(row) for row in rows]


def describe(path: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> Dict[str, Any]:
    """Everything `fastst inspect` reports about the file at `path`, as plain data.

    Raises SafetensorError for a malformed file and OSError when it cannot be read.
    A sharded checkpoint (a directory or an ``*.index.json``) gets
    `describe_checkpoint()`'s report. A URL (``https://``, ``s3://``, ...) is read
    by byte ranges: its header, nothing else.
    """
    if is_checkpoint_path(path):
        return describe_checkpoint(path, max_header_size)
    with open_handle(as_source(path), max_header_size=max_header_size,
                     uses_ml_dtypes=False) as reader:
        tensors = []
        for name in reader.offset_keys():
            info = reader.info(name)
            begin, end = info.data_offsets
            tensors.append({"name": name, "dtype": info.dtype, "shape": info.shape,
                            "nbytes": end - begin, "data_offsets": [begin, end]})
        data_start = reader.data_start
        metadata = reader.metadata()
        file_size = data_start + data_bytes(reader)
    return {
        "file": as_source(path).label,
        "tensors": tensors,
        "tensor_count": len(tensors),
        "total_bytes": sum(t["nbytes"] for t in tensors),
        "header_size": data_start - 8,
        "data_start": data_start,
        "aligned": aligned_counts([data_start + t["data_offsets"][0] for t in tensors]),
        "file_size": file_size,
        "metadata": metadata,
    }


def describe_checkpoint(path: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
                        ) -> Dict[str, Any]:
    """What `fastst inspect` reports about the sharded checkpoint at `path`: every
    tensor with its shard, each shard, the totals and the index's metadata. A
    directory holding one unsharded file gets that file's `describe()`."""
    from ..checkpoint import ShardedHandle, open_checkpoint   # for checkpoints only

    with open_checkpoint(path, max_header_size=max_header_size, uses_ml_dtypes=False) as handle:
        if not isinstance(handle, ShardedHandle):
            return describe(handle.source, max_header_size)
        # in the order of the files, not of the index (which lists tensors by name)
        opened_shards = sorted(zip(handle.index.shards, handle.shards()),
                               key=lambda pair: _natural_order(pair[0]))
        tensors = []
        for shard, opened in opened_shards:
            for name in opened.offset_keys():
                info = opened.info(name)
                begin, end = info.data_offsets
                tensors.append({"name": name, "dtype": info.dtype, "shape": info.shape,
                                "nbytes": end - begin, "data_offsets": [begin, end],
                                "shard": shard})
        shards = [{"file": shard, "tensor_count": len(handle.index.shards[shard]),
                   "file_size": opened.data_start + data_bytes(opened)}
                  for shard, opened in opened_shards]
        data_starts = {shard: opened.data_start for shard, opened in opened_shards}
        return {
            "file": as_source(path).label,
            "index": handle.source,
            "tensors": tensors,
            "tensor_count": len(tensors),
            "total_bytes": sum(t["nbytes"] for t in tensors),
            "shards": shards,
            "aligned": aligned_counts([data_starts[t["shard"]] + t["data_offsets"][0]
                                       for t in tensors]),
            "file_size": sum(shard["file_size"] for shard in shards),
            "metadata": handle.metadata(),
        }


def _natural_order(name: str) -> List[Any]:
    """A sort key that orders the numbers in names by value: part-2 before part-10."""
    parts = re.split(r"(\d+)", name)     # text, number, text...: like types face each other
    return [int(part) if k % 2 else part for k, part in enumerate(parts)]


def render_checkpoint(info: Dict[str, Any]) -> List[str]:
    """The human-readable report of `describe_checkpoint()`, one string per line."""
    lines = [f"checkpoint: {printable(info['file'])}", f"index: {printable(info['index'])}", ""]
    rows = [[printable(t["name"]), t["dtype"], _shape_text(t["shape"]), str(t["nbytes"]),
             human_size(t["nbytes"]), printable(t["shard"])] for t in info["tensors"]]
    if rows:
        lines += format_table(["name", "dtype", "shape", "bytes", "size", "shard"], rows,
                              [False, False, False, True, True, False])
    else:
        lines.append("(no tensors)")
    total, size = info["total_bytes"], info["file_size"]
    lines += ["", f"tensors      {info['tensor_count']}",
              f"total bytes  {total} ({human_size(total)})", *_aligned_line(info),
              f"files size   {size} ({human_size(size)})",
              "", f"shards       {len(info['shards'])}"]
    lines += format_table(["  file", "tensors", "size"],
                          [["  " + printable(shard["file"]), str(shard["tensor_count"]),
                            human_size(shard["file_size"])] for shard in info["shards"]],
                          [False, True, True])[2:]
    metadata = info["metadata"] or {}
    if metadata:
        import json     # an index's metadata may hold more than text

        lines += ["", "metadata"]
        width = max(len(printable(key)) for key in metadata)
        for key, value in metadata.items():
            text = value if isinstance(value, str) else json.dumps(value)
            lines.append(f"  {printable(key).ljust(width)}  {printable(text)}".rstrip())
    return lines


def diagnose(path: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> Optional[str]:
    """Why the file at `path` cannot be read, in the command line's words, where they
    tell more than the core's: a checkpoint that ``fastst convert`` takes comes with
    the command that converts it, and a header over the limit is read by raising
    --max-header-size. None when the core's message says it all.
    """
    # imported for a file that cannot be read: the converter's modules are many
    import shlex

    from ..convert import CONVERTIBLE_HEAD_BYTES, convertible_kind

    # O_NONBLOCK: a FIFO must not wait for a writer; only regular files are looked at.
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fh:
        status = os.fstat(fh.fileno())
        if not stat.S_ISREG(status.st_mode):
            return None
        start = fh.read(CONVERTIBLE_HEAD_BYTES)
    if len(start) < 8:
        return None
    foreign = foreign_format(start) is not None
    kind = convertible_kind(start) if foreign else None
    if kind is not None:
        return (f"not a safetensors file: it is {kind}: convert it with "
                f"`fastst convert {shlex.quote(path)}`")
    (length,) = struct.unpack("<Q", start[:8])
    header_follows = not foreign and start[8:].lstrip(b" \t\r\n")[:1] == b"{"
    if max_header_size < length <= status.st_size - 8 and header_follows:
        return (f"header length {length} exceeds the limit of {max_header_size} bytes "
                f"(raise --max-header-size to read it)")
    return None


def explain(path: str, why: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> str:
    """`why`, the reason that the file at `path` cannot be read, or `diagnose`'s
    words for it where it has some (for a local file)."""
    try:
        if not is_checkpoint_path(path) and as_source(path).local_path is not None:
            return diagnose(path, max_header_size) or why
    except OSError:
        pass
    return why


def render_inspect(info: Dict[str, Any]) -> List[str]:
    """The human-readable report of `describe()`, one string per line."""
    lines = [f"file: {printable(info['file'])}", ""]
    headers = ["name", "dtype", "shape", "bytes", "size", "begin", "end"]
    right = [False, False, False, True, True, True, True]
    rows = [[printable(t["name"]), t["dtype"], _shape_text(t["shape"]), str(t["nbytes"]),
             human_size(t["nbytes"]), str(t["data_offsets"][0]), str(t["data_offsets"][1])]
            for t in info["tensors"]]
    if rows:
        lines += format_table(headers, rows, right)
    else:
        lines.append("(no tensors)")
    total = info["total_bytes"]
    lines += [
        "",
        f"tensors      {info['tensor_count']}",
        f"total bytes  {total} ({human_size(total)})",
        f"header       {info['header_size']} bytes (tensor data starts at byte "
        f"{info['data_start']})",
        *_aligned_line(info),
        f"file size    {info['file_size']} ({human_size(info['file_size'])})",
    ]
    metadata = info["metadata"]
    if metadata:
        lines += ["", f"metadata     {len(metadata)} {'entry' if len(metadata) == 1 else 'entries'}"]
        width = max(len(printable(key)) for key in metadata)
        for key, value in metadata.items():
            lines.append(f"  {printable(key).ljust(width)}  {printable(value)}".rstrip())
    elif metadata is not None:
        lines += ["", "metadata     0 entries"]
    return lines


def json_lines(report: Dict[str, Any]) -> List[str]:
    """A report of `describe()` (or an error report) as indented JSON, one line per
    tensor."""
    import json     # for --json only

    lines = ["{"]
    for key, value in report.items():
        if key == "tensors" and value:
            lines.append('  "tensors": [')
            lines += [f"    {json.dumps(t)}," for t in value]
            lines[-1] = lines[-1][:-1]
            lines.append("  ],")
        else:
            lines.append(f"  {json.dumps(key)}: {json.dumps(value)},")
    lines[-1] = lines[-1][:-1]
    lines.append("}")
    return lines


def inspect_file(path: str, max_header_size: int) -> Dict[str, Any]:
    """`describe()` of `path`, or ``{"file": path, "error": why}`` when it cannot be read."""
    try:
        return describe(path, max_header_size)
    except SafetensorError as error:
        message = explain(path, _without_prefix(str(error), path), max_header_size)
    except OSError as error:
        message = error.strerror or str(error)
    return {"file": as_source(path).label, "error": message}


def _without_prefix(message: str, path: str) -> str:
    prefix = f"{as_source(path).label}: "
    return message[len(prefix):] if message.startswith(prefix) else message
