"""The web playground in a real browser: Debian's headless Chromium, driven by Playwright, against a
real server on the embedded tiny model (its Clef head included). The page loads with no console
error, a chat streams its tokens in (the reply's text changes several times before it is done), a
Clef decision shows one bar per option whose widths are its probabilities, the Server panel fills
from /server_info and plots /metrics; behind a path prefix and with an API key (typed into the
page, kept in sessionStorage) it works too. Screenshots of each panel go to tmp_path, or to
$PLAYGROUND_SCREENSHOTS (the README's pictures: PLAYGROUND_SCREENSHOTS=docs). Also without a
browser: the routes' files, /server_info's secrets, and /docs served with no CDN."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from pathlib import Path

import httpx
import pytest

from conftest import start_server

CHROMIUM = "/usr/bin/chromium"  # Debian's package (`apt-get install chromium`); Playwright never downloads one
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
API_KEY = "playground-key"
PREFIX = "/qv"


@pytest.fixture(scope="module")
def embedded(tmp_path_factory):
    from qv.model.tiny import make_embedded

    return make_embedded(tmp_path_factory.mktemp("playground") / "embedded")


@pytest.fixture(scope="module")
def clef_server(embedded):
    running, stop = start_server(embedded, served_model_name="qv-tiny", max_num_batched_tokens=256)
    yield running
    stop()


def needs_browser():
    if not Path(CHROMIUM).exists():
        pytest.skip(f"no Chromium at {CHROMIUM} (Debian: apt-get install -y chromium; .ci/run installs it)")
    pytest.importorskip("playwright", reason="Playwright is not installed (pip install -e '.[test]')")


def screenshot_dir(tmp_path: Path) -> Path:
    out = Path(os.environ.get("PLAYGROUND_SCREENSHOTS") or tmp_path)
    out.mkdir(parents=True, exist_ok=True)
    return out


class Browser:
    """One Chromium page that records console errors and uncaught exceptions."""

    def __init__(self):
        from playwright.sync_api import sync_playwright

        self.pw = sync_playwright().start()
        self.browser = self.pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        self.page = self.browser.new_page(viewport={"width": 1280, "height": 820})
        self.errors: list[str] = []
        self.page.on("console", lambda m: self.errors.append(f"console: {m.text}") if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(f"page error: {e}"))

    def close(self):
        self.browser.close()
        self.pw.stop()


@pytest.fixture
def browser():
    needs_browser()
    b = Browser()
    yield b
    b.close()


def chat_streams(page) -> str:
    """Chats at temperature 1 until a reply has at least 4 tokens (seeded: the same seeds every run; the
    random tiny model may stop at once), then checks it arrived in several pieces."""
    page.fill("#temperature", "1")
    page.fill("#max-tokens", "24")
    for seed in range(1, 9):
        page.fill("#seed", str(seed))
        page.fill("#chat-input", "Write one sentence about the sea.")
        page.click("#chat-send")
        done = page.wait_for_selector(".msg.assistant[data-done]:last-child", timeout=120_000)
        tokens, events = int(done.get_attribute("data-tokens")), int(done.get_attribute("data-pieces"))
        if tokens >= 4:
            break
        page.click("#chat-clear")
    assert tokens >= 4, "no seed gave a reply of 4 tokens"
    assert events >= 3, f"{tokens} tokens came in {events} pieces: not streamed"  # a piece: tokens whose text is whole
    reply = done.query_selector(".content").inner_text()
    assert reply.strip(), "the reply is empty"
    assert re.search(r"\d+ tokens in .* streamed pieces", done.query_selector(".stats").inner_text())
    page.click("#chat-clear")
    return reply


WEATHER_TOOL = ('[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", '
                '"properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"type": "integer", "minimum": 1, "maximum": 9}}, '
                '"required": ["city", "days"]}}}]')


def thinking_and_tool_calls(page) -> None:
    """Thinking on: the reply's reasoning sits in a folded <details>; tools with tool_choice required (the
    call grammar makes even the random tiny model call): the call is shown as a call, its arguments JSON."""
    page.check("#thinking")
    page.fill("#chat-input", "Think first, then answer.")
    page.click("#chat-send")
    page.wait_for_selector(".msg.assistant:nth-child(2)[data-done]", timeout=120_000)
    thinking = page.query_selector(".msg.assistant:nth-child(2) details.thinking")
    assert thinking.is_visible() and thinking.get_attribute("open") is None, "thinking is not shown folded"
    assert page.eval_on_selector(".msg.assistant:nth-child(2) details.thinking div", "e => e.textContent.length") > 0
    page.uncheck("#thinking")
    page.fill("#tools", WEATHER_TOOL)
    page.select_option("#tool-choice", "required")
    page.fill("#max-tokens", "120")  # room for the whole call in the tiny tokenizer's pieces
    page.fill("#chat-input", "What is the weather in Paris?")
    page.click("#chat-send")
    page.wait_for_selector(".msg.assistant:nth-child(4)[data-done]", timeout=120_000)
    call = page.inner_text(".msg.assistant:nth-child(4) .tool-call")
    assert call.startswith("call get_weather(") and call.endswith(")"), call
    assert json.loads(call[len("call get_weather("):-1])["city"] in ("Paris", "Rome")


def decision_bars(page) -> dict:
    page.click("button[data-panel=decisions]")
    page.click("#clef-send")
    page.wait_for_selector(".answer[data-question=team]", timeout=120_000)
    answers = {}
    for box in page.query_selector_all(".answer"):
        bars = [(r.query_selector(".label").inner_text(), float(r.query_selector(".bar > div").get_attribute("style")
                 .split(":")[1].strip(" %;")), float(r.query_selector("span:last-child").inner_text()))
                for r in box.query_selector_all(".bar-row")]
        answers[box.get_attribute("data-question")] = bars
    assert set(answers) == {"outage", "urgency", "team"}
    assert len(answers["outage"]) == 2 and len(answers["urgency"]) == 3 and len(answers["team"]) == 3
    for question, bars in answers.items():
        assert sum(p for _, _, p in bars) == pytest.approx(1, abs=2e-3), question
        for label, width, p in bars:
            assert width == pytest.approx(100 * p, abs=0.06), (question, label)
    return answers


def test_playground_chat_decision_and_server_panels(clef_server, browser, tmp_path):
    page, shots = browser.page, screenshot_dir(tmp_path)
    page.goto(clef_server.url + "/")
    page.wait_for_function("document.getElementById('model-name').dataset.model === 'qv-tiny'", timeout=60_000)
    chat_streams(page)
    thinking_and_tool_calls(page)
    page.screenshot(path=str(shots / "playground-chat.png"))

    answers = decision_bars(page)
    raw = page.eval_on_selector("#clef-raw", "e => JSON.parse(e.textContent)")
    assert raw["answers"]["outage"]["noul"] == pytest.approx(answers["outage"][0][2])
    page.screenshot(path=str(shots / "playground-decisions.png"))

    page.click("button[data-panel=server]")
    page.wait_for_function("document.querySelectorAll('#plot-tps polyline').length === 1", timeout=30_000)
    model_rows = page.inner_text("#server-model")
    assert "qv-tiny" in model_rows and "CUDA graphs" in model_rows
    assert "max_num_batched_tokens" in page.inner_text("#server-levers")
    assert "memory plan" in page.inner_text("#server-plan-summary")
    page.wait_for_function("document.querySelector('#plot-tps polyline').getAttribute('points').split(' ').length >= 2",
                           timeout=30_000)
    page.screenshot(path=str(shots / "playground-server.png"))

    page.goto(clef_server.url + "/docs")
    page.wait_for_selector(".swagger-ui .opblock", timeout=60_000)  # Swagger UI rendered, from the package
    assert not browser.errors, "\n".join(browser.errors)


def strip_prefix(app, prefix: str):
    """What a reverse proxy that serves qv under `prefix` does: strips it, and 404s anything else."""
    async def proxied(scope, receive, send):
        if scope["type"] != "lifespan":
            path = scope["path"]
            if not (path == prefix or path.startswith(prefix + "/")):
                await send({"type": "http.response.start", "status": 404, "headers": []})
                return await send({"type": "http.response.body", "body": b"outside the prefix"})
            scope = dict(scope, path=path[len(prefix):] or "/", raw_path=None)
        return await app(scope, receive, send)
    return proxied


@pytest.fixture(scope="module")
def keyed_prefixed_server(embedded):
    """A server with an API key, reached through a proxy that serves it under PREFIX."""
    import uvicorn

    from qv.config import EngineConfig
    from qv.server.app import build_app

    app = build_app(EngineConfig(model=str(embedded), max_model_len=1024, api_key=API_KEY,
                                 served_model_name="qv-tiny"))
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(strip_prefix(app, PREFIX), log_level="warning", timeout_graceful_shutdown=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 300
    while not server.started:
        assert thread.is_alive() and time.time() < deadline, "the test server did not start"
        time.sleep(0.05)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}{PREFIX}"
    server.should_exit = True
    thread.join(timeout=30)
    sock.close()


def test_playground_behind_a_prefix_with_an_api_key(keyed_prefixed_server, browser):
    page = browser.page
    page.goto(keyed_prefixed_server + "/playground")
    page.wait_for_selector("#error:not([hidden])", timeout=60_000)
    assert "API key" in page.inner_text("#error")  # /server_info is guarded: the page says what is missing
    page.fill("#api-key", API_KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.getElementById('model-name').dataset.model === 'qv-tiny'", timeout=60_000)
    assert page.evaluate("sessionStorage.getItem('qv.apiKey')") == API_KEY
    page.reload()  # the key outlives a reload in the same session
    page.wait_for_function("document.getElementById('model-name').dataset.model === 'qv-tiny'", timeout=60_000)
    chat_streams(page)
    decision_bars(page)
    unexpected = [e for e in browser.errors if "401" not in e]  # the first /server_info, before the key
    assert not unexpected, "\n".join(unexpected)


def test_routes_without_a_browser(clef_server):
    with clef_server.client() as c:
        for path in ("/", "/playground"):
            r = c.get(path)
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
            assert "static/playground.js" in r.text and "http" not in re.sub(r'xmlns="[^"]*"', "", r.text.split("<body>")[1])
        assert c.get("/static/playground.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/static/playground.css").status_code == 200
        for bad in ("/static/..%2Fapp.py", "/static/playground.py", "/static/missing.js", "/docs/index.html",
                    "/static/a%00b.js", "/static/" + "x" * 5000, "/docs/" + "y" * 5000):
            r = c.get(bad)
            assert r.status_code == 404 and "error" in r.json(), bad
        docs = c.get("/docs").text
        assert "docs/swagger-ui-bundle.js" in docs and "cdn" not in docs.lower()
        assert c.get("/docs/swagger-ui-bundle.js").status_code == 200
        info = c.get("/server_info").json()
        assert info["model"] == "qv-tiny" and info["clef"] is True
        assert info["levers_changed"]["max_num_batched_tokens"] == 256
        assert info["memory_plan"]["kv_blocks"] > 0 and isinstance(info["cuda_graphs"], bool)


def test_server_info_never_shows_the_key(keyed_prefixed_server):
    url = keyed_prefixed_server
    assert httpx.get(url + "/server_info").status_code == 401
    assert httpx.get(url + "/").status_code == 200  # the page itself is open: it asks for the key
    info = httpx.get(url + "/server_info", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert info["api_key_required"] is True
    assert API_KEY not in str(info) and "api_key" not in info["levers_changed"]


def test_package_ships_the_static_files():
    """pyproject's package-data names every file of qv/server/static (a wheel without them serves a 404)."""
    tomllib = pytest.importorskip("tomllib")
    from qv.server.playground import STATIC

    data = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    patterns = data["tool"]["setuptools"]["package-data"]["qv.server"]
    files = sorted(p.name for p in STATIC.iterdir() if p.is_file())
    assert files == ["playground.css", "playground.html", "playground.js"]
    assert all(any(Path("static", f).match(p) for p in patterns) for f in files)


def test_page_stays_open_under_api_key_scope_all(embedded):
    """Under api_key_scope all every route wants the key but the page and its files: without them a
    browser could not load the form that asks for the key."""
    running, stop = start_server(embedded, api_key=API_KEY, api_key_scope="all")
    try:
        with running.client() as c:
            for path in ("/", "/playground", "/static/playground.js", "/static/playground.css"):
                assert c.get(path).status_code == 200, path
            for path in ("/server_info", "/docs", "/docs/swagger-ui.css", "/metrics", "/openapi.json"):
                assert c.get(path).status_code == 401, path
            assert c.get("/static/missing.js").status_code == 404
            assert c.get("/server_info").status_code == 401
            assert c.get("/server_info", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    finally:
        stop()
