"""Compiling qv's raw-CUDA kernels on a machine without a GPU, for the oracle tests' compile checks (sm_80
and sm_90 PTX): the package's NVRTC-through-ctypes (qv/kernels/ahead_of_time.py), any CUDA version."""

from __future__ import annotations

from qv.kernels.ahead_of_time import compile_ptx, load_nvrtc

__all__ = ["compile_ptx", "nvrtc"]


def nvrtc():
    """libnvrtc through ctypes (from the CUDA wheels that come with torch), or None."""
    return load_nvrtc(None)
