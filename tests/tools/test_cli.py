"""The ``fastst`` command line: ``inspect``, ``demo`` and ``--version``."""
import json
import os
import pickle
import re
import struct
import subprocess
import sys
import tempfile
import zipfile

import ml_dtypes
import numpy as np
import pytest

import fastst
from fastst import cli
from fastst._tools import demo as _demo
from fastst._tools import inspect as _inspect
from helpers import raw_file


def _sample(tmp_path):
    path = tmp_path / "model.safetensors"
    tensors = {
        "weight": np.arange(6, dtype=np.float32).reshape(2, 3),
        "bias": np.ones(3, dtype=np.float32),
        "big": np.zeros((32, 64), dtype=np.float32),
        "h": np.ones(4, dtype=ml_dtypes.bfloat16),
        "q": np.ones((2, 4), dtype=ml_dtypes.float8_e4m3fn),
        "step": np.array(7, dtype=np.int64),
    }
    fastst.save_file(tensors, path, metadata={"format": "np", "author": "tests"})
    return path


def _header_size(path):
    with open(path, "rb") as fh:
        return struct.unpack("<Q", fh.read(8))[0]


SAMPLE_BEGINS = [0, 8, 20, 8212, 8236, 8244]


def _aligned(path):
    """How many of the sample's tensors start at multiples of 64, 256 and 4096."""
    data_start = 8 + _header_size(path)
    return {str(n): sum((data_start + begin) % n == 0 for begin in SAMPLE_BEGINS)
            for n in (64, 256, 4096)}


def _expected_lines(path):
    n = _header_size(path)
    size = os.path.getsize(path)
    assert size == 8 + n + 8252
    aligned = _aligned(path)
    return [
        f"file: {path}",
        "",
        "name    dtype    shape     bytes     size  begin   end",
        "------  -------  --------  -----  -------  -----  ----",
        "step    I64      []            8      8 B      0     8",
        "bias    F32      [3]          12     12 B      8    20",
        "big     F32      [32, 64]   8192  8.0 KiB     20  8212",
        "weight  F32      [2, 3]       24     24 B   8212  8236",
        "h       BF16     [4]           8      8 B   8236  8244",
        "q       F8_E4M3  [2, 4]        8      8 B   8244  8252",
        "",
        "tensors      6",
        "total bytes  8252 (8.1 KiB)",
        f"header       {n} bytes (tensor data starts at byte {n + 8})",
        f"aligned      {aligned['64']}/6 at 64 B, {aligned['256']}/6 at 256 B, "
        f"{aligned['4096']}/6 at 4.0 KiB (tensors starting at multiples of it)",
        f"file size    {size} ({_inspect.human_size(size)})",
        "",
        "metadata     2 entries",
        "  author  tests",
        "  format  np",
    ]


def _expected_json(path):
    n = _header_size(path)
    return {
        "file": str(path),
        "tensors": [
            {"name": "step", "dtype": "I64", "shape": [], "nbytes": 8, "data_offsets": [0, 8]},
            {"name": "bias", "dtype": "F32", "shape": [3], "nbytes": 12,
             "data_offsets": [8, 20]},
            {"name": "big", "dtype": "F32", "shape": [32, 64], "nbytes": 8192,
             "data_offsets": [20, 8212]},
            {"name": "weight", "dtype": "F32", "shape": [2, 3], "nbytes": 24,
             "data_offsets": [8212, 8236]},
            {"name": "h", "dtype": "BF16", "shape": [4], "nbytes": 8,
             "data_offsets": [8236, 8244]},
            {"name": "q", "dtype": "F8_E4M3", "shape": [2, 4], "nbytes": 8,
             "data_offsets": [8244, 8252]},
        ],
        "tensor_count": 6,
        "total_bytes": 8252,
        "header_size": n,
        "data_start": n + 8,
        "aligned": _aligned(path),
        "file_size": os.path.getsize(path),
        "metadata": {"author": "tests", "format": "np"},
    }


