"""Compiling qv's raw-CUDA kernels on a machine without a GPU: libnvrtc from the CUDA wheels that come with
torch, through ctypes, for the oracle tests' compile checks (sm_80 and sm_90 PTX)."""

from __future__ import annotations

import ctypes
import glob
import os
import sys

from qv.kernels.cuda_build import COMPILE_OPTIONS


def nvrtc():
    """libnvrtc through ctypes (its builtins library loaded first so NVRTC finds it), or None."""
    roots = [p for p in sys.path if p.endswith("site-packages")]
    for root in roots:
        for lib in sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", "libnvrtc.so.*"))):
            folder = os.path.dirname(lib)
            try:
                for builtins in glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*")):
                    if ".alt." not in builtins:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(lib)
            except OSError:
                continue
    return None


def compile_ptx(lib, code: str, names: list[str], arch: int) -> tuple[int, str, bytes]:
    """NVRTC on `code` with the template instantiations `names` and the options cuda_build compiles with:
    (return code, log, PTX)."""
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None) == 0
    for name in names:
        assert lib.nvrtcAddNameExpression(prog, name.encode()) == 0
    opts = [f"--gpu-architecture=compute_{arch}".encode(), *(o.encode() for o in COMPILE_OPTIONS)]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    ptx = b""
    if rc == 0:
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        buf = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, buf)
        ptx = buf.value
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    return rc, log.value.decode(), ptx
