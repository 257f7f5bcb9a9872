"""Builds the optional C accelerator; everything else is declared in pyproject.toml.

``optional=True``: on a machine without a C compiler the build goes on without it,
and equeue runs its pure-Python paths (see equeue/speedups.py).
"""

from glob import glob

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "equeue._speedups",
            sorted(glob("equeue/cext/*.c")),
            depends=sorted(glob("equeue/cext/*.h")),
            # -pthread: prefault.c starts a thread (glibc before 2.34 keeps it in libpthread).
            # -Werror=implicit-function-declaration: a C API a newer Python no longer
            # declares (3.13's _PyObject_LookupAttr) fails the build here, not the import.
            extra_compile_args=[
                "-O2",
                "-Wall",
                "-Wextra",
                "-Wno-unused-parameter",
                "-Werror=implicit-function-declaration",
                "-pthread",
            ],
            extra_link_args=["-pthread"],
            optional=True,
        )
    ]
)