def _write(path, data):
    path.write_bytes(data)
    return path


def _run_module(cwd, *args):
    """`python -m fastst ARGS` in a fresh interpreter that imports this same fastst."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastst.__file__)))
    env = dict(os.environ)
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    # cwd: `-m` puts the working directory first on sys.path; a neutral one keeps a
    # checkout without a built core from shadowing the package under test.
    return subprocess.run([sys.executable, "-m", "fastst", *args], capture_output=True,
                          text=True, env=env, cwd=str(cwd), timeout=120)


# ---------------------------------------------------------------------------
# inspect
# ---------------------------------------------------------------------------

def test_inspect_table_is_exact(tmp_path, capsys):
    path = _sample(tmp_path)
    assert cli.main(["inspect", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert captured.out.splitlines() == _expected_lines(path)
    assert captured.out.endswith("\n")


def test_inspect_json_is_exact(tmp_path, capsys):
    path = _sample(tmp_path)
    assert cli.main(["inspect", "--json", str(path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    assert json.loads(captured.out) == _expected_json(path)


def test_inspect_json_agrees_with_the_reader(tmp_path, capsys):
    path = _sample(tmp_path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    with fastst.safe_open(path, framework="np") as f:
        assert [t["name"] for t in report["tensors"]] == f.offset_keys()
        assert sorted(t["name"] for t in report["tensors"]) == f.keys()
        for t in report["tensors"]:
            array = f.get_tensor(t["name"])
            assert list(array.shape) == t["shape"]
            assert array.nbytes == t["nbytes"]
        assert report["metadata"] == f.metadata()


def test_inspect_without_metadata_prints_no_metadata_section(tmp_path, capsys):
    path = tmp_path / "plain.safetensors"
    fastst.save_file({"x": np.zeros(2, dtype=np.uint8)}, path)
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert not any(line.startswith("metadata") for line in out.splitlines())
    assert out.splitlines()[-1].startswith("file size    ")
    assert cli.main(["inspect", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["metadata"] is None


def test_inspect_empty_metadata_and_no_tensors(tmp_path, capsys):
    path = tmp_path / "empty.safetensors"
    fastst.save_file({}, path, metadata={})
    assert cli.main(["inspect", str(path)]) == 0
    n = _header_size(path)
    assert capsys.readouterr().out.splitlines() == [
        f"file: {path}",
        "",
        "(no tensors)",
        "",
        "tensors      0",
        "total bytes  0 (0 B)",
        f"header       {n} bytes (tensor data starts at byte {n + 8})",
        f"file size    {n + 8} ({n + 8} B)",
        "",
        "metadata     0 entries",
    ]
    assert cli.main(["inspect", "--json", str(path)]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["tensors"] == [] and report["metadata"] == {}


def test_inspect_shows_header_shape_of_packed_sub_byte_tensors(tmp_path, capsys):
    # F4: 6 elements of 4 bits in 3 bytes. The report gives the header's shape, not
    # the packed uint8 shape the array surfaces as.
    path = _write(tmp_path / "f4.safetensors",
                  raw_file({"x": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}},
                           b"\x01\x02\x03"))
    assert cli.main(["inspect", "--json", str(path)]) == 0
    (entry,) = json.loads(capsys.readouterr().out)["tensors"]
    assert entry == {"name": "x", "dtype": "F4", "shape": [2, 3], "nbytes": 3,
                     "data_offsets": [0, 3]}


def test_inspect_quotes_names_with_control_characters(tmp_path, capsys):
    path = tmp_path / "odd.safetensors"
    fastst.save_file({"a\nb": np.zeros(1, dtype=np.int8)}, path, metadata={"k": "x\ty"})
    assert cli.main(["inspect", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[4].startswith("'a\\nb'  I8 ")
    assert lines[-1] == "  k  'x\\ty'"
    assert cli.main(["inspect", "--json", str(path)]) == 0
    assert json.loads(capsys.readouterr().out)["tensors"][0]["name"] == "a\nb"


@pytest.mark.parametrize("data", [
    pytest.param(b"abc", id="shorter-than-prefix"),
    pytest.param(raw_file(b"not json", align=1), id="not-json"),
    pytest.param(raw_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4],
                                 "extra": 1}}, b"\0" * 4), id="extra-field"),
    pytest.param(raw_file('{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
                          '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"),
                 id="duplicate-key"),
    pytest.param(raw_file('{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
                 id="negative-zero"),
    pytest.param(raw_file({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}},
                          b"\0" * 6), id="trailing-bytes"),
])
def test_inspect_malformed_file_is_one_line_error(tmp_path, capsys, data):
    path = _write(tmp_path / "bad.safetensors", data)
    with pytest.raises(fastst.SafetensorError) as raised:
        fastst.safe_open(path, framework="np")
    assert cli.main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fastst: error: {raised.value}\n"
    assert str(raised.value).startswith(str(path))


def _zip_file(path):
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("pkg-1.0.dist-info/METADATA", "Name: pkg\n")
    return path


def _npy_file(path):
    with open(path, "wb") as out:
        np.save(out, np.arange(4))
    return path


@pytest.mark.parametrize("make,what", [
    (lambda p: _write(p, b'{\n  "metadata": {"total_size": 8},\n  "weight_map": '
                         b'{"x": "model-00001-of-00002.safetensors"}\n}\n'), "JSON text"),
    (lambda p: _write(p, b'[{"a": 1}]'), "JSON text"),
    (lambda p: _write(p, b"  {\"weight_map\": {}}"), "JSON text"),
    (_npy_file, "a NumPy .npy file"),
    (_zip_file, "a zip archive"),
    (lambda p: _write(p, pickle.dumps({"x": list(range(100))})), "a Python pickle"),
    (lambda p: _write(p, b"hello, these are not tensors\n"), "text"),
    (lambda p: _write(p, b"\xff" * 8 + b"\0" * 32), "header length of 18446744073709551615"),
])
def test_inspect_says_a_file_is_not_a_safetensors_file(tmp_path, capsys, make, what):
    path = make(tmp_path / "file")
    assert cli.main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith(f"fastst: error: {path}: not a safetensors file: it")
    assert what in captured.err and "max_header_size" not in captured.err
    assert len(captured.err.splitlines()) == 1


def _same_message_everywhere(path, capsys):
    """The message of `path`'s error from safe_open, checked to be the one that
    inspect and verify print."""
    with pytest.raises(fastst.SafetensorError) as raised:
        fastst.safe_open(path)
    message = str(raised.value)
    assert cli.main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == f"fastst: error: {message}\n"
    assert cli.main(["verify", str(path)]) == 1
    assert capsys.readouterr().out == f"{path}: FAILED\n  {message}\n"
    return message


def test_a_truncated_file_gets_one_message_from_inspect_verify_and_safe_open(tmp_path, capsys):
    whole = fastst.save({"x": np.zeros(100, np.float32), "y": np.ones(3, np.int8)})
    path = _write(tmp_path / "cut.safetensors", whole[:-50])
    assert _same_message_everywhere(path, capsys) == (
        f"{path}: the file is truncated: its header describes {len(whole)} bytes, the file "
        f"holds {len(whole) - 50} (tensor 'x', at data_offsets [0, 400], is the first cut off)")


def test_a_header_cut_short_gets_one_message_from_inspect_verify_and_safe_open(
        tmp_path, capsys):
    whole = fastst.save({"x": np.zeros(4, np.uint8)})
    path = _write(tmp_path / "cut.safetensors", whole[:20])
    (length,) = struct.unpack("<Q", whole[:8])
    assert _same_message_everywhere(path, capsys) == (
        f"{path}: the file is truncated: its header describes at least {8 + length} bytes, "
        f"the file holds 20")


@pytest.mark.parametrize("length,looks_like", [(0x7B, b"{"), (0x480, b"\x80\x04")],
                         ids=["json-brace", "pickle-magic"])
def test_a_length_prefix_that_looks_like_another_format_is_read_as_a_length(
        tmp_path, capsys, length, looks_like):
    header = b'{"x":{"dtype":"U8","shape":[16],"data_offsets":[0,16]}}'
    header += b" " * (length - len(header))
    data = raw_file(header, bytes(16), align=1)
    assert data.startswith(looks_like)
    path = _write(tmp_path / "odd.safetensors", data)
    assert cli.main(["inspect", str(path)]) == 0
    capsys.readouterr()
    _write(path, data[:-4])
    assert cli.main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == (
        f"fastst: error: {path}: the file is truncated: its header describes {len(data)} "
        f"bytes, the file holds {len(data) - 4} (tensor 'x', at data_offsets [0, 16], is the "
        f"first cut off)\n")
    _write(path, data[:40])
    assert cli.main(["inspect", str(path)]) == 1
    assert capsys.readouterr().err == (
        f"fastst: error: {path}: the file is truncated: its header describes at least "
        f"{8 + length} bytes, the file holds 40\n")


def test_max_header_size_option(tmp_path, capsys):
    path = _sample(tmp_path)
    n = _header_size(path)
    assert cli.main(["inspect", "--max-header-size", str(n), str(path)]) == 0
    assert capsys.readouterr().out.splitlines() == _expected_lines(path)
    assert cli.main(["inspect", "--max-header-size", str(n - 1), str(path)]) == 1
    assert capsys.readouterr().err == (
        f"fastst: error: {path}: header length {n} exceeds the limit of {n - 1} bytes "
        f"(raise --max-header-size to read it)\n")
    for bad in ("-1", "lots", str(2**64)):
        assert cli.main(["inspect", "--max-header-size", bad, str(path)]) == 2
        assert "--max-header-size" in capsys.readouterr().err


def test_inspect_several_files_reports_each_and_fails_if_any_failed(tmp_path, capsys):
    good = _sample(tmp_path)
    other = tmp_path / "other.safetensors"
    fastst.save_file({"x": np.zeros(2, dtype=np.uint8)}, other)
    missing = tmp_path / "missing.safetensors"
    index = _write(tmp_path / "config.json", b'{"weight_map": {}}')
    assert cli.main(["inspect", str(good), str(missing), str(other), str(index)]) == 1
    captured = capsys.readouterr()
    assert captured.out.split("\n\nfile: ")[0].splitlines() == _expected_lines(good)
    assert f"file: {other}" in captured.out.splitlines()
    assert captured.err.splitlines() == [
        f"fastst: error: {missing}: No such file or directory",
        f"fastst: error: {index}: not a safetensors file: it is JSON text (a sharded "
        f"checkpoint is opened by its directory or its *.index.json)",
    ]
    assert cli.main(["inspect", str(good), str(other)]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.count("\nfile: ") == 1


def test_inspect_json_reports_errors_as_json(tmp_path, capsys):
    good = _sample(tmp_path)
    bad = _write(tmp_path / "weights.npy", b"\x93NUMPY\x01\x00v\x00" + b" " * 118)
    assert cli.main(["inspect", "--json", str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.err == ""
    why = f"not a safetensors file: it is a NumPy .npy file: convert it with `fastst convert {bad}`"
    assert json.loads(captured.out) == {"file": str(bad), "error": why}

    missing = tmp_path / "missing.safetensors"
    assert cli.main(["inspect", "--json", str(good), str(missing), str(bad)]) == 1
    captured = capsys.readouterr()
    assert captured.err == ""
    assert json.loads(captured.out) == [
        _expected_json(good),
        {"file": str(missing), "error": "No such file or directory"},
        {"file": str(bad), "error": why},
    ]
    assert cli.main(["inspect", "--json", str(good), str(good)]) == 0
    assert json.loads(capsys.readouterr().out) == [_expected_json(good)] * 2


def test_inspect_fifo_is_refused_without_waiting_for_a_writer(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    assert cli.main(["inspect", str(fifo)]) == 1
    assert capsys.readouterr().err.startswith(f"fastst: error: {fifo}: ")


def test_inspect_missing_file(tmp_path, capsys):
    path = tmp_path / "nope.safetensors"
    assert cli.main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fastst: error: {path}: No such file or directory\n"


def test_inspect_directory(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path)]) == 1
    assert capsys.readouterr().err == (f"fastst: error: {tmp_path}: no model.safetensors."
                                       f"index.json nor any .safetensors file in this "
                                       f"directory\n")


def test_inspect_through_python_dash_m(tmp_path):
    path = _sample(tmp_path)
    done = _run_module(tmp_path, "inspect", str(path))
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == _expected_lines(path)

    done = _run_module(tmp_path, "inspect", "--json", str(path))
    assert (done.returncode, done.stderr) == (0, "")
    assert json.loads(done.stdout) == _expected_json(path)

    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"abc")
    done = _run_module(tmp_path, "inspect", str(bad))
    assert done.returncode == 1
    assert done.stdout == ""
    assert done.stderr.startswith("fastst: error: ") and len(done.stderr.splitlines()) == 1
    assert "Traceback" not in done.stderr


# ---------------------------------------------------------------------------
# usage, --version
# ---------------------------------------------------------------------------

def test_version(capsys):
    assert cli.main(["--version"]) == 0
    assert capsys.readouterr().out == f"fastst {fastst.__version__}\n"


def test_version_through_python_dash_m(tmp_path):
    done = _run_module(tmp_path, "--version")
    assert (done.returncode, done.stdout, done.stderr) == (0, f"fastst {fastst.__version__}\n", "")


def test_usage_errors_exit_2(capsys):
    assert cli.main([]) == 2
    assert "fastst: error:" in capsys.readouterr().err
    assert cli.main(["inspect"]) == 2
    capsys.readouterr()
    assert cli.main(["demo", "--size-mb", "0"]) == 2
    assert "--size-mb" in capsys.readouterr().err
    assert cli.main(["demo", "--size-mb", "lots"]) == 2
    capsys.readouterr()


@pytest.mark.parametrize("files", [["a.safetensors"], ["a.safetensors", "shards/", "s3://b/c"]])
def test_a_plain_inspect_is_taken_as_its_parser_takes_it(files):
    """``fastst inspect FILE...`` runs without argparse (4 ms); the arguments it runs
    with are the ones inspect's parser makes."""
    parsed = cli._command_parser("inspect").parse_args(files)
    assert vars(cli._parse(["inspect", *files])) == {**vars(parsed), "command": "inspect"}


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "inspect" in out and "demo" in out


