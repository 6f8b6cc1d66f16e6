"""The dashboard in a real browser: Debian's Chromium, headless, driven by Selenium through
Debian's chromedriver, against the real server on the tiny test model.

It loads the page on a server with an API key (the page asks for it once), sends requests,
and reads the page: every actor is drawn, a request shows in flight and then among the
finished, the token counter rises, a repeated prompt shows a cache hit, and clicking an actor
opens its snapshot. It also takes a screenshot of the page under load (set
``TROUPE_DASHBOARD_PNG=docs/dashboard.png`` to refresh the one the README shows).

Where Chromium, chromedriver or selenium is missing the test skips and says why (``make
setup`` installs them as root with apt-get); on CI as root with apt-get it must run, so there
a missing browser fails it instead.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from http_stack import real_stack

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
KEY = "sekret"
WAIT_S = 60.0  # the first request compiles MLX's kernels: seconds on a cold machine
# CI (root, with apt-get) installs the browser in `make setup`: a skip there would hide a fault.
MUST_RUN = os.environ.get("CI") == "true" and os.geteuid() == 0 and bool(shutil.which("apt-get"))


def _missing() -> str | None:
    try:
        import selenium  # noqa: F401
    except ImportError:
        return "selenium is not installed (pip install -e '.[test]')"
    for path, package in ((CHROMIUM, "chromium"), (CHROMEDRIVER, "chromium-driver")):
        if not Path(path).exists():
            return f"{path} is missing: apt-get install {package} (make setup does, as root)"
    return None


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """Headless Chromium, as root: no sandbox, no network but this machine's."""
    missing = _missing()
    if missing:
        if MUST_RUN:
            pytest.fail(f"the browser test must run on CI: {missing}")
        pytest.skip(missing)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    profile = tempfile.mkdtemp(prefix="troupe-chromium-")
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                 "--disable-quic", "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1440,1400",
                 f"--user-data-dir={profile}"):
        options.add_argument(flag)
    # The driver named outright: Selenium never looks for (or downloads) one itself.
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


async def wait_for(driver: Any, what: str, check: Callable[[Any], Any],
                   timeout: float = WAIT_S) -> Any:
    """Poll ``check(driver)`` off the event loop (the server runs on it) until it is truthy."""
    from selenium.webdriver.support.ui import WebDriverWait

    def wait() -> Any:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(
            check, message=f"the page never showed {what}")

    return await asyncio.to_thread(wait)


def js(script: str) -> Callable[[Any], Any]:
    """A check that runs ``script`` in the page (``return ...``)."""
    return lambda driver: driver.execute_script(script)


def kpi(driver: Any, name: str) -> float:
    value = driver.execute_script(f"return document.getElementById('kpi-{name}').dataset.value")
    return float(value or 0)


async def chat(session: aiohttp.ClientSession, url: str, model: str, prompt: str,
               max_tokens: int, stream: bool = False) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}],
            "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    async with session.post(f"{url}/v1/chat/completions", json=body,
                            headers={"Authorization": f"Bearer {KEY}"}) as resp:
        assert resp.status == 200, await resp.text()
        if stream:
            async for _ in resp.content:
                pass
            return {}
        return await resp.json()


# Records each request the in-flight table shows, with the most tokens it showed for it.
RECORD_IN_FLIGHT = """
window.seenInFlight = {};
const record = () => {
  for (const row of document.querySelectorAll('#inflight tbody tr[data-id]')) {
    const id = row.dataset.id;
    const tokens = Number(row.querySelector('td.tokens').dataset.value);
    window.seenInFlight[id] = Math.max(window.seenInFlight[id] || 0, tokens);
  }
};
new MutationObserver(record).observe(document.getElementById('inflight'),
                                     {childList: true, subtree: true});
record();
"""

PROMPT = "Tell me, slowly and at length, how an actor system keeps its mailboxes bounded. " * 3


