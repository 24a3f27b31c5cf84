"""The ``fastst`` command line: ``fastst inspect FILE...``, ``fastst verify PATH...``,
``fastst convert SRC [DST]`` and ``fastst demo``."""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, TextIO, Union

from ._core import DEFAULT_MAX_HEADER_SIZE, SafetensorError, plan_write
from ._io.limits import DEFAULT_MAX_EXPANSION
from ._tools.inspect import (explain, format_table, human_size, inspect_file, json_lines, printable,
                             render_checkpoint, render_inspect)
from ._version import __version__

if TYPE_CHECKING:   # argparse is imported where a command line needs it (see _parse)
    import argparse

    # what a command runs with: argparse's, or the one a plain `fastst inspect FILE...` makes
    Namespace = Union[argparse.Namespace, SimpleNamespace]

PROG = "fastst"


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------

def _cmd_inspect(args: Namespace, out: TextIO) -> int:
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

def _invalid(message: str) -> Exception:
    """The error a converter of an argument raises: argparse prints `message` as
    the argument's."""
    import argparse

    return argparse.ArgumentTypeError(message)


def _positive_size(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise _invalid(f"not a number: {text!r}") from None
    if not (0 < value <= 16384):
        raise _invalid(f"must be above 0 and at most 16384, got {text}")
    return value


def _header_limit(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _invalid(f"not an integer: {text!r}") from None
    if not 0 <= value < 2**64:
        raise _invalid(f"must be from 0 to 2**64-1, got {text}")
    return value


def _add_max_header_size(command: argparse.ArgumentParser) -> None:
    command.add_argument("--max-header-size", type=_header_limit,
                         default=DEFAULT_MAX_HEADER_SIZE, metavar="BYTES",
                         help="the largest header accepted, in bytes "
                              f"(default: {DEFAULT_MAX_HEADER_SIZE:,})")


def _formatter(prog: str) -> argparse.HelpFormatter:
    """argparse's formatter, given the terminal's width: left to find it, argparse
    imports shutil, and shutil zlib, bz2 and lzma, 2.8 ms of every run (each
    ``add_argument`` makes a formatter, to check its metavar)."""
    import argparse

    return argparse.HelpFormatter(prog, width=_terminal_columns() - 2)


def _terminal_columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size`` finds it: ``COLUMNS``,
    else the width of the terminal on stdout, else 80."""
    try:
        columns = int(os.environ["COLUMNS"])
    except (KeyError, ValueError):
        columns = 0
    if columns > 0:
        return columns
    stdout = sys.__stdout__
    if stdout is None:
        return 80
    try:
        return os.get_terminal_size(stdout.fileno()).columns or 80
    except (ValueError, OSError):   # closed, or not a terminal
        return 80


def build_parser() -> argparse.ArgumentParser:
    """The whole command line's parser, every command's arguments included."""
    import argparse

    parser = argparse.ArgumentParser(
        prog=PROG, description="Fast, strict, zero-copy safetensors for NumPy.",
        formatter_class=_formatter)
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, command in COMMANDS.items():
        command.add_arguments(commands.add_parser(name, help=command.summary,
                                                  description=command.description,
                                                  formatter_class=_formatter))
    return parser


def _command_parser(name: str) -> argparse.ArgumentParser:
    """The parser of one command, as `build_parser` makes it (``fastst NAME``): a run
    builds only the parser of the command it runs, a millisecond each saved."""
    import argparse

    command = COMMANDS[name]
    parser = argparse.ArgumentParser(prog=f"{PROG} {name}", description=command.description,
                                     formatter_class=_formatter)
    command.add_arguments(parser)
    return parser


def _add_inspect_arguments(inspect: argparse.ArgumentParser) -> None:
    inspect.add_argument("files", nargs="+", metavar="FILE",
                         help="a .safetensors file, or a sharded checkpoint: its directory "
                              "or its .index.json; or the URL of either (https://, s3://, "
                              "...: only the headers are read)")
    inspect.add_argument("--json", action="store_true",
                         help="print each report as JSON: one object for one FILE, a list "
                              "of them for several; a file that cannot be read gives "
                              '{"file": FILE, "error": WHY}')
    _add_max_header_size(inspect)


def _add_verify_arguments(verify: argparse.ArgumentParser) -> None:
    verify.add_argument("paths", nargs="+", metavar="PATH",
                        help="a .safetensors file, or a folder of them (sharded "
                             "checkpoint), or a checkpoint's *.index.json, or the URL of a "
                             "file or of an index")
    verify.add_argument("--json", action="store_true",
                        help="print the reports as a JSON list, one object per PATH")
    _add_no_progress(verify)
    _add_max_header_size(verify)


def _add_demo_arguments(demo: argparse.ArgumentParser) -> None:
    demo.add_argument("--size-mb", type=_positive_size, default=64.0, metavar="N",
                      help="approximate checkpoint size in MiB (default: 64)")
    demo.add_argument("--dir", metavar="DIR", default=None,
                      help="write the checkpoint to DIR/demo.safetensors and keep it "
                           "(default: a temporary folder, removed afterwards)")


def _cmd_demo(args: Namespace, out: TextIO) -> int:
    if args.dir is not None and not os.path.isdir(args.dir):
        return _print_error(f"--dir {args.dir}: not a directory")
    from ._tools.demo import run_demo     # imported on use: it imports what inspect does not need

    return run_demo(args.size_mb, args.dir, out)


def _cmd_verify(args: Namespace, out: TextIO) -> int:
    from .integrity import report_lines, verify_path   # imported on use

    progress = not (args.json or args.no_progress)
    reports = [verify_path(path, max_header_size=args.max_header_size, progress=progress)
               for path in args.paths]
    _explain_unread_files(reports, args.max_header_size)
    if args.json:
        import json

        out.write(json.dumps(reports, indent=2) + "\n")
    else:
        out.write("".join(line + "\n" for report in reports for line in report_lines(report)))
    return 0 if all(report["ok"] for report in reports) else 1


def _explain_unread_files(reports: Sequence[Dict[str, Any]], max_header_size: int) -> None:
    """Put why each file that could not be read was not, in inspect's words."""
    for file in (file for report in reports for file in report["files"]):
        for error in file["errors"]:
            if error["tensor"] is None:     # the file's own error
                error["error"] = explain(file["file"], error["error"], max_header_size)


# ---------------------------------------------------------------------------
# convert
# ---------------------------------------------------------------------------

def _add_convert_arguments(convert: argparse.ArgumentParser) -> None:
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
    convert.add_argument("--align", type=_alignment, default=None, metavar="N",
                         help="start the data, and as many tensors as can, at multiples of "
                              "N bytes (a power of two up to 1048576; 4096 for direct I/O)")
    _add_no_progress(convert)


def _add_no_progress(command: argparse.ArgumentParser) -> None:
    command.add_argument("--no-progress", action="store_true",
                         help="no progress bar (one is drawn on stderr when it is a terminal "
                              "and the work is 64 MiB or more; never in a pipe)")


def _expansion(text: str) -> Optional[float]:
    if text.lower() == "none":
        return None
    try:
        ratio = float(text)
    except ValueError:
        ratio = float("nan")
    if not 0 < ratio < float("inf"):
        raise _invalid(f"a positive number or 'none', not {text!r}")
    return ratio


def _alignment(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise _invalid(f"an integer, not {text!r}") from None
    try:
        plan_write([], None, align=value)     # the writers' own rule for alignments
    except SafetensorError as error:
        raise _invalid(str(error)) from None
    return value


def _shard_size(text: str) -> int:
    from .checkpoint import parse_size

    try:
        return parse_size(int(text) if text.isdigit() else text)
    except SafetensorError as error:
        raise _invalid(str(error)) from None


def _cmd_convert(args: Namespace, out: TextIO) -> int:
    from . import convert as converter   # imported on use

    options: Dict[str, Any] = {"key": args.key, "verify_torch": args.verify,
                               "max_shard_size": args.max_shard_size,
                               "max_expansion": args.max_expansion, "align": args.align}
    # each byte is written, read back and compared, and with --verify compared with torch's
    passes = 3 if args.verify else 2
    from ._io.progress import byte_bar

    bar = None if args.no_progress else byte_bar(_source_bytes(args.src) * passes, "reading")
    if bar is not None:
        options.update(progress=bar.update, on_phase=bar.phase)
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
    out.flush()
    sys.stderr.write("".join(f"{PROG}: note: {note}\n" for r in reports for note in r.notes))
    return 0


def _files_cell(files: Sequence[str]) -> str:
    names = [printable(os.path.basename(name)) for name in files]
    if len(names) <= 2:
        return ", ".join(names)
    return f"{names[0]} ... {names[-1]} ({len(names)} files)"


def _source_bytes(path: str) -> int:
    if os.path.isdir(path):
        return sum(entry.stat().st_size for entry in os.scandir(path) if entry.is_file())
    return os.stat(path).st_size


class Command:
    """One command of the command line: its line in ``fastst --help``, what ``fastst
    NAME --help`` says it does, what adds its arguments to a parser and what runs it.
    (A plain class: a named tuple type costs every run 0.2 ms to make.)"""
    __slots__ = ("summary", "description", "add_arguments", "run")

    def __init__(self, summary: str, description: str,
                 add_arguments: Callable[[argparse.ArgumentParser], None],
                 run: Callable[[Namespace, TextIO], int]) -> None:
        self.summary = summary
        self.description = description
        self.add_arguments = add_arguments
        self.run = run


COMMANDS = {
    "inspect": Command(
        "list the tensors, offsets and metadata of .safetensors files",
        "List every tensor of each safetensors file in buffer order, with its "
        "dtype, shape, size and data offsets, then totals and metadata. A file "
        "that cannot be read is reported and the others still are; the exit "
        "status is 1 if any could not be read.",
        _add_inspect_arguments, _cmd_inspect),
    "verify": Command(
        "check the structure and checksums of .safetensors files or folders",
        "Check each file's structure and, when it has them, every tensor's "
        "checksum; for a folder, each .safetensors file in it and each "
        "*.index.json against its shards; for a sharded checkpoint's "
        "*.index.json, the shards it names and the index against them. A "
        "corrupt tensor is named, and so is a tensor that the file's checksums "
        "leave out. The exit status is 0 when everything checks out, 1 "
        "otherwise; a file without checksums has its structure checked and "
        "says so.",
        _add_verify_arguments, _cmd_verify),
    "convert": Command(
        "convert PyTorch checkpoints and .npy/.npz files to safetensors",
        "Convert a torch.save checkpoint (.bin, .pt, .pth: zip or legacy "
        "format) or a .npy/.npz file to safetensors, without torch and without "
        "running the checkpoint's pickle. A directory converts every checkpoint "
        "in it (a sharded pytorch_model.bin.index.json keeps its split) and "
        "copies the other files. No dtype is cast. Exit status: 0 when every "
        "file converted, 1 when one could not be or when there is nothing to "
        "convert (a .safetensors file, a folder without a checkpoint), 2 for a "
        "usage error.",
        _add_convert_arguments, _cmd_convert),
    "demo": Command(
        "a tour of fastst on a sample checkpoint, timed against pickle and "
        "np.savez",
        "Build a sample transformer-shaped checkpoint in NumPy, save it with "
        "fastst, and show in a line each, with its figures, what fastst does "
        "that the reference does not: zero-copy opening, atomic and sharded "
        "saves, checksums and verify, conversion, object stores (with fsspec), "
        "the streaming writer and row gathers; then time fastst against pickle "
        "and np.savez. A few seconds, no network. The exit status is 1 when a "
        "step did not hold.",
        _add_demo_arguments, _cmd_demo),
}


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``fastst`` command line; returns the exit status."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = _parse(argv)
    except SystemExit as exit_:     # --help, --version and usage errors
        code = exit_.code
        return code if isinstance(code, int) else (0 if code is None else 2)
    command = COMMANDS[args.command].run
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


def _parse(argv: List[str]) -> Namespace:
    """`argv` parsed by its command's parser alone where that is enough; by the whole
    command line's (the same parsers, the same messages) otherwise. A plain
    ``fastst inspect FILE...`` needs no parser: argparse, with the gettext and locale
    it imports, would take 4 ms, more than inspecting a small file."""
    if len(argv) > 1 and argv[0] == "inspect" and not any(arg.startswith("-") for arg in argv):
        return _plain_inspect(argv[1:])
    if argv and argv[0] in COMMANDS:
        args, unknown = _command_parser(argv[0]).parse_known_args(argv[1:])
        if not unknown:
            args.command = argv[0]
            return args
    return build_parser().parse_args(argv)


def _plain_inspect(files: List[str]) -> SimpleNamespace:
    """What inspect's parser makes of ``fastst inspect FILE...`` (a test holds them
    equal)."""
    return SimpleNamespace(command="inspect", files=files, json=False,
                           max_header_size=DEFAULT_MAX_HEADER_SIZE)


def _print_error(message: str) -> int:
    """`message` as one line on stderr; returns the exit status 1."""
    sys.stderr.write(f"{PROG}: error: {message}\n")
    return 1


if __name__ == "__main__":
    sys.exit(main())
