"""End to end: `streamlit run` on a free loopback port, driven by headless Chromium (Playwright).

Each test works in the browser as a user would and saves screenshots under test-artifacts/
(git-ignored) for a person to look at: a reload restores the experiment; a worker crash is
reported and the next action works; an export after an edit is refused as stale; an unseeded
random captured tensor gives matching gradients; two mods compare side by side; table numbers are
written in full.
"""
from __future__ import annotations

import json
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
LONG = 240_000  # ms: actions under Triton's interpreter on a busy two-core machine

# A causal mask at the CPU default Q_LEN = KV_LEN = 128 keeps 128·129/2 = 8,256 of 16,384
# positions: seeing that count proves the code reached the worker.
CAUSAL = "def mask_mod(b, h, q_idx, kv_idx):\n    return q_idx >= kv_idx\n"
CAUSAL_KEPT = "Kept 8,256 of 16,384 positions"
UNSEEDED = ("import torch\n\nbias = torch.randn(H, requires_grad=True)\n\n\n"
            "def score_mod(score, b, h, q_idx, kv_idx):\n"
            "    return score + bias[h] * (q_idx - kv_idx) / Q_LEN\n")
CRASH = "import os\n\nos.kill(os.getpid(), 9)\n"
WINDOW = ("def mask_mod(b, h, q_idx, kv_idx):\n"
          "    return (q_idx >= kv_idx) & (q_idx - kv_idx < 32)\n")

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
    env = {**os.environ, "FLEXLAB_RESULTS_DIR": str(tmp_path_factory.mktemp("results")),
           "FLEXLAB_DATA_DIR": str(tmp_path_factory.mktemp("data"))}
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
        # The server's own process group holds its worker process: stop them together, by the
        # group id of the process this test started.
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=20)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
        log.close()


@pytest.fixture(scope="module")
def browser():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        b = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield b
        b.close()


@pytest.fixture
def context(browser):
    # Tall enough for the results: Streamlit scrolls inside its main block, so a full-page
    # screenshot shows only what fits the viewport.
    ctx = browser.new_context(viewport={"width": 1500, "height": 3400})
    yield ctx
    ctx.close()


@pytest.fixture
def page(context, server):
    """The Playground, with the plain text editor (which the tests fill)."""
    from playwright.sync_api import expect

    p = context.new_page()
    p.goto(server, wait_until="domcontentloaded")
    expect(p.get_by_role("heading", name="Playground")).to_be_visible(timeout=60_000)
    # A click that lands while the script reruns can be lost with the old element: while the
    # editor does not show, turn the toggle on again if it is off (a loaded machine reruns slowly).
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    toggle = p.get_by_role("switch", name="Plain text editor")
    deadline = time.monotonic() + LONG / 1000
    while True:
        if not toggle.is_checked():
            p.get_by_text("Plain text editor").click()
        try:
            p.locator("textarea").first.wait_for(timeout=20_000)
            return p
        except PlaywrightTimeout:
            if time.monotonic() > deadline:
                raise


def _settle(page) -> None:
    """Wait until Streamlit has finished running the script and the charts are drawn."""
    status = page.locator('[data-testid="stStatusWidget"]')
    try:
        status.wait_for(state="hidden", timeout=LONG)
    except Exception:  # noqa: BLE001 - a screenshot of a busy page still helps
        pass
    page.mouse.move(0, 0)  # no tooltip over the results
    page.wait_for_timeout(1200)


def _shot(page, name: str) -> None:
    _settle(page)
    page.screenshot(path=str(ARTIFACTS / f"e2e-{name}.png"), full_page=True)


def _set_code(page, code: str) -> None:
    area = page.locator("textarea").first
    area.fill(code)
    area.press("Control+Enter")  # commits the text area's value to the app
    _settle(page)


def _press(page, tab: str | None, button: str, until) -> None:
    """Open ``tab``, press ``button`` and wait until ``until`` (a locator) shows. A click that lands
    while the script reruns is lost with the old element: where the app is idle without the
    result, press again (a press on a result already computed only redraws it)."""
    from playwright.sync_api import TimeoutError as PlaywrightTimeout

    status = page.locator('[data-testid="stStatusWidget"]')
    deadline = time.monotonic() + LONG / 1000
    while True:
        if tab:
            page.get_by_role("tab", name=tab, exact=True).click()
        page.get_by_role("button", name=button, exact=True).click()
        while True:
            try:
                until.first.wait_for(timeout=15_000)
                return
            except PlaywrightTimeout:
                if time.monotonic() > deadline:
                    raise
            if not status.is_visible():
                break  # idle with no result: the press was lost


def _errors(page):
    return page.locator('[data-testid="stAlertContentError"]')


def test_a_reload_restores_the_experiment(page):
    from playwright.sync_api import expect

    _set_code(page, CAUSAL)
    _press(page, "Check", "Check", page.get_by_text("Check passed for", exact=False))
    expect(page.get_by_text(CAUSAL_KEPT, exact=False)).to_be_visible(timeout=LONG)
    _shot(page, "reload-before")
    assert "exp=" in page.url
    url = page.url
    page.reload(wait_until="domcontentloaded")
    expect(page.get_by_text(CAUSAL_KEPT, exact=False)).to_be_visible(timeout=LONG)
    page.get_by_role("tab", name="Check", exact=True).click()
    expect(page.get_by_text("Check passed for float32, float16, bfloat16.")).to_be_visible(
        timeout=60_000)
    assert page.url == url
    # A new session shows the syntax-highlighting editor again, holding the saved code.
    ace = page.frame_locator("iframe[title='streamlit_ace.streamlit_ace']").locator(".ace_content")
    expect(ace).to_contain_text("return q_idx >= kv_idx", timeout=30_000)
    assert "WINDOW" not in ace.inner_text()
    _shot(page, "reload-after")
    assert _errors(page).count() == 0


