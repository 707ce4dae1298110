"""Build hook for the C hot path; all metadata lives in pyproject.toml."""
from setuptools import Extension, setup

FLAGS = ["-O3", "-Wall", "-Wno-unused-function"]
setup(ext_modules=[Extension("thc_ps.ps_server._fastpath", ["ps_server/_fastpath.c"],
                             depends=["proto/udpio.h", "proto/lanes.h"], extra_compile_args=FLAGS),
                   Extension("thc_ps.worker._batchio", ["worker/_batchio.c"], extra_compile_args=FLAGS),
                   Extension("bench._udpbench", ["bench/_udpbench.c"], extra_compile_args=FLAGS),
                   Extension("thc_ps.compression._bitstream", ["compression/_bitstream.c"], extra_compile_args=FLAGS),
                   Extension("thc_ps.compression._kernels", ["compression/_kernels.c"],
                             depends=["compression/_rht_passes.h", "proto/lanes.h"],
                             # exact float32 results in every build: no a*b+c contraction
                             extra_compile_args=FLAGS + ["-ffp-contract=off"])])
