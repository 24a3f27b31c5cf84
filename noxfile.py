"""The quick check (`pytest -m core`) on every Python and NumPy fastst supports, and the
built wheel and sdist.

    nox                   # every session
    nox -s tests-3.12     # one of them; `nox -l` lists them

Each session installs fastst into a new virtual environment (a wheel built from the
checkout, or the one `dist` builds) with the `test-core` extra, and runs the tests of the
checkout against that install: pytest starts in a temporary folder, and conftest.py
refuses to run if `import fastst` finds the checkout instead. The Pythons must be on
PATH as python3.10 ... python3.13 (with pyenv:
``PATH=$(printf '%s/bin:' $(pyenv root)/versions/3.1[0-3].*)$PATH nox``). The whole
suite, frameworks included, runs on one Python: the README's second command.

    nox -s wheel-3.11     # the wheel repaired to a manylinux tag, installed with no compiler
    nox -s freethreaded   # the quick check on CPython 3.13 built without the GIL
    nox -s tsan           # the thread tests under ThreadSanitizer (its own interpreter)
    nox -s reference      # the reference's own tests through the switch
    nox -s macos          # the core compiled for macOS (x86-64, arm64), not run

`nox -s freethreaded` builds the free-threaded interpreter once, from Debian's source
package of CPython 3.13 (pyenv has no free-threaded build here), into
FREE_THREADED_HOME, and reuses it after.

fetches huggingface safetensors' Python tests at the tag of the release whose API
fastst offers, installs that release beside fastst, and runs them with it and through
the switch (tests/test_reference_suite.py).
"""
import json
import os
import pathlib
import shutil
import tarfile
import tempfile
import zipfile

import nox
from packaging.requirements import Requirement  # nox's own dependency

ROOT = pathlib.Path(__file__).resolve().parent
PYTHONS = ["3.10", "3.11", "3.12", "3.13"]
# The oldest releases pyproject.toml's dependencies allow.
OLDEST = ["numpy==2.0.0", "orjson==3.9.15", "ml_dtypes==0.5.0"]
# Where `nox -s reference` fetches the reference's tests from: a git URL or folder.
REFERENCE_REPOSITORY = os.environ.get("FASTST_REFERENCE_REPOSITORY",
                                      "https://github.com/huggingface/safetensors")
# What the reference's tests import beyond fastst's test-core extra: the `test`
# extra's torch, flax for test_flax_comparison.py, TensorFlow and h5py for
# test_tf_comparison.py. Not paddlepaddle: with paddlepaddle 3.3 beside torch and
# TensorFlow, the reference's own run crashes in its test_paddle_comparison.py.
REFERENCE_TEST_NEEDS = ["torch==2.13.0", "jax", "flax", "tensorflow-cpu", "h5py"]

# Where `nox -s freethreaded` builds CPython 3.13 without the GIL, from Debian's source.
FREE_THREADED_HOME = pathlib.Path(os.environ.get(
    "FASTST_FREE_THREADED_HOME", pathlib.Path.home() / ".cache" / "fastst-nox" / "python3.13t"))
# Where `nox -s tsan` builds it again with ThreadSanitizer.
TSAN_HOME = pathlib.Path(os.environ.get("FASTST_TSAN_HOME",
                                        FREE_THREADED_HOME.parent / "python3.13t-tsan"))
DEBIAN_SOURCES = "deb-src http://deb.debian.org/debian trixie main"
DOWNLOAD_SECONDS = 600
BUILD_SECONDS = 3600
# What the free-threaded session installs beside fastst: the test-core extra without the
# reference (its abi3 wheel cannot load without the GIL, and its sdist needs crates), nor
# aiohttp, nor mypy (no free-threaded wheel of aiohttp, nor of mypy 2's compiled
# dependencies; what mypy checks, the stubs, is the same on every Python); the tests that
# need them are skipped. The rest as wheels only: pip then takes the newest release with
# a wheel for 3.13t (NumPy 2.5 has none, 2.4 has; hypothesis' newest need crates for it).
FREE_THREADED_LEAVES_OUT = {"safetensors", "aiohttp", "mypy"}
FREE_THREADED_WHEELS_ONLY = ":all:"
# What `nox -s tsan` installs: what tests/handles/test_threads.py imports, and what building
# fastst without build isolation needs.
TSAN_NEEDS = ["numpy", "ml_dtypes", "pytest", "cython", "setuptools", "packaging"]

