"""Compiling qv's raw-CUDA kernels without a GPU, for `qv kernels --arch sm_70` and `qv doctor`.

NVRTC from the nvidia wheels, loaded through ctypes (CUDA 12's for sm_70: CUDA 13 dropped Volta), compiles
each template instantiation that an op's sm70 module lists in BUILDS (cuda_build.KernelBuild) to PTX, with
the options the run-time build uses; ptxas (the CUDA 12.9 one Triton's wheel carries, or one the caller
names) assembles that PTX for the GPU and reports registers, shared memory and spills. One NVRTC program per
instantiation, so each PTX holds one kernel.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from qv.kernels.cuda_build import COMPILE_OPTIONS, KernelBuild, source_text

NVRTC_PACKAGE = "nvidia-cuda-nvrtc-cu12"
MMA_M8N8K4 = "mma.sync.aligned.m8n8k4"


class AheadOfTimeError(RuntimeError):
    """A missing tool or a kernel that does not build; the message is one line that says which."""


@dataclass(frozen=True)
class KernelReport:
    """One instantiation compiled for one GPU architecture."""

    op: str
    source: str
    name: str  # the NVRTC name expression, e.g. "gptq_gemv_m884<1, 3>"
    tensor_cores: bool  # its build promises m8n8k4 MMAs
    registers: int
    shared_bytes: int  # static shared memory
    spill_bytes: int  # spill stores + spill loads
    stack_bytes: int
    mma_m8n8k4: int  # m8n8k4 MMA instructions in the PTX
    ptx: str

    @property
    def file_name(self) -> str:
        """The kernel's .ptx name: the expression with its punctuation as underscores."""
        return re.sub(r"_+", "_", re.sub(r"[^A-Za-z0-9]", "_", self.name)).strip("_") + ".ptx"


def _nvidia_roots() -> list[str]:
    """Folders holding the nvidia-* wheels' packages (nvidia/<component>/lib)."""
    roots = [os.path.join(p, "nvidia") for p in sys.path if p.endswith("site-packages")]
    try:
        import nvidia

        roots = list(nvidia.__path__) + roots
    except ImportError:
        pass
    return list(dict.fromkeys(r for r in roots if os.path.isdir(r)))


@functools.lru_cache(maxsize=None)
def load_nvrtc(major: int | None = None):
    """libnvrtc of CUDA `major` (any: None) through ctypes, its builtins library loaded first so that NVRTC
    finds it; None if none is installed."""
    suffix = f".so.{major}" if major is not None else ".so.*"
    for root in _nvidia_roots():
        for lib in sorted(glob.glob(os.path.join(root, "*", "lib", f"libnvrtc{suffix}"))):
            folder = os.path.dirname(lib)
            try:
                for builtins in glob.glob(os.path.join(folder, "libnvrtc-builtins.so.*")):
                    if ".alt." not in builtins:
                        ctypes.CDLL(builtins, mode=ctypes.RTLD_GLOBAL)
                return ctypes.CDLL(lib)
            except OSError:
                continue
    return None


def nvrtc_version(lib) -> tuple[int, int]:
    major, minor = ctypes.c_int(), ctypes.c_int()
    lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return major.value, minor.value


def compile_ptx(lib, code: str, names: list[str], arch: int) -> tuple[int, str, bytes]:
    """NVRTC on `code` with the template instantiations `names` and the options cuda_build compiles with, for
    compute_`arch`: (return code, log, PTX)."""
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), code.encode(), b"kernel.cu", 0, None, None) != 0:
        raise AheadOfTimeError("NVRTC could not create a program")
    for name in names:
        lib.nvrtcAddNameExpression(prog, name.encode())
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
    return rc, log.value.decode(errors="replace"), ptx


def nvrtc_for(arch: int):
    """CUDA 12's NVRTC (the last to target sm_70; newer GPUs compile with it too), or AheadOfTimeError."""
    lib = load_nvrtc(12)
    if lib is None:
        raise AheadOfTimeError(f"NVRTC 12 not found (needed for sm_{arch}): pip install {NVRTC_PACKAGE}")
    return lib


def find_ptxas(path: str = "") -> str:
    """`path` if given, else the ptxas in Triton's wheel; AheadOfTimeError if there is none."""
    if path:
        if not os.access(path, os.X_OK):
            raise AheadOfTimeError(f"ptxas {path!r} (the ptxas lever) is not an executable file")
        return path
    try:
        import triton
    except ImportError:
        raise AheadOfTimeError("ptxas not found: pip install triton (its wheel carries ptxas), or set QV_PTXAS")
    found = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    if not os.access(found, os.X_OK):
        raise AheadOfTimeError(f"ptxas not found at {found}: pip install triton (its wheel carries ptxas), "
                               "or set QV_PTXAS")
    return str(found)


