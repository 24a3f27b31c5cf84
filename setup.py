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
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_2_0_API_VERSION")],
    extra_compile_args=["-O0", "-g"] if DEBUG else ["-O3"],
)

setup(ext_modules=cythonize([extension], compiler_directives=directives))
