"""The chat page in a real headless browser: Debian's Chromium driven by chromedriver (Selenium).

Type a message, press Enter, and see the answer stream in: the page fills the assistant's bubble as
server-sent events arrive (the page counts the events it rendered) and shows tokens/s. A screenshot goes to $FLARE_SCREENSHOT (docs/images/chat-page.png when
made for the docs). Skipped with its reason where chromium/chromedriver or selenium are missing
(scripts/install-system.sh installs them; CI sets FLARE_REQUIRE_BROWSER=1, which turns the skip
into an error).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
try:
    from selenium import webdriver
except ImportError:
    webdriver = None
MISSING = ("selenium not installed (pip install selenium)" if webdriver is None else
           "chromium + chromium-driver not installed (scripts/install-system.sh)" if not (CHROMIUM and DRIVER) else None)
if MISSING and os.environ.get("FLARE_REQUIRE_BROWSER"):   # CI sets it: there the browser test must run
    raise RuntimeError(f"FLARE_REQUIRE_BROWSER is set but {MISSING}")
pytestmark = pytest.mark.skipif(MISSING is not None, reason=MISSING or "")

from flare.plugins.export import export_core  # noqa: E402
from flare.plugins.serve.process import ServerProcess  # noqa: E402


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """moe-lm tiny (quick); FLARE_BROWSER_MODEL=smollm2 serves SmolLM2 instead (the docs' screenshot:
    `FLARE_BROWSER_MODEL=smollm2 FLARE_SCREENSHOT=docs/images/chat-page.png pytest tests/test_serve_browser.py`)."""
    model = os.environ.get("FLARE_BROWSER_MODEL")
    if model:
        s = ServerProcess(model, timeout=600)
        yield s
        s.stop()
        return
    core = export_core("moe-lm", tmp_path_factory.mktemp("browser") / "tiny.core", progress=False)
    s = ServerProcess(str(core))
    yield s
    s.stop()


@pytest.fixture()
def browser():
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="flare-chromium-")
    opts = Options()
    opts.binary_location = CHROMIUM
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", f"--user-data-dir={profile}", "--window-size=900,700"):
        opts.add_argument(flag)
    driver = webdriver.Chrome(service=Service(DRIVER), options=opts)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def test_type_a_message_and_see_a_streamed_answer(server, browser) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    browser.get(server.url + "/")
    assert "Flare chat" in browser.title
    box = browser.find_element(By.ID, "input")
    box.send_keys(os.environ.get("FLARE_BROWSER_MESSAGE", "Hello, who are you?"))
    box.send_keys(Keys.ENTER)
    WebDriverWait(browser, 300).until(lambda d: d.find_element(By.TAG_NAME, "body").get_attribute("data-state") == "done")
    answer = browser.find_element(By.CSS_SELECTOR, ".assistant")
    stats = browser.find_element(By.CSS_SELECTOR, ".stats").text
    assert "error" not in answer.get_attribute("class"), answer.text
    assert "tokens/s" in stats and "tokens" in stats, stats
    events = int(browser.find_element(By.CSS_SELECTOR, ".stats").get_attribute("data-events"))
    assert events >= 3 and answer.text, (events, answer.text)   # role, tokens..., finish: a stream rendered
    assert browser.find_element(By.CSS_SELECTOR, ".user").text == os.environ.get("FLARE_BROWSER_MESSAGE",
                                                                                 "Hello, who are you?")
    shot = os.environ.get("FLARE_SCREENSHOT")
    if shot:
        Path(shot).parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(shot)
