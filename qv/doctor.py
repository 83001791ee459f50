"""`qv doctor`: what this machine offers qv. Versions, devices (compute capability, CUDA runtime), the CUDA
toolchain (NVRTC through CuPy and from the nvidia wheels, Triton's backend), which kernels the `kernels`
lever picks on each device, whether the sm70 kernels build (on each device whose chain runs them, or ahead
of time for sm_70 on a machine without CUDA), and where compiled kernels are cached. Every probe reports
its own failure as a line, so the report always prints (a CPU machine without CUDA included)."""

from __future__ import annotations

import functools
import importlib.metadata
import platform
import sys
from collections.abc import Callable

from qv.config import ConfigError, EngineConfig, env_name, kernel_cache_dirs, state_path
from qv.version import __version__

PACKAGES = ("torch", "triton", "cupy-cuda12x", "cupy-cuda13x", "cupy", "transformers", "tokenizers", "safetensors",
            "numpy", "pydantic", "pydantic-settings", "starlette", "uvicorn", "pillow")


def _probe(fn: Callable[[], list[str]]) -> list[str]:
    try:
        return fn()
    except Exception as e:  # noqa: BLE001 - a failing probe is itself the finding
        return [f"  error: {type(e).__name__}: {e}"]


def _packages() -> list[str]:
    found = []
    for name in PACKAGES:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            if not name.startswith("cupy"):
                found.append(f"{name} not installed")
    if not any(f.startswith("cupy") for f in found):
        found.append("cupy not installed (the `gpu` extra: raw-CUDA decode kernels)")
    return ["  " + ", ".join(found)]


def _devices() -> list[str]:
    import torch

    lines = [f"  torch {torch.__version__}, built for CUDA {torch.version.cuda or 'none (CPU build)'}"]
    if not torch.cuda.is_available():
        lines.append("  CUDA: no device available (qv runs on the CPU with the reference kernels)")
        if torch.version.cuda:
            lines.append(f"  note: this torch is a CUDA {torch.version.cuda} build (its CUDA libraries take gigabytes) "
                         "on a machine with no GPU; torch's CPU wheels do the same work here: pip install torch "
                         "--index-url https://download.pytorch.org/whl/cpu")
        return lines
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        free, total = torch.cuda.mem_get_info(i)
        lines.append(f"  cuda:{i} {torch.cuda.get_device_name(i)}, compute capability {major}.{minor} "
                     f"(sm_{major}{minor}), {free / (1 << 30):.1f} GiB free of {total / (1 << 30):.1f} GiB")
    from qv.kernels.cuda_build import cupy_or_none

    cupy = cupy_or_none()
    if cupy is not None:
        version = lambda v: f"{v // 1000}.{v % 1000 // 10}"  # noqa: E731 - CUDA's 12080 -> 12.8
        lines.append(f"  CUDA runtime {version(cupy.cuda.runtime.runtimeGetVersion())} (CuPy's), "
                     f"driver supports {version(cupy.cuda.runtime.driverGetVersion())}")
    return lines


def _toolchain() -> list[str]:
    lines = []
    try:
        import triton
        from triton import knobs

        if knobs.runtime.interpret:
            mode = "interpreter (TRITON_INTERPRET=1: kernels run on the CPU, slowly)"
        else:
            try:
                mode = f"backend {triton.runtime.driver.active.get_current_target().backend}"
            except Exception as e:  # noqa: BLE001 - no GPU driver: Triton can compile nothing here
                mode = f"no active GPU driver ({type(e).__name__})"
        lines.append(f"  Triton {triton.__version__}: {mode}")
    except ImportError as e:
        lines.append(f"  Triton: not importable ({e})")
    from qv.kernels.cuda_build import cupy_or_none

    cupy = cupy_or_none()
    if cupy is None:
        lines.append("  CuPy / NVRTC: CuPy not installed (install the `gpu` extra for the raw-CUDA decode kernels)")
    else:
        try:
            major, minor = cupy.cuda.nvrtc.getVersion()
            lines.append(f"  CuPy {cupy.__version__}, NVRTC {major}.{minor}")
        except Exception as e:  # noqa: BLE001 - a CuPy without a usable NVRTC
            lines.append(f"  CuPy {cupy.__version__}, NVRTC unavailable ({type(e).__name__}: {e})")
    from qv.kernels import ahead_of_time

    lib = ahead_of_time.load_nvrtc(12)
    if lib is None:
        lines.append("  NVRTC 12 (sm_70 builds ahead of time): not installed "
                     f"(pip install {ahead_of_time.NVRTC_PACKAGE})")
    else:
        lines.append("  NVRTC {}.{} from the nvidia wheels (sm_70 builds ahead of time)".format(
            *ahead_of_time.nvrtc_version(lib)))
    return lines


