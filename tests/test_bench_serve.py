"""`qv bench serve` against the embedded tiny model (a `qv serve` subprocess on a loopback port): the
table and the JSON record are complete. No timing assertions: the numbers are whatever this machine gives."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qv.bench.serve import ServeSpec, started_server
from qv.cli import main

LATENCIES = ("ttft_ms", "itl_ms", "chat_e2e_ms", "record_e2e_ms")
ROWS = ("chat TTFT", "chat ITL", "chat end-to-end", "record end-to-end", "output tok/s", "prompt tok/s", "records/s",
        "errors", "server: preemptions", "server: mean queue time", "server: requests finished",
        "server RSS: settled -> end", "server RSS over the load", "greedy probes identical before and after")


def test_bench_serve_reports_a_complete_table_and_json(tmp_path, capsys):
    out = tmp_path / "serve.json"
    with started_server(None, None, ["--device", "cpu", "--max-step-ms", "30"], startup_timeout_s=300) as url:
        rc = main(["bench", "serve", "--url", url, "--duration", "3", "--chats", "2", "--records", "1",
                   "--stream-fraction", "0.75", "--hangup-fraction", "0.3", "--prompt-len", "12", "--output-len", "6",
                   "--record-lengths", "16,48", "--seed", "7", "--json", str(out)])
    assert rc == 0
    table = capsys.readouterr().out
    for row in ROWS:
        assert f"| {row}" in table, f"the table has no {row!r} row:\n{table}"
    report = json.loads(out.read_text())
    assert report["errors"] == 0, report["error_samples"]
    for key in LATENCIES:
        stats = report[key]
        assert stats["n"] > 0 and all(stats[k] is not None for k in ("mean", "p50", "p95", "p99")), (key, stats)
        assert stats["p50"] <= stats["p95"] <= stats["p99"], (key, stats)
    counts = report["requests"]
    assert counts["chats"] > 0 and counts["streamed"] > 0 and counts["records"] > 0, counts
    assert counts["hung_up"] > 0, counts  # seed 7: the first two chats (sent at once) stream and hang up at 3 tokens
    assert report["output_tok_s"] > 0 and report["prompt_tok_s"] > 0 and report["records_s"] > 0
    server = report["server"]
    assert set(server) == {"preemptions", "queue_time_mean_ms", "requests_finished", "prompt_tokens",
                           "generation_tokens", "admission_rejections"}
    # the server saw at least what the client counted as finished, and the queue-time histogram moved
    assert server["requests_finished"] >= counts["chats"] + counts["records"]
    assert server["queue_time_mean_ms"] is not None and server["prompt_tokens"] > 0
    # the soak checks: the probes answered alike on the idle server, and the server said where its memory stood
    assert report["probes"] == {"n": 2, "identical": True, "mismatched": []}, report["probes"]
    memory = report["memory"]
    assert memory["rss_settled_mib"] > 50 and memory["rss_end_mib"] > 50 and isinstance(memory["rss_change"], float)
    assert memory["device_settled_mib"] == memory["device_end_mib"] == 0 and memory["device_change"] is None  # CPU
    assert memory["device_used_settled_mib"] == memory["device_used_end_mib"] == 0
    assert memory["compiles_settled"] == memory["compiles_end"] == 0  # no warm-up on the CPU: nothing watched
    if Path("/proc/self/status").exists():  # Linux splits the RSS; the parts add up to at most the whole
        for at in ("settled", "end"):
            anon, file, rss = (memory[f"{k}_{at}_mib"] for k in ("rss_anon", "rss_file", "rss"))
            assert anon > 50 and file > 0 and anon + file <= 1.05 * rss, memory  # scraped apart
    assert memory["sample_columns"] == ["s", "rss", "rss_anon", "rss_file", "device", "device_used", "compiles"]
    times = [row[0] for row in memory["samples"]]
    assert times and times == sorted(times) and all(row[1] > 50 for row in memory["samples"]), memory["samples"]
    assert all(len(row) == 7 for row in memory["samples"]), memory["samples"]


def _sse_client(events: list[dict]):
    import httpx

    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    transport = httpx.MockTransport(lambda request: httpx.Response(200, text=body,
                                                                   headers={"content-type": "text/event-stream"}))
    return httpx.AsyncClient(transport=transport, base_url="http://qv")


@pytest.mark.parametrize("hang_at, hung_up", [(None, 0), (2, 1)])
def test_streamed_tokens_count_by_their_ids_even_when_they_decode_to_no_text(hang_at, hung_up):
    """Random weights emit ids that the embedded tokenizer decodes to nothing: the chunks still carry token_ids,
    and the latencies and the hang-up follow those tokens (counting only chunks with text saw none of them)."""
    import asyncio

    from qv.bench.serve import _Driver

    events = [{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]},
              {"choices": [{"index": 0, "delta": {}, "token_ids": [5]}]},
              {"choices": [{"index": 0, "delta": {"content": ""}, "token_ids": [6, 7]}]},
              {"choices": [{"index": 0, "delta": {}, "token_ids": [8], "finish_reason": "length"}]},
              {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}]

    async def run():
        async with _sse_client(events) as client:
            driver = _Driver(client, ServeSpec(chats=1, records=0), "m")
            await driver._streamed_chat(hang_at)
            return driver.tally

    tally = asyncio.run(run())
    assert tally.counts["errors"] == 0, tally.error_samples
    assert tally.counts["hung_up"] == hung_up
    assert len(tally.ttft) == 1 and len(tally.itl) == (1 if hang_at else 2)
    assert tally.counts["output_tokens"] == (3 if hang_at else 4)
    assert tally.counts["streamed"] == (0 if hang_at else 1)


def test_memory_change_is_relative_to_where_it_settled():
    from qv.bench.serve import KERNELS_METRIC, MEMORY_METRICS, _memory_change

    rss, device = MEMORY_METRICS["rss"], MEMORY_METRICS["device"]
    got = _memory_change({rss: 100 * 2**20, device: None, KERNELS_METRIC: 40.0},
                         {rss: 104 * 2**20, device: 5.0, KERNELS_METRIC: 43.0})
    assert got == {"rss_settled_mib": 100.0, "rss_end_mib": 104.0, "rss_change": 0.04,
                   "device_settled_mib": None, "device_end_mib": 5.0 / 2**20, "device_change": None,
                   **{f"{k}_{at}": None for k in ("rss_anon", "rss_file", "device_used")
                      for at in ("settled_mib", "end_mib", "change")},
                   "compiles_settled": 40.0, "compiles_end": 43.0}


@pytest.mark.parametrize("kw, says", [({"chats": 0, "records": 0}, "at least one"),
                                      ({"hangup_fraction": 1.5}, "hangup_fraction"),
                                      ({"record_lengths": ()}, "record length"),
                                      ({"settle_s": 40.0, "duration_s": 30.0}, "settle_s"),
                                      ({"probes": -1}, "probes")])
def test_bad_mixes_are_refused_with_the_cause(kw, says):
    with pytest.raises(ValueError, match=says):
        ServeSpec(**kw)


def test_url_with_a_model_is_refused(capsys):
    assert main(["bench", "serve", "--url", "http://127.0.0.1:9", "--model", "x"]) == 2
    assert "--url targets a running server" in capsys.readouterr().err


def test_records_against_a_server_without_a_clef_head_stop_with_the_cause(tiny_dirs, capsys):
    """The tiny fixture folder has no Clef head: the run stops before it starts, naming why."""
    with started_server(str(tiny_dirs("tiny")), None, ["--device", "cpu"], startup_timeout_s=300) as url:
        assert main(["bench", "serve", "--url", url, "--duration", "1", "--chats", "1", "--records", "1"]) == 2
    err = capsys.readouterr().err
    assert "the server answers no records" in err and "does not serve Clef decisions" in err, err