@pytest.mark.parametrize("nbytes,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (2**20, "1.0 MiB"), (5 * 2**30, "5.0 GiB"), (3 * 2**40, "3.0 TiB"),
])
def test_human_size(nbytes, text):
    assert _inspect.human_size(nbytes) == text


# ---------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------

STEP_LABELS = ["zero-copy open", "atomic save", "sharded save", "checksums", "convert a .npz",
               "object store", "streaming writer", "row gather", "inspect"]


def _demo_steps(out):
    """The tour's lines: label -> text."""
    lines = out.splitlines()
    first = lines.index("what fastst does that the reference (huggingface safetensors) does not:")
    steps = {}
    for line in lines[first + 1:first + 1 + len(STEP_LABELS)]:
        label, text = line.split(":", 1)
        steps[label.strip()] = text.strip()
    return steps


def _check_demo_output(out, path):
    lines = out.splitlines()
    assert lines[0].startswith(f"fastst {fastst.__version__} demo: a 36-tensor")
    assert f"saved with fastst.save_file -> {path}" in lines
    steps = _demo_steps(out)
    assert list(steps) == STEP_LABELS
    assert re.fullmatch(r"36 tensors opened in [\d.]+ [mu]?s: 2\.0 MiB mapped, nothing copied, "
                        r"BF16 and F8_E4M3 kept, byte for byte", steps["zero-copy open"])
    assert steps["atomic save"] == ("a save over the file stopped after 3 of 36 tensors: the "
                                    "old file intact, no temporary file left")
    assert re.fullmatch(r"\d shards \+ index in [\d.]+ [mu]?s, the index last \(a killed save "
                        r"leaves the old checkpoint\); opened as one handle: 36 tensors in "
                        r"[\d.]+ [mu]?s", steps["sharded save"])
    assert re.fullmatch(r"verify found the 1 corrupt tensor of 36 \(layers\.2\.self_attn\."
                        r"k_proj\.weight\); 2\.0 MiB hashed in [\d.]+ [mu]?s", steps["checksums"])
    assert re.fullmatch(r"27 arrays \([\d.]+ MiB\) to safetensors in [\d.]+ [mu]?s, without "
                        r"pickle, each read back and compared", steps["convert a .npz"])
    embed = _inspect.human_size(_demo.demo_checkpoint(2)["embed_tokens.weight"].nbytes)
    store = re.fullmatch(rf"saved to fsspec's memory store; one {re.escape(embed)} tensor of the "
                         r"2\.0 MiB file read with ([\d.]+)x its bytes, (\d+) requests?",
                         steps["object store"])
    assert store and 1 <= float(store[1]) < 1.5 and int(store[2]) <= 2, steps["object store"]
    stream = re.fullmatch(r"8\.0 MiB written in 64 pieces of 128\.0 KiB in [\d.]+ [mu]?s; peak "
                          r"memory traced ([\d.]+) KiB", steps["streaming writer"])
    assert stream and float(stream[1]) < 1024, steps["streaming writer"]     # not the file
    assert re.fullmatch(r"4096 random rows of embed_tokens\.weight in one call: [\d.]+ [mu]?s, "
                        r"[\d,]+ rows/s", steps["row gather"])
    header = _inspect.describe(str(path))["header_size"]
    assert steps["inspect"] == (f"`fastst inspect demo.safetensors`: 36 tensors and 5 metadata "
                                f"entries, from the {_inspect.human_size(header)} header alone")
    # The timing table, ratios relative to fastst.
    head = next(i for i, line in enumerate(lines) if line.startswith("format "))
    assert lines[head].split() == ["format", "save", "ratio", "load", "ratio", "load+read",
                                   "all", "ratio", "bf16/fp8", "dtypes", "kept"]
    rows = {line.split()[0]: line for line in lines[head + 2:head + 5]}
    assert list(rows) == ["fastst", "pickle", "np.savez"]
    assert rows["fastst"].endswith("yes") and rows["pickle"].endswith("yes")
    assert rows["np.savez"].endswith("no (V1, V2)")
    for line in rows.values():
        cells = line.split()
        assert len(cells) >= 11 and all(cell.endswith("x") for cell in cells[3:10:3])
    assert "did not hold" not in out