def sm70_builds() -> list[tuple[str, KernelBuild]]:
    """(op, build) for every op of registry.TABLE whose sm70 module lists BUILDS (a module shared by ops
    counts once)."""
    from qv.kernels import registry

    seen, out = set(), []
    for op, row in registry.TABLE.items():
        path = row.get("sm70")
        if path is None or path in seen:
            continue
        seen.add(path)
        out += [(op, build) for build in getattr(importlib.import_module(f"qv.kernels.{path}"), "BUILDS", ())]
    return out


def _first_error(log: str) -> str:
    lines = [line.strip() for line in log.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower()]
    return (errors or lines or ["(no log)"])[0]


def _ptxas_report(ptxas: str, ptx: bytes, arch: int) -> dict[str, int]:
    """ptxas -v on one kernel's PTX: its registers, static shared memory, spill and stack bytes."""
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        Path(src).write_bytes(ptx)
        run = subprocess.run([ptxas, f"-arch=sm_{arch}", "-v", src, "-o", os.path.join(tmp, "kernel.cubin")],
                             capture_output=True, text=True)
    if run.returncode != 0:
        raise AheadOfTimeError(f"ptxas: {_first_error(run.stderr + run.stdout)}")
    info = run.stderr + run.stdout

    def number(pattern: str) -> int:
        found = re.findall(pattern, info)
        return sum(int(v) for v in found)

    registers = re.search(r"Used (\d+) registers", info)
    if registers is None:
        raise AheadOfTimeError(f"ptxas -v printed no register count: {_first_error(info)}")
    return dict(registers=int(registers.group(1)), shared_bytes=number(r"(\d+) bytes smem"),
                spill_bytes=number(r"(\d+) bytes spill stores") + number(r"(\d+) bytes spill loads"),
                stack_bytes=number(r"(\d+) bytes stack frame"))


def compile_kernel(op: str, build: KernelBuild, name: str, arch: int, ptxas: str) -> KernelReport:
    """One instantiation through NVRTC and ptxas; AheadOfTimeError naming it if either fails."""
    rc, log, ptx = compile_ptx(nvrtc_for(arch), source_text(build.source), [name], arch)
    if rc != 0:
        raise AheadOfTimeError(f"{name} ({build.source}) does not compile for compute_{arch}: {_first_error(log)}")
    try:
        stats = _ptxas_report(ptxas, ptx, arch)
    except AheadOfTimeError as e:
        raise AheadOfTimeError(f"{name} ({build.source}) for sm_{arch}: {e}") from None
    text = ptx.decode()
    return KernelReport(op, build.source, name, build.tensor_cores, mma_m8n8k4=text.count(MMA_M8N8K4), ptx=text,
                        **stats)


def compile_all(arch: int = 70, out_dir: str | None = None, ptxas: str = "") -> list[KernelReport]:
    """Every sm70 BUILDS instantiation compiled for sm_`arch`; with out_dir, each kernel's PTX written
    there as <name>.ptx."""
    tool = find_ptxas(ptxas)
    nvrtc_for(arch)
    reports = [compile_kernel(op, build, name, arch, tool) for op, build in sm70_builds() for name in build.names]
    if out_dir is not None:
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        for r in reports:
            (Path(out_dir) / r.file_name).write_text(r.ptx)
    return reports


def parse_arch(text: str) -> int:
    """'sm_70' (or '70') -> 70; AheadOfTimeError for anything else or below sm_70 (no m8n8k4 there)."""
    found = re.fullmatch(r"(?:sm_)?(\d{2,3})", text.strip())
    if found is None or int(found.group(1)) < 70:
        raise AheadOfTimeError(f"--arch {text!r}: expected sm_NN with NN >= 70 (e.g. sm_70)")
    return int(found.group(1))


def table(reports: list[KernelReport]) -> str:
    """The reports as an aligned text table."""
    head = ("kernel", "op", "registers", "shared memory (B)", "spill bytes", "m8n8k4 MMAs (PTX)")
    rows = [(r.name, r.op, str(r.registers), str(r.shared_bytes), str(r.spill_bytes), str(r.mma_m8n8k4))
            for r in reports]
    widths = [max(len(row[i]) for row in [head, *rows]) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) if i < 2 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in [head, *rows]]
    return "\n".join([lines[0], "  ".join("-" * w for w in widths), *lines[1:]])
