"""Media fetching cannot reach inside, shown against real services on inside addresses.

netns_media.py runs in a fresh network and mount namespace (`unshare -n -m`, root): `lo` carries
169.254.169.254, 10.0.0.5, 172.16.0.9, 192.168.1.10, 100.64.0.1, fd00::5, ::1 and the stand-in
public 8.8.8.8, each with an HTTP server on port 80, and a private /etc/hosts names some of them.
With default levers every inside URL (by IP, by name, IPv4-mapped, decimal, 0.0.0.0, [::], and
redirects from the public host) is refused with one message and no inside server sees a request;
the public host is fetched, and its 404 / closed port read only "HTTP error" / "could not
connect". Opening ranges with media_allowed_networks fetches exactly those (proving the services
were there to be reached). Through the real HTTP API on the tiny model: an image on the metadata
address is a 400 by default and answered once its address is opened.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from media_files import blank_png

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
NOT_ALLOWED = "ERR part: could not fetch media URL: address not allowed (media_allowed_networks)"
INSIDE_SERVERS = {"169.254.169.254", "10.0.0.5", "172.16.0.9", "192.168.1.10", "100.64.0.1", "127.0.0.1", "fd00::5",
                  "::1"}


def _unshare_works() -> bool:
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return False
    r = subprocess.run(["unshare", "-n", "-m", "true"], capture_output=True)
    return r.returncode == 0


pytestmark = pytest.mark.skipif(not _unshare_works(), reason="needs unshare -n -m (root) and iproute2")


@pytest.fixture(scope="module")
def netns(tmp_path_factory, tiny_dirs) -> dict:
    tmp = tmp_path_factory.mktemp("netns")
    png = tmp / "img.png"
    png.write_bytes(blank_png(64, 48))
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run(["unshare", "-n", "-m", sys.executable, str(HERE / "netns_media.py"), str(tmp), str(png),
                        str(tiny_dirs("tiny"))], capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_inside_is_refused_by_default(netns):
    got = netns["fetch"]["default"]
    public = {"http://8.8.8.8/": "OK PUBLIC", "http://public.example/": "OK PUBLIC",
              "http://8.8.8.8/missing": "ERR part: could not fetch media URL: HTTP error",
              "http://8.8.8.8:81/": "ERR part: could not fetch media URL: could not connect",
              "https://8.8.8.8/": "ERR part: could not fetch media URL: could not connect"}  # port 443 closed
    for url, answer in got.items():
        assert answer == public.get(url, NOT_ALLOWED), (url, answer)
    hits = netns["fetch"]["default hits"]
    inside_hits = {k: v for k, v in hits.items() if k in INSIDE_SERVERS}
    assert inside_hits == {}, inside_hits  # refused before connecting: no inside server saw a request
    assert sorted(hits["8.8.8.8"]) == ["/", "/", "/missing", "/to-db", "/to-localhost", "/to-mapped", "/to-metadata"]


def test_allowed_networks_open_exactly_their_ranges(netns):
    got = netns["fetch"]["opened"]
    opened = {"http://169.254.169.254/latest/meta-data/": "OK METADATA", "http://metadata.internal/latest/meta-data/":
              "OK METADATA", "http://10.0.0.5/": "OK TEN", "http://db.internal/": "OK TEN", "http://[fd00::5]/": "OK ULA",
              "http://2852039166/": "OK METADATA", "http://[::ffff:169.254.169.254]/": "OK METADATA",
              "http://8.8.8.8/to-metadata": "OK METADATA", "http://8.8.8.8/to-mapped": "OK TEN",
              "http://8.8.8.8/to-db": "OK TEN"}
    assert set(netns["fetch"]["opened hits"]) == {"169.254.169.254", "10.0.0.5", "fd00::5", "8.8.8.8"}
    for url in ("http://172.16.0.9/", "http://192.168.1.10/", "http://100.64.0.1/", "http://127.0.0.1/",
                "http://localhost/", "http://[::1]/", "http://0.0.0.0/", "http://[::ffff:127.0.0.1]/",
                "http://public.example/to-localhost"):
        assert got[url] == NOT_ALLOWED, (url, got[url])
    for url, answer in opened.items():
        assert got[url] == answer, (url, got[url])


def test_domain_list_and_networks_together(netns):
    got = netns["fetch"]["domains"]
    assert got["http://public.example/"] == "OK PUBLIC"
    assert got["http://8.8.8.8/"] == "ERR part: could not fetch media URL: domain not allowed (media_allowed_domains)"
    assert got["http://db.internal/"].endswith("domain not allowed (media_allowed_domains)")
    assert got["http://public.example/to-localhost"].endswith("domain not allowed (media_allowed_domains)")


def test_http_api_end_to_end(netns):
    api = netns["api"]
    assert api["default"] == {"status": 400, "message": "messages[0].content[1]: could not fetch media URL: address "
                                                        "not allowed (media_allowed_networks)"}, api
    assert api["opened"] == {"status": 200, "message": None}, api
    assert netns["hits"] == {"169.254.169.254": ["/img.png"]}  # only the server with it opened fetched it
