"""Build hook for the C hot path; all metadata lives in pyproject.toml."""
from setuptools import Extension, setup

setup(ext_modules=[Extension("ps_server._fastpath", ["ps_server/_fastpath.c"],
                             extra_compile_args=["-O3", "-Wall", "-Wno-unused-function"])])
