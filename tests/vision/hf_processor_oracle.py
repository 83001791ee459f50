"""Runs Hugging Face's own processor (AutoProcessor: Qwen3VLProcessor with Qwen2VLImageProcessor
and Qwen3VLVideoProcessor, the torchvision-backed classes vLLM and transformers serve with) on
pickled cases, in a separate process: `python hf_processor_oracle.py MODEL_DIR TV_DIR IN OUT`.

Why a separate process and a side directory: the only torchvision wheels this machine's registry
has are CUDA builds, whose compiled ops cannot load against the venv's CPU torch, and a torchvision
in the venv would break `import transformers` models for every other test. Here torchvision's
pure-Python code (the transforms the processors call) is imported from TV_DIR; its two modules
that register fake/autograd kernels for the compiled detection ops (nms, roi_align, ...), which
no processor uses, are skipped because those ops do not exist without the compiled library.
"""

import pickle
import sys
import types


def use_side_torchvision(tv_dir: str) -> None:
    """Import torchvision's Python code from tv_dir (see above); call before importing transformers,
    which checks for torchvision once."""
    sys.path.insert(0, tv_dir)
    for name in ("torchvision._meta_registrations", "torchvision._autograd_registrations"):
        sys.modules[name] = types.ModuleType(name)
    import torchvision  # noqa: F401


def main(model_dir: str, tv_dir: str, in_path: str, out_path: str) -> None:
    use_side_torchvision(tv_dir)
    from transformers import AutoProcessor
    from transformers.video_utils import VideoMetadata

    proc = AutoProcessor.from_pretrained(model_dir)
    kinds = {"image": type(proc.image_processor).__name__, "video": type(proc.video_processor).__name__}
    with open(in_path, "rb") as f:
        cases = pickle.load(f)
    results = {"_classes": kinds}
    for case in cases:
        kw = {"text": [case["text"]], "return_tensors": "pt"}
        if case.get("images"):
            kw["images"] = case["images"]
        if case.get("videos"):
            kw["videos"] = [frames for frames, _ in case["videos"]]
            kw["video_metadata"] = [VideoMetadata(total_num_frames=len(frames), fps=fps)
                                    for frames, fps in case["videos"]]
            kw["cap_pixels_per_frame"] = False  # the default behaviour, stated to silence HF's warning
        try:
            out = proc(**kw)
            results[case["name"]] = {k: v for k, v in out.items()}
        except Exception as e:  # the case expects an error: record it for the test to compare
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
