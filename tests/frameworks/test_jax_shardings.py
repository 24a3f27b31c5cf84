"""JAX shardings: a file loaded straight into a sharding equals ``jax.device_put`` of
the whole array, value for value and dtype for dtype, each device's shard read alone.
Meshes of several devices need XLA_FLAGS set before JAX is imported: those checks
run in a fresh interpreter with 8 host devices."""
import json
import os
import subprocess
import sys
import textwrap

import ml_dtypes
import numpy as np
import pytest

jax = pytest.importorskip("jax")

import fastst  # noqa: E402
import fastst.flax as ff  # noqa: E402
from fastst.writer import WriteSpec, serialize  # noqa: E402
from servers import http_store  # noqa: E402,F401

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# every dtype JAX holds (64-bit ones become 32-bit, as device_put makes them)
DTYPES = [np.bool_, np.uint8, np.int8, np.int16, np.uint16, np.int32, np.uint32, np.int64,
          np.uint64, np.float16, ml_dtypes.bfloat16, np.float32, np.float64, np.complex64,
          ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2, ml_dtypes.float8_e4m3fnuz,
          ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e8m0fnu]
SHAPES = [(16, 16), (8, 8, 8), (16,), ()]


def model_bytes(seed=0) -> bytes:
    rng = np.random.default_rng(seed)
    specs = []
    for k, dtype in enumerate(DTYPES):
        for shape in SHAPES:
            dtype = np.dtype(dtype)
            raw = rng.integers(0, 256, int(np.prod(shape)) * dtype.itemsize, dtype=np.uint8)
            if dtype == np.bool_:
                raw &= 1
            specs.append(fastst.writer.spec_of_array(f"t{k}_{len(shape)}",
                                                     raw.view(dtype).reshape(shape)))
    specs += [WriteSpec("f4", "F4", (16, 16), rng.integers(0, 256, 16 * 8, dtype=np.uint8)),
              WriteSpec("f6", "F6_E2M3", (8, 8), rng.integers(0, 256, 8 * 6, dtype=np.uint8))]
    return serialize(specs)


def run_with_devices(code: str, args: dict, devices: int = 8, timeout: float = 240) -> dict:
    """Run `code` in a fresh interpreter whose JAX has `devices` CPU devices, given
    `args` (as ARGS); what it prints last, as JSON."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}",
           "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(TESTS), TESTS,
                                          os.environ.get("PYTHONPATH", "")])}
    script = f"import json\nARGS = json.loads({json.dumps(json.dumps(args))})\n" + \
        textwrap.dedent(code)
    try:
        done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running after {timeout} s") from None
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


CHECKS = """
    import numpy as np, jax, fastst, fastst.flax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    assert len(jax.devices()) == 8

    def same(got, want, what):
        assert got.sharding == want.sharding, (what, got.sharding, want.sharding)
        assert got.dtype == want.dtype and got.shape == want.shape, (what, got.dtype)
        assert len(got.addressable_shards) == len(want.addressable_shards) == 8, what
        for mine, theirs in zip(got.addressable_shards, want.addressable_shards):
            assert mine.device == theirs.device and mine.index == theirs.index, what
            assert np.asarray(mine.data).tobytes() == np.asarray(theirs.data).tobytes(), what

    def specs(axes):
        one = [P(), *[P(a) for a in axes], *[P(None, a) for a in axes]]
        if len(axes) == 1:
            return one
        return one + [P(*axes), P(*axes[::-1]), P(axes), P(None, None, axes[0])]

    def fitted(spec, ndim):
        return P(*tuple(spec)[:ndim])

    path, checkpoint, url = ARGS["path"], ARGS["checkpoint"], ARGS["url"]
    full = {name: np.asarray(array) for name, array in fastst.load_file(path).items()}
    checked = 0
    for layout, axes in [((8,), ("x",)), ((4, 2), ("x", "y")), ((2, 4), ("x", "y"))]:
        mesh = Mesh(np.array(jax.devices()).reshape(layout), axes)
        for spec in specs(axes):
            def sharding_of(name, shape, dtype, spec=spec):   # packed ones: as without
                if name.startswith("f"):
                    return None
                return NamedSharding(mesh, fitted(spec, len(shape)))
            for target, backend in [(path, "pread"), (path, "mmap"), (checkpoint, "pread"),
                                    (url, "pread")]:
                names = [n for n in full if not n.startswith("f")] if target == checkpoint \\
                    else [n for n in full if not n.startswith("f")][::7]
                with fastst.safe_open(target, framework="jax", backend=backend) as f:
                    for name in names:
                        sharding = sharding_of(name, full[name].shape, None)
                        same(f.get_tensor(name, sharding=sharding),
                             jax.device_put(full[name], sharding), (name, spec, target))
                        checked += 1
            loaded = fastst.flax.load_file(path, shardings=sharding_of, backend="pread")
            for name, array in full.items():
                if not name.startswith("f"):
                    same(loaded[name], jax.device_put(array, sharding_of(name, array.shape, None)),
                         (name, spec, "load_file"))
    # packed sub-byte tensors: their leading axes split, never the packed last one
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    for name in ("f4", "f6"):
        with fastst.safe_open(path, framework="jax", backend="pread") as f:
            for spec in (P("x"), P("y"), P(("x", "y"))):
                sharding = NamedSharding(mesh, spec)
                same(f.get_tensor(name, sharding=sharding), jax.device_put(full[name], sharding),
                     (name, spec))
            try:
                f.get_tensor(name, sharding=NamedSharding(mesh, P(None, "y")))
                raise AssertionError("a split of the packed axis was not refused")
            except fastst.SafetensorError as error:
                assert "stored packed" in str(error) and repr(name) in str(error), error
    # a sharding that does not fit its array (a tiling that does not divide it, more
    # dimensions than it has): the error device_put raises, naming the tensor and shape
    import fastst.distributed
    mesh = Mesh(np.array(jax.devices()), ("x",))
    grid = Mesh(np.array(jax.devices()).reshape(4, 2), ("x", "y"))
    odd = {"odd": np.zeros((10, 12), np.float32), "scalar": np.float32(1),
           "row": np.zeros(16, np.float32)}
    fastst.save_file(odd, ARGS["odd"])
    misfits = [("odd", NamedSharding(mesh, P("x"))), ("odd", NamedSharding(mesh, P(None, "x"))),
               ("odd", NamedSharding(grid, P(None, None, "x"))),
               ("row", NamedSharding(grid, P("x", "y"))), ("scalar", NamedSharding(mesh, P("x")))]
    for name, sharding in misfits:
        try:
            jax.device_put(odd[name], sharding)
            raise AssertionError(f"device_put took {sharding} for {name}")
        except ValueError as error:
            expected = type(error)
        with fastst.safe_open(ARGS["odd"], framework="jax") as f:
            for load in (lambda: f.get_tensor(name, sharding=sharding),
                         lambda: fastst.flax.load_file(ARGS["odd"], shardings={name: sharding}),
                         lambda: fastst.distributed.plan_shardings(ARGS["odd"], {name: sharding})):
                try:
                    load()
                    raise AssertionError(f"{sharding} was not refused for {name}")
                except ValueError as error:
                    message = str(error)
                    assert type(error) is expected, (type(error), expected, message)
                    assert message.startswith(f"{ARGS['odd']}: tensor {name!r} (shape "
                                              f"{odd[name].shape}): "), message
                    assert str(sharding) in message, message
    # one sharding for all, a mapping (None: as without), a callable
    sharding = NamedSharding(mesh, P("x"))
    by_name = fastst.flax.load_file(path, shardings={"t0_2": sharding, "t1_2": None})
    assert by_name["t0_2"].sharding == sharding and len(by_name["t1_2"].devices()) == 1
    print(json.dumps({"checked": checked}))