async def test_the_dashboard_shows_the_server_live(
    browser: Any, tiny_model_dir: Path, tmp_path: Path
) -> None:
    driver = browser
    async with real_stack(tiny_model_dir, api_key=KEY, cache_dir=str(tmp_path / "kv")) as stack, \
            aiohttp.ClientSession() as session:
        url, model = stack.server.url, stack.model
        await asyncio.to_thread(driver.get, f"{url}/")  # redirects to /dashboard

        # The stream wants the key: the page asks for it once, then connects.
        await wait_for(driver, "the API key dialog", js(
            "return document.getElementById('key-dialog').open"))
        await asyncio.to_thread(lambda: (
            driver.find_element("id", "key-input").send_keys(KEY),
            driver.find_element("css selector", "#key-form button").click()))
        await wait_for(driver, "the stream live", js(
            "return document.getElementById('conn').dataset.state === 'live'"))
        assert driver.execute_script("return sessionStorage.getItem('troupe-api-key')") == KEY

        # Every actor of the system, drawn.
        async with session.get(f"{url}/actors", headers={"x-api-key": KEY}) as resp:
            names = {actor["name"] for actor in await resp.json()}
        assert {"admission", "scheduler", "cache_index", "ssd_writer", "memory_monitor",
                "engine_pool"} <= names
        drawn = await wait_for(driver, "every actor", lambda d: (
            set(d.execute_script(
                "return [...document.querySelectorAll('a.actor')].map(a => a.dataset.actor)"))
            >= names and d.execute_script(
                "return [...document.querySelectorAll('a.actor')].map(a => a.dataset.actor)")))
        assert set(drawn) == names

        # A request in flight, its tokens counted, then among the finished. What the page
        # showed is recorded as it draws: a fast machine may finish between two polls.
        await asyncio.to_thread(driver.execute_script, RECORD_IN_FLIGHT)
        tokens_before = kpi(driver, "tokens")
        first = asyncio.create_task(chat(session, url, model, PROMPT, 400, stream=True))
        request_id = await wait_for(driver, "a request in flight", js(
            "return Object.keys(window.seenInFlight)[0]"))
        assert request_id.startswith("chatcmpl-")
        await wait_for(driver, "the token counter rising",
                       lambda d: kpi(d, "tokens") > tokens_before)
        await first
        await wait_for(driver, "the request among the finished", js(
            f"const row = document.querySelector('#finished tr[data-id=\"{request_id}\"]');"
            "return row && row.dataset.outcome === 'length'"))
        assert driver.execute_script(f"return window.seenInFlight['{request_id}']") > 0
        assert kpi(driver, "tokens") >= tokens_before + 400

        # The same prompt again: its prefix comes from the cache.
        again = await chat(session, url, model, PROMPT, 8)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        await wait_for(driver, "a cache hit", lambda d: kpi(d, "hit") > 0 and d.execute_script(
            f"const row = document.querySelector('#finished tr[data-id=\"{again['id']}\"]');"
            "return row && Number(row.querySelector('td.cached').dataset.value) > 0"))
        hit_tokens = driver.execute_script(
            "return Number(document.querySelector('#cache .hit-tokens .v').dataset.value)")
        assert hit_tokens > 0

        # Under load: a few requests at once, then the screenshot.
        load = [asyncio.create_task(chat(session, url, model, f"{PROMPT} {i}" * (1 + i % 2),
                                         200 + 60 * i, stream=True)) for i in range(4)]
        decoding = "return document.querySelectorAll('#inflight tr[data-stage=decoding]').length"
        # (On a machine fast enough to finish them first, the picture is taken all the same.)
        await wait_for(driver, "requests decoding together", lambda d: (
            d.execute_script(decoding) >= 2 or all(task.done() for task in load)))
        await asyncio.sleep(1.0)  # a chart point or two more
        await _screenshot(driver, tmp_path / "dashboard.png")
        await asyncio.gather(*load)

        # Clicking an actor opens its own snapshot (fetched with the key).
        await asyncio.to_thread(
            lambda: driver.find_element("css selector", 'a.actor[data-actor="scheduler"]').click())
        text = await wait_for(driver, "the scheduler's snapshot", js(
            "const body = document.getElementById('drawer-body').textContent;"
            "return body.includes('troupe.actors.scheduler.Scheduler') && body"))
        assert '"name": "scheduler"' in text and '"report"' in text
        assert driver.find_element("id", "drawer-raw").get_attribute("href").endswith(
            "/actors/scheduler")
        # No script error; the one 401 is the stream's first try, before the key was given.
        errors = [entry["message"] for entry in driver.get_log("browser")
                  if entry["level"] == "SEVERE" and "/actors/events - " not in entry["message"]]
        assert errors == []


async def _screenshot(driver: Any, path: Path) -> None:
    """The whole page as a PNG at ``path``, and at $TROUPE_DASHBOARD_PNG when set."""
    def take() -> None:
        height = driver.execute_script("return document.documentElement.scrollHeight")
        driver.set_window_size(1440, min(height + 20, 2400))
        driver.save_screenshot(str(path))

    await asyncio.to_thread(take)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    target = os.environ.get("TROUPE_DASHBOARD_PNG")
    if target:
        shutil.copyfile(path, target)