# What `nox -s macos` compiles with: Zig's C compiler (clang), which carries the headers
# of macOS's C library, for the oldest macOS the wheels are built for (pyproject.toml's
# MACOSX_DEPLOYMENT_TARGET: preadv is there from macOS 11).
ZIG = "ziglang==0.17.0"
MACOS_TARGETS = ["x86_64-macos.11.0", "aarch64-macos.11.0"]
# Warnings that fail it: implicit declarations are errors already (a function macOS
# lacks), and a call to a function newer than the target is one too.
MACOS_STRICT = ["-Wall", "-Werror", "-Werror=unguarded-availability-new"]

nox.options.default_venv_backend = "venv"
nox.options.error_on_missing_interpreters = True
# A PYTHONPATH naming a checkout would put it before the install under test.
os.environ.pop("PYTHONPATH", None)


def run_core_tests(session, pytest="pytest"):
    """The quick check of the checkout's tests against the fastst installed here."""
    folder = session.create_tmp()
    with session.chdir(folder):
        session.run(pytest, str(ROOT / "tests"), "-m", "core", "-p", "no:cacheprovider",
                    *session.posargs, env={"FASTST_TEST_INSTALLED": "1"})


@nox.session(python=PYTHONS)
def tests(session):
    """The newest NumPy and other dependencies that install on this Python."""
    session.install(f"{ROOT}[test-core]")
    run_core_tests(session)


@nox.session(python=PYTHONS[0])
def oldest(session):
    """The oldest Python with the oldest NumPy, orjson and ml_dtypes allowed."""
    session.install(f"{ROOT}[test-core]", *OLDEST)
    run_core_tests(session)


@nox.session(python=PYTHONS[-1])
def dist(session):
    """Build the sdist and, from it, the wheel; check them; test the installed wheel."""
    session.install("build", "twine")
    out = pathlib.Path(session.create_tmp()) / "dist"
    session.run("python", "-m", "build", "--outdir", str(out), str(ROOT))
    (sdist,), (wheel,) = out.glob("*.tar.gz"), out.glob("*.whl")
    session.run("twine", "check", "--strict", str(sdist), str(wheel))
    check_contents(session, sdist, wheel)
    session.install(f"{wheel}[test-core]")
    run_core_tests(session)


@nox.session(python=PYTHONS)
def wheel(session):
    """Build the wheel, repair it to a manylinux tag with auditwheel (which needs
    patchelf), and run the quick check against it installed into a new virtual
    environment where no compiler can be found: nothing may be built there."""
    session.install("build", "auditwheel", "patchelf")
    out = pathlib.Path(session.create_tmp())
    built, repaired = out / "built", out / "repaired"
    shutil.rmtree(built, ignore_errors=True)
    shutil.rmtree(repaired, ignore_errors=True)
    session.run("python", "-m", "build", "--wheel", "--outdir", str(built), str(ROOT))
    (raw,) = built.glob("*.whl")
    session.run("auditwheel", "repair", "--wheel-dir", str(repaired), str(raw))
    (fixed,) = repaired.glob("*.whl")
    session.run("auditwheel", "show", str(fixed))
    if "manylinux" not in fixed.name:
        session.error(f"{fixed.name} has no manylinux tag")
    session.run("python", "-m", "venv", "--clear", str(out / "venv"))
    python = str(out / "venv" / "bin" / "python")
    # Binaries only, and compilers that fail: an install that tried to build would stop.
    no_compiler = {"CC": "false", "CXX": "false", "LDSHARED": "false"}
    session.run(python, "-m", "pip", "install", "--only-binary", ":all:",
                f"{fixed}[test-core]", env=no_compiler, external=True)
    with session.chdir(session.create_tmp()):
        session.run(python, "-m", "pytest", str(ROOT / "tests"), "-m", "core",
                    "-p", "no:cacheprovider", *session.posargs,
                    env={"FASTST_TEST_INSTALLED": "1"}, external=True)