def _kernels(choice: str) -> list[str]:
    import torch

    from qv.kernels import registry
    from qv.kernels.cuda_build import cupy_or_none

    devices = [torch.device("cpu")] + [torch.device(f"cuda:{i}") for i in range(torch.cuda.device_count())]
    lines = []
    with registry.backend(choice):
        for dev in devices:
            chain = " -> ".join(registry.chain_for(dev))
            line = f"  {dev}: kernels={choice} runs {chain}"
            if dev.type == "cuda" and "sm70" in registry.chain_for(dev):
                line += f"; raw-CUDA m8n8k4 kernels {'available' if cupy_or_none() else 'off (needs CuPy)'}"
            elif dev.type == "cuda":
                raw = torch.cuda.get_device_capability(dev)[0] >= 8 and cupy_or_none() is not None
                line += f"; raw-CUDA decode GEMV and attention {'available' if raw else 'off (needs sm_80+ and CuPy)'}"
            lines.append(line)
    return lines


@functools.lru_cache(maxsize=4)
def _sm70_reports(ptxas: str):
    """The sm70 kernels compiled ahead of time for sm_70, once a process (a report is cheap to ask again)."""
    from qv.kernels import ahead_of_time

    return ahead_of_time.compile_all(70, ptxas=ptxas)


def _kernel_builds(choice: str, ptxas: str) -> list[str]:
    """Whether each kernel in the BUILDS of the sm70 modules builds: with CuPy on each CUDA device whose
    chain runs them, or, on a machine without CUDA, ahead of time for sm_70 (NVRTC 12 and ptxas)."""
    import torch

    from qv.kernels import ahead_of_time, registry
    from qv.kernels.cuda_build import build, cupy_or_none

    builds = ahead_of_time.sm70_builds()
    if not torch.cuda.is_available():
        lines = ["  no CUDA device: the sm70 kernels compiled ahead of time for sm_70"]
        try:
            reports = _sm70_reports(ptxas)
        except ahead_of_time.AheadOfTimeError as e:
            return lines + [f"  does not build: {e}"]
        return lines + [f"  {r.name} ({r.op}): builds, {r.registers} registers, {r.shared_bytes} B shared memory, "
                        f"{r.spill_bytes} spill bytes, {r.mma_m8n8k4} m8n8k4 MMAs" for r in reports]
    lines = []
    with registry.backend(choice):
        for i in range(torch.cuda.device_count()):
            if "sm70" not in registry.chain_for(torch.device(f"cuda:{i}")):
                lines.append(f"  cuda:{i}: its chain runs no sm70 kernels")
                continue
            if cupy_or_none() is None:
                lines.append(f"  cuda:{i}: CuPy not installed (the `gpu` extra): the sm70 kernels cannot build")
                continue
            for op, b in builds:
                for name in b.names:
                    built = build(b.source, name, i)
                    status = f"builds, {built[1]} registers" if built is not None else "does NOT build"
                    lines.append(f"  cuda:{i} {name} ({op}): {status}")
    return lines


def report(environ=None) -> str:
    """The whole report, as text."""
    try:
        cfg = EngineConfig.from_env(environ)
        levers = [f"  {env_name(n)}={'***' if n == 'api_key' else getattr(cfg, n)!r}"
                  for n, info in EngineConfig.model_fields.items() if getattr(cfg, n) != info.default]
        levers = levers or ["  none set (every lever at its default)"]
    except ConfigError as e:
        cfg, levers = EngineConfig(), [f"  error: {e}"]
    out = [f"qv {__version__} on Python {sys.version.split()[0]}, {platform.platform()}", "packages:"]
    out += _probe(_packages) + ["devices:"] + _probe(_devices) + ["toolchain:"] + _probe(_toolchain)
    out += ["kernels (which implementations run):"] + _probe(lambda: _kernels(cfg.kernels))
    out += ["kernel builds (the sm70 modules' BUILDS):"] + _probe(lambda: _kernel_builds(cfg.kernels, cfg.ptxas))
    caches = kernel_cache_dirs(cfg.state_dir)
    out += ["state:", f"  state dir {state_path(cfg.state_dir)}"] + [f"  {k}={v}" for k, v in caches.items()]
    out += ["levers from the environment:"] + levers
    return "\n".join(out)
