"""The ``fastst`` command line: ``fastst inspect FILE...``, ``fastst verify PATH...``,
``fastst convert SRC [DST]`` and ``fastst demo``."""
from __future__ import annotations

import argparse
import json
import os
import stat
import struct
import sys
from typing import Any, Dict, List, Optional, Sequence, TextIO

from . import __version__
from ._api import safe_open
from ._handle import is_checkpoint_path, is_url
from .checkpoint import ShardedHandle, data_bytes
from ._progress import byte_bar
from ._core import DEFAULT_MAX_HEADER_SIZE, SafetensorError

PROG = "fastst"


# ---------------------------------------------------------------------------
# Formatting helpers
# ---------------------------------------------------------------------------

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


def _shown(text: str) -> str:
    """Text as one printable table cell: names with control characters are quoted."""
    return text if text.isprintable() else repr(text)


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


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


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------

def describe(path: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> Dict[str, Any]:
    """Everything `fastst inspect` reports about the file at `path`, as plain data.

    Raises SafetensorError for a malformed file and OSError when it cannot be read.
    A sharded checkpoint (a directory or an ``*.index.json``) gets
    `describe_checkpoint()`'s report. A URL (``https://``, ``s3://``, ...) is read
    by byte ranges: its header, nothing else.
    """
    if is_checkpoint_path(path):
        return describe_checkpoint(path, max_header_size)
    with safe_open(path, max_header_size=max_header_size) as reader:
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
        "file": os.fsdecode(path),
        "tensors": tensors,
        "tensor_count": len(tensors),
        "total_bytes": sum(t["nbytes"] for t in tensors),
        "header_size": data_start - 8,
        "data_start": data_start,
        "file_size": file_size,
        "metadata": metadata,
    }


def describe_checkpoint(path: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE
                        ) -> Dict[str, Any]:
    """What `fastst inspect` reports about the sharded checkpoint at `path`: every
    tensor with its shard, each shard, the totals and the index's metadata. A
    directory holding one unsharded file gets that file's `describe()`."""
    with safe_open(path, framework="np", max_header_size=max_header_size) as handle:
        if not isinstance(handle, ShardedHandle):
            return describe(handle.source, max_header_size)
        tensors = []
        for name in handle.offset_keys():
            info = handle.info(name)
            begin, end = info.data_offsets
            tensors.append({"name": name, "dtype": info.dtype, "shape": info.shape,
                            "nbytes": end - begin, "data_offsets": [begin, end],
                            "shard": os.path.basename(handle.shard_file(name))})
        shards = [{"file": shard, "tensor_count": len(names),
                   "file_size": opened.data_start + data_bytes(opened)}
                  for (shard, names), opened in zip(handle.index.shards.items(),
                                                    handle.shards())]
        return {
            "file": os.fsdecode(path),
            "index": handle.source,
            "tensors": tensors,
            "tensor_count": len(tensors),
            "total_bytes": sum(t["nbytes"] for t in tensors),
            "shards": shards,
            "file_size": sum(shard["file_size"] for shard in shards),
            "metadata": handle.metadata(),
        }


def render_checkpoint(info: Dict[str, Any]) -> List[str]:
    """The human-readable report of `describe_checkpoint()`, one string per line."""
    lines = [f"checkpoint: {_shown(info['file'])}", f"index: {_shown(info['index'])}", ""]
    rows = [[_shown(t["name"]), t["dtype"], _shape_text(t["shape"]), str(t["nbytes"]),
             human_size(t["nbytes"]), _shown(t["shard"])] for t in info["tensors"]]
    if rows:
        lines += format_table(["name", "dtype", "shape", "bytes", "size", "shard"], rows,
                              [False, False, False, True, True, False])
    else:
        lines.append("(no tensors)")
    total, size = info["total_bytes"], info["file_size"]
    lines += ["", f"tensors      {info['tensor_count']}",
              f"total bytes  {total} ({human_size(total)})",
              f"files size   {size} ({human_size(size)})",
              "", f"shards       {len(info['shards'])}"]
    lines += format_table(["  file", "tensors", "size"],
                          [["  " + _shown(shard["file"]), str(shard["tensor_count"]),
                            human_size(shard["file_size"])] for shard in info["shards"]],
                          [False, True, True])[2:]
    metadata = info["metadata"] or {}
    if metadata:
        lines += ["", "metadata"]
        width = max(len(_shown(key)) for key in metadata)
        for key, value in metadata.items():
            text = value if isinstance(value, str) else json.dumps(value)
            lines.append(f"  {_shown(key).ljust(width)}  {_shown(text)}".rstrip())
    return lines


