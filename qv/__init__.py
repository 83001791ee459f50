"""qv: serve hybrid Qwen3.5-family models (Gated DeltaNet + gated attention) on Volta and newer GPUs."""

from qv.version import __version__

__all__ = ["LLM", "SamplingParams", "__version__"]


def __getattr__(name):  # lazy, so `import qv.config` stays light
    if name == "LLM":
        from qv.llm import LLM

        return LLM
    if name == "SamplingParams":
        from qv.engine.request import SamplingParams

        return SamplingParams
    raise AttributeError(name)
