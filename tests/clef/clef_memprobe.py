"""Measures the peak extra memory of one record's head state, in a fresh process: resident set
size sampled every millisecond (torch ops release the GIL) while a record's hidden states are fed
chunk by chunk (each chunk made, used, dropped: as the engine hands them over) and answered.

Run as `python clef_memprobe.py T H W CHUNK`; prints JSON {peak_extra, state_bytes, hidden_bytes}.
"""

from __future__ import annotations

import json
import sys
import threading
import time


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def main(t: int, h: int, w: int, chunk: int) -> dict:
    import torch

    from qv.clef.encode import EncodedQuestion, EncodedRecord
    from qv.clef.head import HeadConfig, JointHead, expected_shapes

    torch.set_num_threads(1)
    cfg = HeadConfig(hidden_size=h, width=w, routing_layers=1, layers=1, heads=4, feedforward=2 * w)
    gen = torch.Generator().manual_seed(0)
    head = JointHead(cfg, {k: torch.randn(s, generator=gen) * 0.05 for k, s in expected_shapes(cfg).items()})
    vocab = torch.randn(512, h, generator=gen)
    # 64 questions of 7 options each (the 448-option maximum) at the end of a long record
    spans, qs, pos = [], [], t - 64 * 80
    for i in range(64):
        opts = tuple((pos + 10 + 8 * j, pos + 16 + 8 * j) for j in range(7))
        qs.append(EncodedQuestion(f"q{i}", 1, (pos, pos + 8), opts, tuple(str(j) for j in range(7)), "choice",
                                  {str(j): None for j in range(7)}))
        pos += 80
    record = EncodedRecord(tuple(int(x) for x in torch.randint(0, 512, (t,), generator=gen)), tuple(qs))
    # warm up on a short record first: the first call of each op maps code pages of libtorch and
    # sets up MKL buffers, which would otherwise count as the head's memory
    small = EncodedRecord(record.input_ids[:16], (EncodedQuestion("w", 0, (1, 3), ((4, 6), (7, 9)), ("true", "false"),
                                                                   "noul", None),))
    warm = head.state(small, vocab)
    warm.add_chunk(torch.randn(16, h, generator=gen), 0)
    warm.probabilities()
    del warm
    peak, stop = [rss()], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            time.sleep(0.001)

    base = rss()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    state = head.state(record, vocab)
    for start in range(0, t, chunk):
        n = min(chunk, t - start)
        state.add_chunk(torch.randn(n, h, generator=gen), start)
    probs = state.probabilities()
    stop.set()
    sampler.join()
    assert len(probs) == 64
    return {"peak_extra": peak[0] - base, "state_bytes": state.nbytes(), "hidden_bytes": t * h * 4}


if __name__ == "__main__":
    print(json.dumps(main(*(int(a) for a in sys.argv[1:5]))))