# Leading bytes of files often passed by mistake: they are not a length prefix.
FOREIGN_MAGIC = (
    (b"\x93NUMPY", "it is a NumPy .npy file"),
    (b"PK\x03\x04", "it is a zip archive (.npz, .pt, wheel...)"),
    (b"PK\x05\x06", "it is an empty zip archive"),
    (b"\x89HDF\r\n\x1a\n", "it is an HDF5 file"),
) + tuple((b"\x80" + bytes([protocol]), "it is a Python pickle") for protocol in range(2, 6))
TEXT_BYTES = frozenset(range(0x20, 0x7F)) | frozenset(b"\t\n\r")


def diagnose(path: str, max_header_size: int = DEFAULT_MAX_HEADER_SIZE) -> Optional[str]:
    """Why the file at `path` cannot be read, when its first bytes tell more than the
    core's message: "not a safetensors file: ..." or "truncated: N bytes expected, M
    present". None when they do not.
    """
    # O_NONBLOCK: a FIFO must not wait for a writer; only regular files are looked at.
    with open(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC), "rb") as fh:
        status = os.fstat(fh.fileno())
        if not stat.S_ISREG(status.st_mode):
            return None
        size = status.st_size
        start = fh.read(16)
        if len(start) < 8:
            return None
        (length,) = struct.unpack("<Q", start[:8])
        if 8 + length > size:
            return _past_the_end(start, length, size)
        if length > max_header_size:
            return (f"header length {length} exceeds the limit of {max_header_size} bytes "
                    f"(raise --max-header-size to read it)")
        fh.seek(8)
        data_end = _claimed_data_end(fh.read(length))
    if data_end is not None and 8 + length + data_end > size:
        return f"truncated: {8 + length + data_end} bytes expected, {size} present"
    return None


def _past_the_end(start: bytes, length: int, size: int) -> str:
    """The problem with a file whose length prefix claims more bytes than it holds."""
    # A real prefix is a little-endian count whose high bytes are zero; text has none.
    if all(byte in TEXT_BYTES for byte in start[:8]):
        if start.lstrip()[:1] in (b"{", b"["):
            return ("not a safetensors file: it is JSON text (a sharded checkpoint is "
                    "inspected by its directory or its *.index.json)")
        return "not a safetensors file: it is text"
    if start[8:9] == b"{":      # a header begins there: the file was cut short
        return f"truncated: at least {8 + length} bytes expected, {size} present"
    for magic, what in FOREIGN_MAGIC:
        if start.startswith(magic):
            return f"not a safetensors file: {what}"
    return (f"not a safetensors file: its first 8 bytes give a header length of {length}, "
            f"past the end of the {size}-byte file")


def _claimed_data_end(header: bytes) -> Optional[int]:
    """The largest data offset that a header claims, or None if it is not readable."""
    import orjson

    try:
        parsed = orjson.loads(header)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(parsed, dict):
        return None
    ends = [entry["data_offsets"][1] for name, entry in parsed.items()
            if name != "__metadata__" and isinstance(entry, dict)
            and isinstance(entry.get("data_offsets"), list)
            and len(entry["data_offsets"]) == 2
            and type(entry["data_offsets"][1]) is int and entry["data_offsets"][1] >= 0]
    return max(ends, default=None)


