"""Runs Hugging Face's own processor (AutoProcessor: Qwen3VLProcessor with Qwen2VLImageProcessor
and Qwen3VLVideoProcessor, the torchvision-backed classes vLLM and transformers serve with) on
pickled cases, in a separate process: `python hf_processor_oracle.py MODEL_DIR TV_DIR IN OUT`.
A case's video is frames plus fps, or a video file (`read_video_file`: transformers' PyAV reader).

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


def read_video_file(proc, path: str, reader: str):
    """(frames, metadata, sample?) of a video file: "hf-pyav" is transformers' own PyAV reader
    (`load_video(backend="pyav")`) sampling with the video processor's `sample_frames`, as a file
    path reaches it; "all-frames" decodes every frame in a plain PyAV loop and leaves sampling to
    the processor (transformers' reader takes the header's frame count, which WebM leaves at 0)."""
    if reader == "hf-pyav":
        from transformers.video_utils import load_video

        frames, metadata = load_video(path, backend="pyav", sample_indices_fn=proc.video_processor.sample_frames)
        return frames, metadata, False
    import av
    import numpy as np
    from transformers.video_utils import VideoMetadata

    with av.open(path) as container:
        stream = container.streams.video[0]
        frames = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(stream)])
        return frames, VideoMetadata(total_num_frames=len(frames), fps=float(stream.average_rate)), True


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
            if case.get("video_file"):
                path, reader = case["video_file"]
                frames, metadata, sample = read_video_file(proc, path, reader)
                kw.update(videos=[frames], video_metadata=[metadata], do_sample_frames=sample, cap_pixels_per_frame=False)
            out = proc(**kw)
            results[case["name"]] = {k: v for k, v in out.items()}
            if case.get("video_file"):  # the frames it sampled, and the frame count and fps it read
                indices = metadata.frames_indices if not sample else proc.video_processor.sample_frames(metadata)
                results[case["name"]]["sampled"] = ([int(i) for i in indices], int(metadata.total_num_frames),
                                                   float(metadata.fps))
        except Exception as e:  # the case expects an error: record it for the test to compare
            results[case["name"]] = {"error": f"{type(e).__name__}: {e}"}
    with open(out_path, "wb") as f:
        pickle.dump(results, f)


if __name__ == "__main__":
    main(*sys.argv[1:5])
