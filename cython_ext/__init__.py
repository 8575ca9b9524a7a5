"""Compiled CPU optimizer kernels (see cpu_adam.pyx).

    from cython_ext.cpu_adam import adam_step, simd_level, openmp_enabled
"""
