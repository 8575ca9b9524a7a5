"""Build the Cython kernel ahead of time, with OpenMP when the compiler has it.

Nothing is compiled at import or at run time.  Without OpenMP the extension is
still built (single-threaded) and a loud warning is printed; at run time
zero_offload.kernels.cpu_adam.openmp_enabled() then returns False.
"""
import os
import shutil
import subprocess
import sys
import tempfile

from Cython.Build import cythonize
from setuptools import Extension, setup


def _compiler_has_openmp() -> bool:
    if os.environ.get("ZERO_OFFLOAD_NO_OPENMP"):
        return False
    cc = os.environ.get("CC", "cc")
    if shutil.which(cc) is None:
        return False
    src = "#include <omp.h>\nint main(void){return omp_get_max_threads() > 0 ? 0 : 1;}\n"
    with tempfile.TemporaryDirectory() as d:
        c = os.path.join(d, "t.c")
        with open(c, "w") as f:
            f.write(src)
        r = subprocess.run([cc, "-fopenmp", c, "-o", os.path.join(d, "t")], capture_output=True)
        return r.returncode == 0


# No -march=native: the wheel must run on any x86-64; the SIMD paths carry
# target attributes and are picked at run time.  -ffp-contract=off keeps the
# vector and scalar paths bitwise identical (no FMA contraction in either).
compile_args = ["-O3", "-ffp-contract=off", "-fno-math-errno"]
link_args = []
if _compiler_has_openmp():
    compile_args.append("-fopenmp")
    link_args.append("-fopenmp")
else:
    bar = "!" * 78
    print(f"\n{bar}\nWARNING: the C compiler has no OpenMP; cython_ext.cpu_adam is built\n"
          f"single-threaded (openmp_enabled() == False). Install libomp / use gcc to fix.\n{bar}\n",
          file=sys.stderr)

ext = Extension(
    "zero_offload.kernels.cpu_adam",  # built into cython_ext/ (pyproject maps the package there)
    sources=["cython_ext/cpu_adam.pyx"],
    include_dirs=["cython_ext"],
    extra_compile_args=compile_args,
    extra_link_args=link_args,
    depends=["cython_ext/_kernels.h", "cython_ext/_kernels_int8.h"],
)

setup(ext_modules=cythonize([ext], language_level=3))
