"""Reading checkpoints: safetensors (single or sharded), dense and GPTQ-int8 linears.

`CheckpointReader` hands out tensors by checkpoint name, remembers which were used, and turns a
module prefix into a dense weight or a `GPTQWeight` (repacked to qv's runtime layout) depending
on what the checkpoint stores for it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from qv.config import ConfigError, ModelConfig
from qv.kernels.linear import GPTQWeight


class CheckpointError(ValueError):
    """A checkpoint that does not match its config; the message names the tensor or file."""


class CheckpointReader:
    def __init__(self, model_dir: str | Path, cfg: ModelConfig):
        self.dir = Path(model_dir)
        self.cfg = cfg
        self.files = _index_files(self.dir)  # tensor name -> file
        self._handles: dict[Path, object] = {}
        self.used: set[str] = set()

    def names(self) -> list[str]:
        return sorted(self.files)

    def has(self, name: str) -> bool:
        return name in self.files

    def _handle(self, path: Path):
        if path not in self._handles:
            self._handles[path] = safe_open(str(path), framework="pt")
        return self._handles[path]

    def tensor(self, name: str, dtype: torch.dtype | None = None, device: torch.device | str = "cpu",
               shape: tuple[int, ...] | None = None) -> torch.Tensor:
        if name not in self.files:
            raise CheckpointError(f"checkpoint {self.dir} lacks tensor {name!r}")
        t = self._handle(self.files[name]).get_tensor(name)
        if shape is not None and tuple(t.shape) != tuple(shape):
            raise CheckpointError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        self.used.add(name)
        return t.to(device=device, dtype=dtype or t.dtype)

    def linear(self, prefix: str, out_features: int, in_features: int, dtype: torch.dtype,
               device: torch.device | str = "cpu") -> torch.Tensor | GPTQWeight:
        """The weight of module `prefix`: dense [N, K] in `dtype`, or GPTQWeight if stored quantized."""
        if self.has(f"{prefix}.qweight"):
            return self._gptq(prefix, out_features, in_features, dtype, device)
        if not self.has(f"{prefix}.weight"):
            raise CheckpointError(f"checkpoint {self.dir} has neither {prefix}.weight nor {prefix}.qweight")
        w = self.tensor(f"{prefix}.weight", shape=(out_features, in_features))
        if w.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise CheckpointError(f"{prefix}.weight has dtype {w.dtype}; dense weights must be fp32/fp16/bf16")
        return w.to(device=device, dtype=dtype)

    def _gptq(self, prefix: str, n: int, k: int, dtype: torch.dtype, device) -> GPTQWeight:
        q = self.cfg.quant
        if q is None:
            raise CheckpointError(f"{prefix}.qweight is stored but config.json has no quantization_config")
        qweight = self.tensor(f"{prefix}.qweight")
        if qweight.dtype != torch.int32 or tuple(qweight.shape) != (k // 4, n):
            raise CheckpointError(f"{prefix}.qweight: {qweight.dtype} {tuple(qweight.shape)}, expected int32 {(k // 4, n)}")
        group = k if q.group_size == -1 else q.group_size
        if k % group:
            raise CheckpointError(f"{prefix}: group_size {group} does not divide in_features {k}")
        n_groups = k // group
        scales = self.tensor(f"{prefix}.scales", shape=(n_groups, n))
        codes = qweight.contiguous().view(torch.uint8).view(k // 4, n, 4).permute(0, 2, 1).reshape(k, n)
        zeros = None
        if self.has(f"{prefix}.qzeros"):
            qz = self.tensor(f"{prefix}.qzeros", shape=(n_groups, n // 4))
            z = qz.contiguous().view(torch.uint8).view(n_groups, n).to(torch.int32)
            if q.checkpoint_format == "gptq":
                z = z + 1  # v1 stores zero - 1
            if not (q.sym and bool((z == 128).all())):
                zeros = z.to(dtype)
        elif not q.sym:
            raise CheckpointError(f"{prefix}: asymmetric GPTQ (sym=false) needs {prefix}.qzeros")
        if self.has(f"{prefix}.g_idx"):
            g_idx = self.tensor(f"{prefix}.g_idx", shape=(k,)).to(torch.int32)
        else:
            g_idx = torch.arange(k, dtype=torch.int32) // group
        if self.has(f"{prefix}.bias"):
            self.used.add(f"{prefix}.bias")  # GPTQ writers emit a zero bias for bias-less layers
        return GPTQWeight(codes.to(device), scales.to(device=device, dtype=dtype),
                          None if zeros is None else zeros.to(device), g_idx.to(device), group)

    def unused(self, ignore_prefixes: tuple[str, ...] = ()) -> list[str]:
        return [n for n in self.names() if n not in self.used and not n.startswith(ignore_prefixes)]


def _index_files(model_dir: Path) -> dict[str, Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        missing = sorted({v for v in weight_map.values() if not (model_dir / v).is_file()})
        if missing:
            raise CheckpointError(f"missing shard(s) listed in {index.name}: {', '.join(missing)}")
        return {name: model_dir / fname for name, fname in weight_map.items()}
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ConfigError(f"no *.safetensors files in {model_dir}")
    out: dict[str, Path] = {}
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                out[name] = path
    return out