def test_a_worker_crash_is_reported_and_the_next_action_works(page):
    from playwright.sync_api import expect

    _set_code(page, CRASH)
    _press(page, None, "Visualise", page.get_by_text("The worker process died", exact=False))
    expect(page.get_by_text("was killed (SIGKILL)", exact=False)).to_be_visible()
    _shot(page, "worker-crash")
    _set_code(page, CAUSAL)
    _press(page, None, "Visualise", page.get_by_text(CAUSAL_KEPT, exact=False))
    _shot(page, "worker-restarted")
    assert _errors(page).count() == 0


def test_an_export_after_a_code_change_is_refused_as_stale(page):
    from playwright.sync_api import expect

    _set_code(page, CAUSAL)
    _press(page, "Check", "Check", page.get_by_text("Check passed for", exact=False))
    _press(page, "Export", "Prepare the report", page.get_by_role("button", name="Download .html"))
    _shot(page, "export-current")
    _set_code(page, CAUSAL.replace(">=", ">"))
    page.get_by_role("tab", name="Export", exact=True).click()
    expect(page.get_by_text("The report prepared earlier is stale", exact=False)).to_be_visible(
        timeout=LONG)
    assert page.get_by_role("button", name="Download .html").count() == 0
    page.get_by_role("tab", name="Check", exact=True).click()
    expect(page.get_by_text("Stale: these results were computed from other code",
                            exact=False).first).to_be_visible()
    page.get_by_role("tab", name="Export", exact=True).click()
    _shot(page, "export-stale")


def test_an_unseeded_random_captured_tensor_gives_matching_gradients(page):
    from playwright.sync_api import expect

    _set_code(page, UNSEEDED)
    verdict = page.get_by_text("Every gradient passed", exact=False).or_(
        page.get_by_text("Gradients over the threshold", exact=False))
    _press(page, "Gradients", "Gradients", verdict)
    _shot(page, "gradients-unseeded")
    assert page.get_by_text("Every gradient passed", exact=False).count() == 1
    # The verdict can render before its table on a busy machine: wait for the table's last row.
    expect(page.locator('[data-testid="stTable"] td', has_text="dbias").first).to_be_visible(
        timeout=60_000)
    cells = page.locator('[data-testid="stTable"] td').all_inner_texts()
    assert "dbias" in cells and "FAIL" not in cells and cells.count("pass") >= 8, cells


def test_two_mods_compare_side_by_side(page):
    from playwright.sync_api import expect

    _set_code(page, WINDOW)
    # Against the gallery's causal mask, the default.
    _press(page, "Compare", "Compare", page.get_by_text("Both keep", exact=False))
    expect(page.get_by_text("max |difference|", exact=False)).to_be_visible()
    # Causal keeps 8,256 positions, the window 32·33/2 + 96·32 = 3,600 of them.
    for kept in ("3,600 of 16,384", "8,256 of 16,384"):
        expect(page.locator('[data-testid="stTable"] td', has_text=kept)).to_be_visible()
    _shot(page, "compare")
    assert _errors(page).count() == 0


def _results_file(path: Path) -> None:
    """A bench results file with a TFLOP/s value whose digits a narrow cell would cut."""
    base = {"run_id": "r", "variant": "causal", "batch": 4, "q_heads": 16, "kv_heads": 16,
            "q_len": 4096, "kv_len": 4096, "head_dim": 128, "v_head_dim": 128, "dtype": "bfloat16",
            "pass": "fwd", "density": 0.5, "status": "ok", "note": "", "ref_coverage": "all"}
    rows = []
    for provider, tflops, ms in (("flexlab", 440.0144, 0.3123), ("sdpa_flash", 389.5, 0.3528)):
        case = {**base, "case_id": "causal|B4|H16/16|Q4096|KV4096|D128/128|bfloat16|fwd",
                "provider": provider}
        rows += [{**case, "metric": "tflops", "value": tflops, "unit": "TFLOP/s"},
                 {**case, "metric": "time_ms", "value": ms, "unit": "ms"}]
    path.write_text(json.dumps({"schema": "flexlab-bench/1", "name": "h200", "envs": [],
                                "rows": rows}))


def test_numbers_in_tables_are_not_truncated(context, server, tmp_path):
    from playwright.sync_api import expect

    page = context.new_page()
    page.goto(server + "/benchmarks", wait_until="domcontentloaded")
    expect(page.get_by_role("heading", name="Load result files")).to_be_visible(timeout=60_000)
    _results_file(tmp_path / "results.json")
    page.locator('[data-testid="stFileUploader"] input[type="file"]').set_input_files(
        str(tmp_path / "results.json"))
    expect(page.get_by_text("median latency (ms)").first).to_be_visible(timeout=60_000)
    page.get_by_text("TFLOP/s", exact=True).first.click()
    cell = page.locator('[data-testid="stTable"] td', has_text="440.01")
    expect(cell).to_be_visible(timeout=60_000)
    assert cell.inner_text().strip() == "440.01"
    # The whole number fits its cell: nothing is cut off on either side.
    fits = cell.evaluate("el => el.scrollWidth <= el.clientWidth + 1")
    assert fits
    _shot(page, "numbers-in-full")