@nox.session(python=False)
def freethreaded(session):
    """The quick check on CPython 3.13 built without the GIL (tests/handles/test_threads.py
    checks that fastst leaves it off)."""
    python = free_threaded_python(session)
    venv = pathlib.Path(session.create_tmp()).resolve() / "venv"
    session.run(str(python), "-m", "venv", "--clear", str(venv))
    extras = nox.project.load_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    needs = [need for need in extras["test-core"]
             if Requirement(need).name not in FREE_THREADED_LEAVES_OUT]
    session.run(str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", str(ROOT),
                *needs, env={"PIP_ONLY_BINARY": FREE_THREADED_WHEELS_ONLY})
    run_core_tests(session, str(venv / "bin" / "pytest"))


def free_threaded_python(session, home=FREE_THREADED_HOME, configure=()):
    """The python3.13t of `home`, built there first (configured with `configure` too)
    when it is not."""
    python = home / "bin" / "python3.13t"
    built = home / "BUILT"     # written last: a build cut short is redone
    if not built.exists():
        with tempfile.TemporaryDirectory() as work:
            source = download_cpython_source(session, pathlib.Path(work))
            build_free_threaded(session, source, home, configure)
        built.write_text(f"{source.name}\n")
    return python


def download_cpython_source(session, work):
    """CPython 3.13's release, from Debian's source package python3.13, unpacked in
    `work`: its folder. apt-get reads a sources list of its own in `work` and
    changes nothing of the system's; the upstream tarball is built, without
    Debian's patches (they are for Debian's own layout)."""
    (work / "sources.list.d").mkdir()
    (work / "lists" / "partial").mkdir(parents=True)
    (work / "sources.list.d" / "debian-src.list").write_text(DEBIAN_SOURCES + "\n")
    apt = ["timeout", str(DOWNLOAD_SECONDS), "apt-get", "--quiet",
           "-o", f"Dir::Etc::sourceparts={work / 'sources.list.d'}",
           "-o", "Dir::Etc::sourcelist=/dev/null", "-o", f"Dir::State::Lists={work / 'lists'}"]
    with session.chdir(work):
        session.run(*apt, "update", external=True)
        session.run(*apt, "source", "--download-only", "python3.13", external=True)
    (tarball,) = work.glob("python3.13_*.orig.tar.xz")
    with tarfile.open(tarball) as archive:
        archive.extractall(work, filter="data")
    (source,) = work.glob("Python-3.13.*/")
    return source


def build_free_threaded(session, source, prefix, configure=()):
    """Configure CPython in `source` without the GIL (and with `configure`), build it
    and install it into `prefix`: at low priority (nice), within BUILD_SECONDS."""
    nice = ["timeout", str(BUILD_SECONDS), "nice", "-n", "10"]
    with session.chdir(source):
        session.run(*nice, "./configure", "--disable-gil", *configure, f"--prefix={prefix}",
                    "--quiet", external=True)
        session.run(*nice, "make", f"-j{os.cpu_count()}", "--quiet", external=True,
                    silent=True)
        session.run(*nice, "make", "install", external=True, silent=True)


