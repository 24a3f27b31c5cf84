"""Build the compiled core. FASTST_DEBUG=1 turns Cython's bounds checks back on."""
import os

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

DEBUG = os.environ.get("FASTST_DEBUG") == "1"

directives = {
    "language_level": 3,
    "boundscheck": DEBUG,
    "wraparound": DEBUG,
    "initializedcheck": DEBUG,
    "cdivision": True,
    "embedsignature": True,
    "freethreading_compatible": True,
}

extension = Extension(
    "fastst._core",
    ["fastst/_core.pyx"],
    # Everything the build reads; listed here, it also goes into the sdist.
    depends=[os.path.join("fastst", name) for name in sorted(os.listdir("fastst"))
             if name.endswith((".pyx", ".pxi", ".h"))],
    include_dirs=[numpy.get_include()],
    # NumPy 2.0's C API, which the runtime requires: the allocation handler functions
    # (PyDataMem_SetHandler) are not declared for a target older than NumPy 1.22, which
    # the headers of some NumPy 2 releases take by default.
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION"),
                   ("NPY_TARGET_VERSION", "NPY_2_0_API_VERSION")],
    extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
)

extensions = cythonize([extension], compiler_directives=directives)
# cythonize adds NumPy's headers to what the core depends on, by absolute paths: not
# files of the sdist (setuptools warns about each), and the build finds them anyway.
for built in extensions:
    built.depends = [path for path in built.depends if not os.path.isabs(path)]
setup(ext_modules=extensions)
