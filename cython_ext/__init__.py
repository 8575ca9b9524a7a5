"""Compiled CPU optimizer kernels (see cpu_adam.pyx).

    from zero_offload.kernels.cpu_adam import adam_step, simd_level, openmp_enabled
"""
