"""Build of the codec's C extension (everything else is in pyproject.toml).

Compile flags stay generic (no -march=native): the wheel runs on any x86-64 or aarch64;
_xg_simd.c and _b3.c pick their instructions per function, and the CPU is checked at run time.
"""

import sys

from setuptools import Extension, setup

if sys.platform == "win32":
    _CFLAGS = ["/O2", "/std:c11"]
else:
    _CFLAGS = ["-O3", "-std=c11", "-Wall", "-Wextra",
               "-Wno-missing-field-initializers"]

setup(
    ext_modules=[
        Extension(
            "swarm.delta._xg",
            sources=["swarm/delta/_xg_module.c", "swarm/delta/_xg_simd.c",
                     "swarm/delta/_b3.c"],
            depends=["swarm/delta/_xg.h"],
            extra_compile_args=_CFLAGS,
        ),
    ],
)