@nox.session(python=False)
def tsan(session):
    """The thread tests (tests/handles/test_threads.py) under ThreadSanitizer: the free-threaded
    interpreter and fastst's core both built with it (an interpreter so built passes
    its flags to the extensions it builds). A report fails the session unless
    tests/tsan-suppressions.txt suppresses it, with why; NumPy and the other wheels
    are not instrumented, and their own threads are limited to one."""
    python = free_threaded_python(session, TSAN_HOME, ["--with-thread-sanitizer"])
    venv = pathlib.Path(session.create_tmp()).resolve() / "venv"
    session.run(str(python), "-m", "venv", "--clear", str(venv))
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet"]
    session.run(*pip, *TSAN_NEEDS, env={"PIP_ONLY_BINARY": FREE_THREADED_WHEELS_ONLY})
    session.run(*pip, "--no-build-isolation", str(ROOT))
    reports = pathlib.Path(session.create_tmp()).resolve() / "tsan"
    shutil.rmtree(reports, ignore_errors=True)
    reports.mkdir()
    options = (f"halt_on_error=0 exitcode=66 second_deadlock_stack=1 log_path={reports}/report "
               f"suppressions={ROOT / 'tests' / 'tsan-suppressions.txt'}")
    with session.chdir(session.create_tmp()):
        threads = ROOT / "tests" / "handles" / "test_threads.py"
        session.run(str(venv / "bin" / "pytest"), str(threads), "-p", "no:cacheprovider",
                    *session.posargs, success_codes=[0, 66],
                    env={"FASTST_TEST_INSTALLED": "1", "TSAN_OPTIONS": options,
                         "OPENBLAS_NUM_THREADS": "1"})
    found = sorted(reports.iterdir())
    for report in found:     # pytest holds a test's stderr: the reports are files
        print(report.read_text())
    if found:
        session.error(f"ThreadSanitizer reported races ({len(found)} processes)")


@nox.session(python="3.11")
def reference(session):
    """The reference's own tests with the reference, then through the switch: each
    that passes with it must pass with fastst, or be listed, with why, in
    tests/reference_differences.py."""
    session.install(f"{ROOT}[test-core]", *REFERENCE_TEST_NEEDS)
    version = session.run("python", "-c", "from fastst._switch import REFERENCE_VERSION; "
                          "print(REFERENCE_VERSION)", silent=True).strip()
    session.install(f"safetensors=={version}")
    tests = fetch_reference_tests(session, f"v{version}")
    with session.chdir(session.create_tmp()):
        session.run("pytest", str(ROOT / "tests" / "test_reference_suite.py"),
                    "-p", "no:cacheprovider", *session.posargs,
                    env={"FASTST_TEST_INSTALLED": "1", "FASTST_REFERENCE_TESTS": str(tests)})


def fetch_reference_tests(session, tag):
    """The folder of the reference's Python tests at `tag`, fetched anew from
    REFERENCE_REPOSITORY (that commit alone)."""
    clone = pathlib.Path(session.create_tmp()).resolve() / "safetensors"
    shutil.rmtree(clone, ignore_errors=True)
    session.run("git", "init", "--quiet", str(clone), external=True)
    session.run("git", "-C", str(clone), "fetch", "--quiet", "--depth", "1",
                REFERENCE_REPOSITORY, f"refs/tags/{tag}", external=True)
    session.run("git", "-C", str(clone), "checkout", "--quiet", "FETCH_HEAD", external=True)
    return clone / "bindings" / "python" / "tests"


