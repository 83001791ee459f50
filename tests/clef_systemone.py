"""Cloudflare's `systemone()` with its logits caught on the way, for the unrounded per-option
probabilities (shared by tests/clef and the image oracle subprocess in tests/vision)."""


def systemone_with_probabilities(jsm, model, processor, record) -> tuple[dict, list[list[float]]]:
    caught = []
    hook = model.register_forward_hook(lambda m, args, out: caught.append(out[0]))
    try:
        response = jsm.systemone(model, processor, record)
    finally:
        hook.remove()
    return response, [q.float().softmax(-1).tolist() for q in caught[0]]