def test_demo_skips_the_steps_whose_library_is_missing(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "xxhash", None)     # import xxhash: ImportError
    monkeypatch.setitem(sys.modules, "fsspec", None)
    assert cli.main(["demo", "--size-mb", "1", "--dir", str(tmp_path)]) == 0
    steps = _demo_steps(capsys.readouterr().out)
    assert steps["checksums"] == "skipped: xxhash is not installed (the checksum extra)"
    assert steps["object store"] == "skipped: fsspec is not installed (the remote extra)"
    assert steps["row gather"].startswith("4096 random rows")


def test_the_demo_tells_copies_from_views(tmp_path, capsys, monkeypatch):
    def reading_copies(path, framework="np", **options):
        return fastst.safe_open(path, framework, backend="pread")

    monkeypatch.setattr(_demo, "safe_open", reading_copies)
    assert cli.main(["demo", "--size-mb", "1", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert ", 36 tensors copied, " in _demo_steps(out)["zero-copy open"]
    assert "did not hold: zero-copy open\n" in out


def test_a_step_that_does_not_hold_makes_the_demo_exit_1(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(_demo, "_same_bytes", lambda a, b: False)
    assert cli.main(["demo", "--size-mb", "1", "--dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert _demo_steps(out)["zero-copy open"].endswith("36 not as saved")
    assert "did not hold: zero-copy open, atomic save, sharded save" in out


def test_timing_rows_are_ratios_to_the_first_row():
    rows = _demo.timing_rows([
        _demo.Timing("fastst", 0.002, 0.0001, 0.5, []),
        _demo.Timing("pickle", 0.006, 0.0125, 0.25, []),
        _demo.Timing("np.savez", 0.020, 2.5, 1.0, ["V1", "V2"]),
    ])
    assert rows == [
        ["fastst", "2.0 ms", "1.0x", "100 us", "1.0x", "500.0 ms", "1.0x", "yes"],
        ["pickle", "6.0 ms", "3.0x", "12.5 ms", "125.0x", "250.0 ms", "0.5x", "yes"],
        ["np.savez", "20.0 ms", "10.0x", "2.50 s", "25000.0x", "1.00 s", "2.0x", "no (V1, V2)"],
    ]
    assert _demo.ratio(1.0, 0.0) == "-"


def test_demo_with_dir_keeps_only_the_checkpoint(tmp_path, capsys):
    assert cli.main(["demo", "--size-mb", "2", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    path = tmp_path / "demo.safetensors"
    _check_demo_output(captured.out, path)
    assert captured.out.splitlines()[-1].endswith(f"checkpoint kept at {path}")
    assert os.listdir(tmp_path) == ["demo.safetensors"]
    expected = _demo.demo_checkpoint(2)
    loaded = fastst.load_file(path)
    assert list(loaded) == fastst.safe_open(path).offset_keys()
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == array.dtype
        assert loaded[name].tobytes() == array.tobytes()
    with fastst.safe_open(path) as f:
        assert f.metadata() == _demo.demo_metadata(expected)
    assert 1.5 * 2**20 < sum(a.nbytes for a in expected.values()) < 2.5 * 2**20


def test_demo_without_dir_removes_its_temporary_folder(tmp_path, capsys, monkeypatch):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    assert cli.main(["demo", "--size-mb", "2"]) == 0
    out = capsys.readouterr().out
    saved = next(line for line in out.splitlines() if line.startswith("saved with"))
    path = saved.split(" -> ", 1)[1]
    assert path.startswith(str(scratch) + os.sep)
    assert out.splitlines()[-1].endswith("temporary files removed")
    assert os.listdir(scratch) == []


def test_demo_missing_dir_is_an_error(tmp_path, capsys):
    assert cli.main(["demo", "--size-mb", "1", "--dir", str(tmp_path / "nope")]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fastst: error: --dir {tmp_path / 'nope'}: not a directory\n"


def test_demo_through_python_dash_m(tmp_path):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    root = os.path.dirname(os.path.dirname(os.path.abspath(fastst.__file__)))
    env = dict(os.environ, TMPDIR=str(scratch),
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-m", "fastst", "demo", "--size-mb", "1"],
                          capture_output=True, text=True, env=env, cwd=str(tmp_path),
                          timeout=120)
    assert (done.returncode, done.stderr) == (0, "")
    assert "pickle" in done.stdout and "np.savez" in done.stdout
    assert os.listdir(scratch) == []


@pytest.mark.parametrize("size_mb", [0.001, 0.5, 64])
def test_demo_checkpoint_size_and_dtypes(size_mb):
    tensors = _demo.demo_checkpoint(size_mb)
    nbytes = sum(a.nbytes for a in tensors.values())
    if size_mb >= 0.5:
        assert 0.8 * size_mb * 2**20 < nbytes < 1.2 * size_mb * 2**20
    dtypes = {a.dtype for a in tensors.values()}
    assert dtypes == {np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16),
                      np.dtype(ml_dtypes.float8_e4m3fn)}
    assert len(tensors) == 36
    assert np.isfinite(tensors["lm_head.weight"].astype(np.float32)).all()