def render_inspect(info: Dict[str, Any]) -> List[str]:
    """The human-readable report of `describe()`, one string per line."""
    lines = [f"file: {_shown(info['file'])}", ""]
    headers = ["name", "dtype", "shape", "bytes", "size", "begin", "end"]
    right = [False, False, False, True, True, True, True]
    rows = [[_shown(t["name"]), t["dtype"], _shape_text(t["shape"]), str(t["nbytes"]),
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
        f"file size    {info['file_size']} ({human_size(info['file_size'])})",
    ]
    metadata = info["metadata"]
    if metadata:
        lines += ["", f"metadata     {len(metadata)} {'entry' if len(metadata) == 1 else 'entries'}"]
        width = max(len(_shown(key)) for key in metadata)
        for key, value in metadata.items():
            lines.append(f"  {_shown(key).ljust(width)}  {_shown(value)}".rstrip())
    elif metadata is not None:
        lines += ["", "metadata     0 entries"]
    return lines


def json_lines(report: Dict[str, Any]) -> List[str]:
    """A report of `describe()` (or an error report) as indented JSON, one line per
    tensor."""
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
        message = str(error)
        try:
            if not is_checkpoint_path(path) and not is_url(path):
                message = diagnose(path, max_header_size) or message
        except OSError:
            pass
    except OSError as error:
        message = error.strerror or str(error)
    prefix = f"{os.fsdecode(path)}: "
    return {"file": os.fsdecode(path),
            "error": message[len(prefix):] if message.startswith(prefix) else message}


def _cmd_inspect(args: argparse.Namespace, out: TextIO) -> int:
    reports = [inspect_file(path, args.max_header_size) for path in args.files]
    if args.json:
        lines = json_lines(reports[0]) if len(reports) == 1 else _json_list(reports)
        out.write("\n".join(lines) + "\n")
    else:
        _write_text_reports(reports, out)
    return 1 if any("error" in report for report in reports) else 0


def _json_list(reports: Sequence[Dict[str, Any]]) -> List[str]:
    lines = ["["]
    for report in reports:
        lines += ["  " + line for line in json_lines(report)]
        lines[-1] += ","
    lines[-1] = lines[-1][:-1]
    return lines + ["]"]


def _write_text_reports(reports: Sequence[Dict[str, Any]], out: TextIO) -> None:
    """Reports to `out`, a blank line apart; errors to stderr, in the same order."""
    first = True
    for report in reports:
        if "error" in report:
            out.flush()
            _print_error(f"{report['file']}: {report['error']}")
            continue
        lines = render_checkpoint(report) if "index" in report else render_inspect(report)
        out.write(("" if first else "\n") + "\n".join(lines) + "\n")
        first = False


# ---------------------------------------------------------------------------
# Entry point
# ---------------------------------------------------------------------------

def _positive_size(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (0 < value <= 16384):
        raise argparse.ArgumentTypeError(f"must be above 0 and at most 16384, got {text}")
    return value


def _header_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if not 0 <= value < 2**64:
        raise argparse.ArgumentTypeError(f"must be from 0 to 2**64-1, got {text}")
    return value


def _add_max_header_size(command: argparse.ArgumentParser) -> None:
    command.add_argument("--max-header-size", type=_header_limit,
                         default=DEFAULT_MAX_HEADER_SIZE, metavar="BYTES",
                         help="the largest header accepted, in bytes "
                              f"(default: {DEFAULT_MAX_HEADER_SIZE:,})")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description="Fast, strict, zero-copy safetensors for NumPy.")
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    inspect = commands.add_parser(
        "inspect", help="list the tensors, offsets and metadata of .safetensors files",
        description="List every tensor of each safetensors file in buffer order, with its "
                    "dtype, shape, size and data offsets, then totals and metadata. A file "
                    "that cannot be read is reported and the others still are; the exit "
                    "status is 1 if any could not be read.")
    inspect.add_argument("files", nargs="+", metavar="FILE",
                         help="a .safetensors file, or a sharded checkpoint: its directory "
                              "or its .index.json; or the URL of either (https://, s3://, "
                              "...: only the headers are read)")
    inspect.add_argument("--json", action="store_true",
                         help="print each report as JSON: one object for one FILE, a list "
                              "of them for several; a file that cannot be read gives "
                              '{"file": FILE, "error": WHY}')
    _add_max_header_size(inspect)

    verify = commands.add_parser(
        "verify", help="check the structure and checksums of .safetensors files or folders",
        description="Check each file's structure and, when it has them, every tensor's "
                    "checksum; for a folder, each .safetensors file in it and each "
                    "*.index.json against its shards; for a sharded checkpoint's "
                    "*.index.json, the shards it names and the index against them. A "
                    "corrupt tensor is named, and so is a tensor that the file's checksums "
                    "leave out. The exit status is 0 when everything checks out, 1 "
                    "otherwise; a file without checksums has its structure checked and "
                    "says so.")
    verify.add_argument("paths", nargs="+", metavar="PATH",
                        help="a .safetensors file, or a folder of them (sharded "
                             "checkpoint), or a checkpoint's *.index.json, or the URL of a "
                             "file or of an index")
    verify.add_argument("--json", action="store_true",
                        help="print the reports as a JSON list, one object per PATH")
    _add_max_header_size(verify)

    _add_convert(commands)

    demo = commands.add_parser(
        "demo", help="save, open and time a sample checkpoint against pickle and np.savez",
        description="Build a sample transformer-shaped checkpoint in NumPy, save it with "
                    "fastst, open it zero-copy, show what is in it and time fastst "
                    "against pickle and np.savez.")
    demo.add_argument("--size-mb", type=_positive_size, default=64.0, metavar="N",
                      help="approximate checkpoint size in MiB (default: 64)")
    demo.add_argument("--dir", metavar="DIR", default=None,
                      help="write the checkpoint to DIR/demo.safetensors and keep it "
                           "(default: a temporary folder, removed afterwards)")
    return parser


def _cmd_demo(args: argparse.Namespace, out: TextIO) -> int:
    if args.dir is not None and not os.path.isdir(args.dir):
        return _print_error(f"--dir {args.dir}: not a directory")
    from ._demo import run_demo     # imported on use: it imports what inspect does not need

    return run_demo(args.size_mb, args.dir, out)


def _cmd_verify(args: argparse.Namespace, out: TextIO) -> int:
    from .integrity import report_lines, verify_path   # imported on use

    reports = [verify_path(path, max_header_size=args.max_header_size, progress=not args.json)
               for path in args.paths]
    if args.json:
        out.write(json.dumps(reports, indent=2) + "\n")
    else:
        out.write("".join(line + "\n" for report in reports for line in report_lines(report)))
    return 0 if all(report["ok"] for report in reports) else 1


# ---------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------

def _add_convert(commands: Any) -> None:
    from .convert import DEFAULT_MAX_EXPANSION     # light: numpy and the writer, loaded already
    convert = commands.add_parser(
        "convert", help="convert PyTorch checkpoints and .npy/.npz files to safetensors",
        description="Convert a torch.save checkpoint (.bin, .pt, .pth: zip or legacy "
                    "format) or a .npy/.npz file to safetensors, without torch and without "
                    "running the checkpoint's pickle. A directory converts every checkpoint "
                    "in it (a sharded pytorch_model.bin.index.json keeps its split) and "
                    "copies the other files. No dtype is cast. Exit status: 0 when every "
                    "file converted, 1 when one could not be, 2 for a usage error.")
    convert.add_argument("src", metavar="SRC", help="a checkpoint file or a directory")
    convert.add_argument("dst", metavar="DST", nargs="?", default=None,
                         help="the output file or directory (default: beside SRC, "
                              "pytorch_model.bin -> model.safetensors)")
    convert.add_argument("--key", default=None,
                         help="convert only this entry of a nested checkpoint "
                              "(state_dict, model; a/b for deeper ones)")
    convert.add_argument("--max-shard-size", type=_shard_size, default=None, metavar="SIZE",
                         help="split the output into files of at most SIZE (bytes, or 5GB, "
                              "500MB) with an index.json")
    convert.add_argument("--verify", action="store_true",
                         help="also compare every tensor with torch.load(weights_only=True) "
                              "(needs torch)")
    convert.add_argument("--max-expansion", type=_expansion, default=DEFAULT_MAX_EXPANSION,
                         metavar="RATIO",
                         help="refuse to write more than RATIO times the bytes of the input, "
                              "plus 16 MiB (default: %(default)g; 'none': no bound): a small "
                              "checkpoint can describe a huge tensor")
    convert.add_argument("--no-progress", action="store_true",
                         help="no progress bar (it is shown when stderr is a terminal)")


def _expansion(text: str) -> Optional[float]:
    if text.lower() == "none":
        return None
    try:
        ratio = float(text)
    except ValueError:
        ratio = float("nan")
    if not 0 < ratio < float("inf"):
        raise argparse.ArgumentTypeError(f"a positive number or 'none', not {text!r}")
    return ratio


def _shard_size(text: str) -> int:
    from .checkpoint import parse_size

    try:
        return parse_size(int(text) if text.isdigit() else text)
    except SafetensorError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _cmd_convert(args: argparse.Namespace, out: TextIO) -> int:
    from . import convert as converter   # imported on use

    options: Dict[str, Any] = {"key": args.key, "verify_torch": args.verify,
                               "max_shard_size": args.max_shard_size,
                               "max_expansion": args.max_expansion}
    bar = None if args.no_progress else byte_bar(_source_bytes(args.src), "convert")
    if bar is not None:
        options["progress"] = bar.update
    try:
        reports = converter.convert(args.src, args.dst, **options)
    finally:
        if bar is not None:
            bar.close()
    rows = [[_files_cell(r.files), str(r.tensors), human_size(r.bytes), str(len(r.dropped)),
             f"{r.seconds:.2f} s"] for r in reports]
    lines = format_table(["file", "tensors", "bytes", "shared dropped", "time"], rows,
                         [False, True, True, True, True])
    total = sum(r.bytes for r in reports)
    lines.append(f"{len(reports)} file(s), {sum(r.tensors for r in reports)} tensors, "
                 f"{human_size(total)}, verified")
    out.write("\n".join(lines) + "\n")
    return 0


def _files_cell(files: Sequence[str]) -> str:
    names = [_shown(os.path.basename(name)) for name in files]
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} ... {names[-1]} ({len(names)} files)"


def _source_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    return os.stat(path).st_size


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``fastst`` command line; returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:     # --help, --version and usage errors
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    command = {"inspect": _cmd_inspect, "verify": _cmd_verify, "convert": _cmd_convert,
               "demo": _cmd_demo}[args.command]
    try:
        return command(args, sys.stdout)
    except SafetensorError as error:
        return _print_error(str(error))
    except BrokenPipeError:
        # The reader of our output went away (`fastst inspect f | head`).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
        return 1
    except OSError as error:
        if error.filename is not None and error.strerror:
            return _print_error(f"{os.fsdecode(error.filename)}: {error.strerror}")
        return _print_error(str(error))


def _print_error(message: str) -> int:
    """`message` as one line on stderr; returns the exit status 1."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
