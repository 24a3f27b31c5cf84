"""The ``fastst`` command line: ``inspect``, ``demo`` and ``--version``."""
import json
import os
import struct
import subprocess
import sys
import tempfile

import ml_dtypes
import numpy as np
import pytest

import fastst
from fastst import cli


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


def _expected_lines(path):
    n = _header_size(path)
    size = os.path.getsize(path)
    assert size == 8 + n + 8252
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
        f"file size    {size} ({cli.human_size(size)})",
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
        "file_size": os.path.getsize(path),
        "metadata": {"author": "tests", "format": "np"},
    }


def _raw_file(path, header, data=b""):
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def _raw_text(path, text, data=b""):
    raw = text.encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)
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
    path = _raw_file(tmp_path / "f4.safetensors",
                     {"x": {"dtype": "F4", "shape": [2, 3], "data_offsets": [0, 3]}},
                     b"\x01\x02\x03")
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


@pytest.mark.parametrize("make", [
    pytest.param(lambda p: p.write_bytes(b"abc"), id="shorter-than-prefix"),
    pytest.param(lambda p: p.write_bytes(struct.pack("<Q", 1000) + b"{}"), id="header-past-end"),
    pytest.param(lambda p: p.write_bytes(struct.pack("<Q", 8) + b"not json"), id="not-json"),
    pytest.param(lambda p: _raw_file(p, {"x": {"dtype": "F32", "shape": [2],
                                               "data_offsets": [0, 8]}}, b"\0" * 4),
                 id="offsets-past-end"),
    pytest.param(lambda p: _raw_file(p, {"x": {"dtype": "F32", "shape": [1],
                                               "data_offsets": [0, 4], "extra": 1}},
                                     b"\0" * 4), id="extra-field"),
    pytest.param(lambda p: _raw_text(
        p, '{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},'
           '"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}}', b"\0"), id="duplicate-key"),
    pytest.param(lambda p: _raw_text(
        p, '{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'), id="negative-zero"),
])
def test_inspect_malformed_file_is_one_line_error(tmp_path, capsys, make):
    path = tmp_path / "bad.safetensors"
    make(path)
    with pytest.raises(fastst.SafetensorError) as raised:
        fastst.safe_open(path, framework="np")
    assert cli.main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fastst: error: {raised.value}\n"
    assert str(raised.value).startswith(str(path))


def test_inspect_missing_file(tmp_path, capsys):
    path = tmp_path / "nope.safetensors"
    assert cli.main(["inspect", str(path)]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == f"fastst: error: {path}: No such file or directory\n"


def test_inspect_directory(tmp_path, capsys):
    assert cli.main(["inspect", str(tmp_path)]) == 1
    assert capsys.readouterr().err == f"fastst: error: {tmp_path}: Is a directory\n"


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


def test_help_exits_0(capsys):
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "inspect" in out and "demo" in out


@pytest.mark.parametrize("nbytes,text", [
    (0, "0 B"), (1023, "1023 B"), (1024, "1.0 KiB"), (1536, "1.5 KiB"),
    (2**20, "1.0 MiB"), (5 * 2**30, "5.0 GiB"), (3 * 2**40, "3.0 TiB"),
])
def test_human_size(nbytes, text):
    assert cli.human_size(nbytes) == text


# ---------------------------------------------------------------------------
# demo
# ---------------------------------------------------------------------------

def _check_demo_output(out, path):
    lines = out.splitlines()
    assert lines[0].startswith(f"fastst {fastst.__version__} demo: a 36-tensor")
    assert f"saved with fastst.save_file -> {path}" in lines
    assert "  two get_tensor() calls share memory (np.shares_memory): True" in lines
    assert "  every tensor round-trips byte for byte: True" in lines
    assert "  writing to a view leaves the file unchanged (private map): True" in lines
    # The inspect table of the checkpoint, exactly as `fastst inspect` prints it.
    table = cli.render_inspect(cli.describe(str(path)))
    start = lines.index(f"file: {path}")
    assert lines[start:start + len(table)] == table
    assert "tensors      36" in lines
    assert any(line.startswith("lm_head.weight ") and " F8_E4M3 " in line for line in lines)
    assert any(" BF16 " in line for line in lines)
    assert "  hidden_size  " + str(cli.demo_checkpoint(2)["norm.weight"].shape[0]) in lines
    # The timing table, ratios relative to fastst.
    head = next(i for i, line in enumerate(lines) if line.startswith("format "))
    assert lines[head].split() == ["format", "save", "ratio", "load", "ratio", "load+read",
                                   "all", "ratio", "bf16/fp8", "dtypes", "kept"]
    rows = {line.split()[0]: line for line in lines[head + 2:head + 5]}
    assert list(rows) == ["fastst", "pickle", "np.savez"]
    assert rows["fastst"].count("1.0x") == 3 and rows["fastst"].endswith("yes")
    assert rows["pickle"].endswith("yes")
    assert rows["np.savez"].endswith("no (V1, V2)")


def test_demo_with_dir_keeps_only_the_checkpoint(tmp_path, capsys):
    assert cli.main(["demo", "--size-mb", "2", "--dir", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    assert captured.err == ""
    path = tmp_path / "demo.safetensors"
    _check_demo_output(captured.out, path)
    assert captured.out.splitlines()[-1].endswith(f"checkpoint kept at {path}")
    assert os.listdir(tmp_path) == ["demo.safetensors"]
    expected = cli.demo_checkpoint(2)
    loaded = fastst.load_file(path)
    assert list(loaded) == fastst.safe_open(path).offset_keys()
    assert sorted(loaded) == sorted(expected)
    for name, array in expected.items():
        assert loaded[name].dtype == array.dtype
        assert loaded[name].tobytes() == array.tobytes()
    with fastst.safe_open(path) as f:
        assert f.metadata() == cli.demo_metadata(expected)
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
    tensors = cli.demo_checkpoint(size_mb)
    nbytes = sum(a.nbytes for a in tensors.values())
    if size_mb >= 0.5:
        assert 0.8 * size_mb * 2**20 < nbytes < 1.2 * size_mb * 2**20
    dtypes = {a.dtype for a in tensors.values()}
    assert dtypes == {np.dtype(np.float32), np.dtype(ml_dtypes.bfloat16),
                      np.dtype(ml_dtypes.float8_e4m3fn)}
    assert len(tensors) == 36
    assert np.isfinite(tensors["lm_head.weight"].astype(np.float32)).all()