"""


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    folder = tmp_path_factory.mktemp("jax-model")
    path = folder / "model.safetensors"
    path.write_bytes(model_bytes())
    checkpoint = folder / "checkpoint"
    numpy_only = {name: array for name, array in fastst.load_file(path).items()
                  if not name.startswith("f")}
    fastst.save_file(numpy_only, checkpoint, max_shard_size=8_000)
    assert len(list(checkpoint.glob("*.safetensors"))) >= 3
    return path, checkpoint


def test_sharded_loads_equal_device_put_on_every_mesh_spec_and_dtype(model, tmp_path,
                                                                     http_store):
    path, checkpoint = model
    http_store.be_honest()
    http_store.objects["/model.safetensors"] = path.read_bytes()
    result = run_with_devices(CHECKS, {"path": str(path), "checkpoint": str(checkpoint),
                                       "url": f"{http_store.url}/model.safetensors",
                                       "odd": str(tmp_path / "odd.safetensors")})
    assert result["checked"] > 1000


BYTES = """
    import numpy as np, jax, fastst, fastst.flax, fastst.distributed, orjson
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    def read_bytes():
        with open("/proc/self/io") as io:
            return next(int(line.split()[1]) for line in io if line.startswith("rchar:"))

    path, size = ARGS["path"], ARGS["size"]
    everywhere = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), P())
    fastst.flax.load_file(ARGS["warm"], backend="pread",   # what a first sharded load imports
                          shardings=lambda name, shape, dtype: everywhere)
    results = []
    for layout, axes in [((8,), ("x",)), ((4, 2), ("x", "y")), ((2, 4), ("x", "y"))]:
        mesh = Mesh(np.array(jax.devices()).reshape(layout), axes)
        for spec in [P(), *[P(a) for a in axes], *[P(None, a) for a in axes], P(*axes)]:
            def sharding_of(name, shape, dtype, spec=spec):
                return NamedSharding(mesh, P(*tuple(spec)[:len(shape)]))
            plan = fastst.distributed.plan_shardings(path, sharding_of)
            before = read_bytes()
            loaded = fastst.flax.load_file(path, shardings=sharding_of, backend="pread")
            read = read_bytes() - before
            assert all(array.sharding == sharding_of(name, array.shape, None)
                       for name, array in loaded.items())
            results.append([str(spec), read, plan.total_bytes])
    print(json.dumps(results))