@nox.session(python=PYTHONS[-1])
def macos(session):
    """Compile the core for macOS, x86-64 and arm64, with Zig's C compiler: the C that
    Cython generates from the checkout (setup.py imported, not run), each extension
    with the flags setup.py gives it, warnings as errors. Python's headers are this
    interpreter's, NumPy's the installed NumPy's with its Linux-only <endian.h> taken
    out. Nothing is linked or run: what only macOS runs (fastst/_core/platform.h's
    macOS branches) is compiled here, and tested nowhere yet."""
    session.install(ZIG, "cython>=3.0.10", "numpy>=2.0", "setuptools>=77")
    work = pathlib.Path(session.create_tmp()).resolve()
    # The C is generated in a copy: it depends on the NumPy installed (its .pxd), and the
    # checkout's own build would take it as up to date.
    source = work / "source"
    shutil.rmtree(source, ignore_errors=True)
    shutil.copytree(ROOT / "fastst" / "_core", source / "fastst" / "_core",
                    ignore=shutil.ignore_patterns("*.c", "*.so", "__pycache__"))
    shutil.copy(ROOT / "fastst" / "__init__.py", source / "fastst")
    shutil.copy(ROOT / "setup.py", source)
    with session.chdir(source):
        found = session.run("python", "-c", CORE_EXTENSIONS, silent=True)
    extensions = json.loads(found.strip().splitlines()[-1])
    numpy_headers = macos_numpy_headers(work, extensions[0]["numpy"])
    for target in MACOS_TARGETS:
        for extension in extensions:
            session.log(f"{extension['name']} for {target}")
            session.run("python", "-m", "ziglang", "cc", "-target", target, "-c",
                        *MACOS_STRICT, *extension["flags"],
                        *(f"-D{name}={value}" for name, value in extension["macros"]),
                        f"-I{source / 'fastst' / '_core'}", f"-I{numpy_headers}",
                        f"-I{extension['python']}", str(source / extension["source"]),
                        "-o", str(work / f"{extension['name']}-{target}.o"))


# What `nox -s macos` compiles: each extension of setup.py (imported, which generates
# the C), as JSON on the last line.
CORE_EXTENSIONS = """
import json, sysconfig, numpy, setup
print(json.dumps([{"name": built.name, "source": built.sources[0],
                   "flags": built.extra_compile_args, "macros": built.define_macros,
                   "numpy": numpy.get_include(),
                   "python": sysconfig.get_paths()["include"]} for built in setup.extensions]))
"""


def macos_numpy_headers(work, numpy_include):
    """A copy of NumPy's headers in `work`, its configuration without the <endian.h>
    that NumPy's Linux build found and macOS lacks (NumPy's macOS build leaves it out);
    the folder to include."""
    copy = work / "numpy-include"
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(numpy_include, copy)
    config = copy / "numpy" / "_numpyconfig.h"
    config.write_text(config.read_text().replace("#define NPY_HAVE_ENDIAN_H 1", ""))
    return copy


def check_contents(session, sdist, wheel):
    """The sdist has what the build reads and no generated C; the wheel has the compiled
    core, the stubs, the license and the switch's .pth file, and none of the core's
    sources."""
    with tarfile.open(sdist) as archive:
        in_sdist = {name.split("/", 1)[1] for name in archive.getnames() if "/" in name}
    with zipfile.ZipFile(wheel) as archive:
        in_wheel = set(archive.namelist())
    needed = {"LICENSE", "README.md", "setup.py", "pyproject.toml", "fastst-safetensors.pth"} | {
        f"fastst/_core/{path.name}" for path in (ROOT / "fastst" / "_core").iterdir()
        if path.suffix in (".pyx", ".pxd", ".pxi", ".h")}
    problems = [f"sdist lacks {name}" for name in sorted(needed - in_sdist)]
    problems += [f"sdist has {name}" for name in sorted(in_sdist)
                 if name.endswith(".c") or name.startswith("tests/")]
    problems += [f"wheel has {name}" for name in sorted(in_wheel)
                 if name.endswith((".pyx", ".pxd", ".pxi", ".c", ".h"))]
    if "fastst-safetensors.pth" not in in_wheel:     # at the root: pip installs it beside fastst
        problems.append("wheel lacks fastst-safetensors.pth")
    for wanted in ("fastst/py.typed", "fastst/_core/__init__.pyi", "fastst/_core/reader.pyi",
                   "fastst/_core.cpython-", "fastst/_core/_ring.cpython-", "/licenses/LICENSE"):
        if not any(wanted in name for name in in_wheel):
            problems.append(f"wheel lacks {wanted}")
    if problems:
        session.error("; ".join(problems))
    session.log(f"{sdist.name}: {len(in_sdist)} files; {wheel.name}: {len(in_wheel)} files")
