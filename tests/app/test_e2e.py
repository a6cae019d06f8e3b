"""End to end: `streamlit run` on a free loopback port, driven by headless Chromium (Playwright).

Edits the Playground's mod in the browser, runs Check, waits for its verdict and saves
screenshots under test-artifacts/ (git-ignored) for a person to look at.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "test-artifacts"
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]

# A causal mask at Q_LEN = KV_LEN = 128 keeps 128·129/2 = 8,256 of 16,384 positions: seeing that
# count proves the browser's edit reached the server.
# Typed line by line: Ace indents the body itself after the colon, and Escape closes its
# autocompletion popup so that Enter starts a new line instead of accepting a suggestion.
EDITED_LINES = ["def mask_mod(b, h, q_idx, kv_idx):", "return q_idx >= kv_idx"]

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not Path(CHROMIUM).exists(),
                                 reason=f"{CHROMIUM} is missing (apt-get install chromium; "
                                        ".ci/run installs it)")]


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"streamlit exited with code {proc.returncode}")
        try:
            with urllib.request.urlopen(url + "/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"streamlit did not answer at {url} within {timeout} s")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    port = _free_port()
    ARTIFACTS.mkdir(exist_ok=True)
    log = open(ARTIFACTS / "streamlit-e2e.log", "w")
    env = {**os.environ, "FLEXLAB_RESULTS_DIR": str(tmp_path_factory.mktemp("results"))}
    proc = subprocess.Popen(
        [sys.executable, "-m", "streamlit", "run", "app/streamlit_app.py", "--server.headless", "true",
         "--server.address", "127.0.0.1", "--server.port", str(port),
         "--browser.gatherUsageStats", "false"],
        cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url, proc)
        yield url
    finally:
        # The server's own process group holds its child processes (the code checker): stop them
        # together, by the group id of the process this test started.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


def _settle(page) -> None:
    """Wait until Streamlit has finished running the script and the charts are drawn."""
    status = page.locator('[data-testid="stStatusWidget"]')
    try:
        status.wait_for(state="hidden", timeout=120_000)
    except Exception:  # noqa: BLE001 - a screenshot of a busy page still helps
        pass
    page.mouse.move(0, 0)  # no tooltip over the results
    page.wait_for_timeout(1500)


def _visit_tabs(page, errors, tabs) -> None:
    """Open each Playground tab (pressing its button), wait for its result, screenshot it."""
    from playwright.sync_api import expect

    for tab, button, ready in tabs:
        page.get_by_role("tab", name=tab).click()
        if button:
            page.get_by_role("button", name=button, exact=True).click()
        expect(page.get_by_text(ready, exact=False).first).to_be_visible(timeout=120_000)
        _settle(page)
        page.screenshot(path=str(ARTIFACTS / f"e2e-tab-{tab.lower().replace(' ', '-')}.png"),
                        full_page=True)
        assert errors.count() == 0, errors.first.inner_text()


def test_edit_mod_and_check_in_browser(server):
    from playwright.sync_api import expect, sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        # Tall enough for the Check results: Streamlit scrolls inside its main block, so a
        # full-page screenshot shows only what fits the viewport.
        page = browser.new_page(viewport={"width": 1500, "height": 2200})
        try:
            page.goto(server, wait_until="domcontentloaded")
            expect(page.get_by_role("heading", name="Playground")).to_be_visible(timeout=60_000)
            # The template is checked on first load: its mask caption appears.
            expect(page.get_by_text("positions (", exact=False).first).to_be_visible(timeout=180_000)
            _settle(page)
            page.screenshot(path=str(ARTIFACTS / "e2e-playground.png"), full_page=True)
            errors = page.locator('[data-testid="stAlertContentError"]')
            # The template's views: a windowed causal mask with an ALiBi bias.
            _visit_tabs(page, errors, (("Block map", None, "Sparsity (blocks skipped)"),
                                       ("Scores", None, "Scores after score_mod")))

            editor = page.frame_locator("iframe[title='streamlit_ace.streamlit_ace']")
            editor.locator(".ace_content").click()
            page.keyboard.press("Control+A")
            page.keyboard.press("Delete")
            for i, line in enumerate(EDITED_LINES):
                if i:
                    page.keyboard.press("Enter")
                page.keyboard.type(line, delay=20)
                page.keyboard.press("Escape")
            page.wait_for_timeout(1500)  # Ace sends its value after 200 ms without typing

            page.get_by_role("tab", name="Check").click()
            page.get_by_role("button", name="Check", exact=True).click()
            verdict = page.get_by_text("Check passed for", exact=False).or_(
                page.get_by_text("Check failed for", exact=False))
            # An error box would mean the edit went wrong: stop waiting then too.
            expect(verdict.or_(errors).first).to_be_visible(timeout=240_000)
            page.screenshot(path=str(ARTIFACTS / "e2e-check.png"), full_page=True)
            assert errors.count() == 0, errors.first.inner_text()
            expect(page.get_by_text("Kept 8,256 of 16,384 positions", exact=False)).to_be_visible(
                timeout=30_000)
            _settle(page)
            page.screenshot(path=str(ARTIFACTS / "e2e-check.png"), full_page=True)
            assert page.get_by_text("Check passed for float32, float16, bfloat16").count() == 1, \
                "flexcore should pass the check for a causal mask in every dtype"
            assert page.get_by_text("Traceback").count() == 0

            # The other tabs, run from the browser too.
            _visit_tabs(page, errors, (("Triton code", None, "mask_mod_fn"),
                                       ("Gradients", "Gradients", "max |grad"),
                                       ("Benchmark", "Benchmark", "Median latency, ms"),
                                       ("Export", "Prepare the report", "Download .json")))

            # The other pages, for a person to look at.
            for name, ready in (("Gallery", "Open in Playground"), ("Environment", "Attention providers"),
                                ("Benchmarks", "Run a preset on this machine")):
                page.get_by_role("link", name=name).click()
                expect(page.get_by_text(ready).first).to_be_visible(timeout=60_000)
                _settle(page)
                page.screenshot(path=str(ARTIFACTS / f"e2e-{name.lower()}.png"), full_page=True)
                assert page.get_by_text("Traceback").count() == 0

            # Back in the Playground, the editor still holds the edited mod.
            page.get_by_role("link", name="Playground").click()
            expect(page.get_by_text("Kept 8,256 of 16,384 positions", exact=False)).to_be_visible(
                timeout=60_000)
            text = page.frame_locator("iframe[title='streamlit_ace.streamlit_ace']").locator(
                ".ace_content").inner_text()
            assert "return q_idx >= kv_idx" in text and "WINDOW" not in text, text
        finally:
            browser.close()