"""


def test_a_sharded_load_reads_the_file_once_whatever_the_mesh(tmp_path, http_store):
    rng = np.random.default_rng(1)
    tensors = {"embed": rng.standard_normal((512, 1024)).astype(ml_dtypes.bfloat16),
               "wide": rng.standard_normal((64, 4096)).astype(np.float32),
               "norm": rng.standard_normal(1024).astype(np.float32),
               "w3": rng.standard_normal((16, 8, 1024)).astype(np.float16)}
    path, warm = tmp_path / "model.safetensors", tmp_path / "warm.safetensors"
    fastst.save_file(tensors, path)
    fastst.save_file({"w": np.zeros((8, 8), np.float32)}, warm)
    size = path.stat().st_size
    results = run_with_devices(BYTES, {"path": str(path), "size": size, "warm": str(warm)})
    assert len(results) == 4 + 2 * 6
    for spec, read, planned in results:
        assert planned <= read <= planned + 1024, spec          # what the plan says
        assert read <= 1.01 * size, spec                        # not 8x: once


def test_a_sharded_url_load_asks_for_the_file_once(tmp_path, http_store):
    rng = np.random.default_rng(2)
    data = fastst.save({"w": rng.standard_normal((256, 8192)).astype(np.float32),
                        "b": rng.standard_normal(8192).astype(np.float32)})
    http_store.be_honest()
    http_store.objects["/sharded.safetensors"] = data
    http_store.reset_counts()
    code = """
        import numpy as np, jax, fastst.flax
        from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
        mesh = Mesh(np.array(jax.devices()).reshape(2, 4), ("x", "y"))
        arrays = fastst.flax.load_file(ARGS["url"], shardings={
            "w": NamedSharding(mesh, P("x", "y")), "b": NamedSharding(mesh, P("y"))})
        print(json.dumps({name: float(np.asarray(a).sum()) for name, a in arrays.items()}))
    """
    sums = run_with_devices(code, {"url": f"{http_store.url}/sharded.safetensors"})
    assert sums["w"] == pytest.approx(float(fastst.load(data)["w"].sum()), rel=1e-4)
    assert http_store.bytes_sent <= len(data) + (64 << 10)


# --- in this process: the devices there are ----------------------------------------------

def test_one_device_shardings_and_what_is_refused(tmp_path):
    from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding

    path = tmp_path / "x.safetensors"
    arrays = {"a": np.arange(12, dtype=np.float32).reshape(4, 3), "b": np.ones(2, np.int8)}
    fastst.save_file(arrays, path)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    for sharding in (SingleDeviceSharding(jax.devices()[0]),
                     NamedSharding(mesh, PartitionSpec("x"))):
        with fastst.safe_open(path, framework="jax") as f:
            got = f.get_tensor("a", sharding=sharding)
        assert got.sharding == sharding
        np.testing.assert_array_equal(np.asarray(got), arrays["a"])
    seen = []
    loaded = ff.load_file(path, shardings=lambda name, shape, dtype: seen.append(
        (name, shape, dtype)) or None)
    assert seen == [("a", (4, 3), np.dtype(np.float32)), ("b", (2,), np.dtype(np.int8))]
    assert sorted(loaded) == ["a", "b"]
    with fastst.safe_open(path, framework="jax") as f:
        for bad in ("x", 3, [NamedSharding(mesh, PartitionSpec())]):
            with pytest.raises(fastst.SafetensorError, match="shardings must be"):
                f.get_tensors(shardings=bad)
        with pytest.raises(fastst.SafetensorError, match="not a jax.sharding.Sharding"):
            f.get_tensors(shardings={"a": "x"})
    sharding = NamedSharding(mesh, PartitionSpec())
    with fastst.safe_open(path, framework="np") as f:
        with pytest.raises(TypeError):
            f.get_tensor("a", sharding=sharding)


def test_torch_handles_refuse_shardings(tmp_path):
    pytest.importorskip("torch")
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    path = tmp_path / "x.safetensors"
    fastst.save_file({"a": np.ones(2)}, path)
    folder = tmp_path / "checkpoint"
    fastst.save_file({"a": np.ones(2), "b": np.ones(2)}, folder, max_shard_size=16)
    sharding = NamedSharding(Mesh(np.array(jax.devices()), ("x",)), PartitionSpec())
    for target in (path, folder):
        with fastst.safe_open(target, framework="pt") as f:
            with pytest.raises(fastst.SafetensorError, match="framework='jax'"):
                f.get_tensor("a", sharding=sharding)
            with pytest.raises(fastst.SafetensorError, match="framework='jax'"):
                f.get_tensors(shardings=sharding)
    with fastst.safe_open(folder) as f:
        with pytest.raises(fastst.SafetensorError, match="framework='jax'"):
            f.get_tensor("a", sharding=sharding)
