"""vLLM's spellings of `qv serve | generate | bench` flags. Each one that has a qv equivalent sets that lever
(the namespace attribute of the lever's own flag, so the later of the two on a command line wins); each one
that has none is refused with the reason, never "unrecognized", so a vLLM command line either means the same
here or says why not."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable

# vLLM's --kv-cache-dtype values -> qv's kv_dtype; fp8 has no qv storage
KV_CACHE_DTYPES = {"auto": "auto", "int8": "int8", "bfloat16": "bf16", "bf16": "bf16", "float16": "fp16",
                   "fp16": "fp16", "half": "fp16"}
# vLLM's speculative_config methods -> qv's spec
SPEC_METHODS = {"mtp": "mtp", "qwen3_next_mtp": "mtp", "qwen3_5_mtp": "mtp", "ngram": "ngram"}
MODALITIES = {"image": "media_max_images", "video": "media_max_videos"}
# vLLM's human-readable ints: lower-case suffixes decimal, upper-case binary (its --kv-cache-memory-bytes)
SIZE_SUFFIXES = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


class SetLevers(argparse.Action):
    """Sets the levers `convert(value)` returns; a value it refuses (ValueError) ends the parse with the reason."""

    def __init__(self, option_strings, dest, convert: Callable, **kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kw)
        self.convert = convert

    def __call__(self, parser, namespace, values, option_string=None):
        try:
            levers = self.convert(values)
        except ValueError as e:
            parser.error(f"{option_string}: {e}")
        for name, value in levers.items():
            setattr(namespace, name, value)


class NoEquivalent(argparse.Action):
    """A vLLM flag qv has no lever for: refused with what to do instead."""

    def __init__(self, option_strings, dest, reason: str, **kw):
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, **kw)
        self.reason = reason

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} (vLLM's) has no qv equivalent: {self.reason}")


def kv_cache_dtype(value: str) -> dict:
    if value.startswith("fp8"):
        raise ValueError(f"{value!r}: qv has no fp8 KV cache; its 8-bit KV cache is int8 (--kv-cache-dtype int8)")
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"{value!r} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return {"kv_dtype": KV_CACHE_DTYPES[value]}


def speculative_config(text: str) -> dict:
    try:
        conf = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"not JSON ({e})") from None
    if not isinstance(conf, dict):
        raise ValueError("takes a JSON object such as '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'")
    unknown = sorted(set(conf) - {"method", "num_speculative_tokens"})
    if unknown:
        raise ValueError(f"qv has no equivalent of {', '.join(unknown)}: it drafts with the checkpoint's MTP head "
                         "or prompt n-grams (method), num_speculative_tokens per step")
    method = conf.get("method", "mtp")
    if method not in SPEC_METHODS:
        raise ValueError(f"method {method!r}: qv drafts with {', '.join(SPEC_METHODS)} only")
    out = {"spec": SPEC_METHODS[method]}
    if "num_speculative_tokens" in conf:
        out["spec_k"] = conf["num_speculative_tokens"]
    return out


def limit_mm_per_prompt(text: str) -> dict:
    try:
        conf = json.loads(text)
    except json.JSONDecodeError:  # vLLM's older spelling: image=4,video=1
        pairs = [p.split("=", 1) for p in text.split(",") if p.strip()]
        if not all(len(p) == 2 for p in pairs):
            raise ValueError("takes JSON such as '{\"image\": 4, \"video\": 1}'") from None
        conf = {k.strip(): v.strip() for k, v in pairs}
    if not isinstance(conf, dict):
        raise ValueError("takes JSON such as '{\"image\": 4, \"video\": 1}'")
    unknown = sorted(set(conf) - set(MODALITIES))
    if unknown:
        raise ValueError(f"qv takes images and videos only, not {', '.join(unknown)}")
    return {MODALITIES[k]: v for k, v in conf.items()}


def size_bytes(text: str) -> dict:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgtKMGT]?)\s*", text)
    if not m:
        raise ValueError(f"{text!r} is not a byte count (an integer, or with a suffix: 8G = 8 GiB, 8g = 8e9)")
    return {"kv_cache_bytes": int(float(m.group(1)) * SIZE_SUFFIXES.get(m.group(2), 1))}


def only(lever_value: str, what: str) -> Callable:
    """A flag whose only meaningful value is what qv always does: accepted for it, refused otherwise."""
    def check(value: str) -> dict:
        if value != lever_value:
            raise ValueError(f"{value!r}: qv {what} ({lever_value!r}) only")
        return {}
    return check


def add_engine_aliases(p: argparse.ArgumentParser) -> None:
    """vLLM's spellings of engine levers (serve, generate, bench)."""
    g = p.add_argument_group("vLLM's spellings (each sets the qv lever named)")
    flag = g.add_argument
    flag("--enable-prefix-caching", action=SetLevers, nargs=0, convert=lambda _: {"prefix_caching": True},
         help="--prefix-caching 1")
    flag("--no-enable-prefix-caching", action=SetLevers, nargs=0, convert=lambda _: {"prefix_caching": False},
         help="--prefix-caching 0")
    flag("--enforce-eager", action=SetLevers, nargs=0, convert=lambda _: {"cuda_graphs": False},
         help="--cuda-graphs 0")
    flag("--kv-cache-dtype", action=SetLevers, convert=kv_cache_dtype, metavar="DTYPE",
         help="--kv-dtype (auto, int8, bfloat16, float16; no fp8)")
    flag("--kv-cache-memory-bytes", action=SetLevers, convert=size_bytes, metavar="BYTES",
         help="--kv-cache-bytes (8G: GiB, 8g: 1e9)")
    flag("--speculative-config", action=SetLevers, convert=speculative_config, metavar="JSON",
         help="--spec and --spec-k: {\"method\": \"mtp\"|\"ngram\", \"num_speculative_tokens\": K}")
    flag("--limit-mm-per-prompt", action=SetLevers, convert=limit_mm_per_prompt, metavar="JSON",
         help="--media-max-images and --media-max-videos: {\"image\": N, \"video\": M}")


def add_server_aliases(p: argparse.ArgumentParser) -> None:
    """vLLM's spellings of server levers, and its server flags qv has no equivalent of (serve only)."""
    g = p.add_argument_group("vLLM's server spellings")
    flag = g.add_argument
    flag("--uvicorn-log-level", action=SetLevers, convert=lambda v: {"log_level": v}, metavar="LEVEL",
         help="--log-level")
    flag("--disable-log-stats", action=SetLevers, nargs=0, convert=lambda _: {"log_stats": False},
         help="--log-stats 0")
    flag("--disable-uvicorn-access-log", action=SetLevers, nargs=0, convert=lambda _: {"access_log": "off"},
         help="--access-log off")
    flag("--disable-log-requests", action=SetLevers, nargs=0, convert=lambda _: {},
         help="accepted: qv never logs requests' contents")
    flag("--enable-auto-tool-choice", action=SetLevers, nargs=0, convert=lambda _: {},
         help="accepted: qv always honours tool_choice auto")
    flag("--tool-call-parser", action=SetLevers, convert=only("qwen3_coder", "parses Qwen3.5's tool calls"),
         metavar="NAME", help="accepted as qwen3_coder, what qv always parses")
    flag("--reasoning-parser", action=SetLevers, convert=only("qwen3", "parses Qwen3.5's <think> blocks"),
         metavar="NAME", help="accepted as qwen3, what qv always parses")
    flag("--chat-template", action=NoEquivalent, metavar="FILE",
         reason="qv renders the checkpoint's own template (chat_template.jinja or tokenizer_config.json in the "
                "model folder): put yours there", help="refused: see the message")
