"""The app end to end in a real browser: Playwright drives Debian's chromium against
`specdeck ui` on 127.0.0.1 with SmolLM2-135M (greedy, fp32 on the CPU).

Chromium comes from apt (`make test` installs it when /usr/bin/chromium is missing); Playwright
never downloads a browser here. Screenshots of every tab go to test-artifacts/ui/, with the
app's log and the measured time from `specdeck ui` to a usable page.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.browser]

ROOT = Path(__file__).resolve().parent.parent
ARTIFACTS = ROOT / "test-artifacts" / "ui"
CHROMIUM = Path("/usr/bin/chromium")
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
               "--disable-component-update", "--disable-sync", "--no-first-run"]
# greedy SmolLM2 answers this with repeats the n-gram drafter catches (accepted drafts)
PROMPT = "Explain what a Python list is, with a code example."
START_TIMEOUT_S = 300  # the first start converts the GGUF once


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class App:
    """`specdeck ui` in a subprocess, its output collected, its start timed."""

    def __init__(self, args: list[str], env: dict[str, str] | None = None,
                 log_name: str = "app.log") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/"
        self.lines: list[str] = []
        self.log_name = log_name
        self.started = time.perf_counter()
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "PYTHONUNBUFFERED": "1",
               **(env or {})}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "app", "ui", *args, "--port", str(self.port)],
            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip())

    def wait_ready(self) -> float:
        deadline = time.perf_counter() + START_TIMEOUT_S
        while time.perf_counter() < deadline:
            if any("the app is ready at" in line for line in self.lines):
                return time.perf_counter() - self.started
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        pytest.fail("specdeck ui did not start:\n" + "\n".join(self.lines[-40:]))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / self.log_name).write_text("\n".join(self.lines) + "\n", encoding="utf-8")


@pytest.fixture(scope="module")
def browser():
    if not CHROMIUM.exists():
        pytest.skip("no /usr/bin/chromium: `make test` installs it (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api")
    with sync_api.sync_playwright() as playwright:
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), headless=True,
                                              args=LAUNCH_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def app(smollm2_gguf, browser) -> Iterator[App]:
    running = App(["--target", str(smollm2_gguf), "--drafter", "ngram", "--k", "4"])
    ready_s = running.wait_ready()
    page = browser.new_page()
    page.goto(running.url)
    page.wait_for_selector('#model-bar [data-loaded="true"]', timeout=60_000)
    page.wait_for_selector("#chat-input textarea")
    usable_s = time.perf_counter() - running.started
    page.close()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "startup.txt").write_text(
        f"specdeck ui start -> server ready: {ready_s:.1f} s\n"
        f"specdeck ui start -> usable page in chromium: {usable_s:.1f} s\n", encoding="utf-8")
    yield running
    running.stop()


@pytest.fixture
def page(browser, app):
    context = browser.new_context(viewport={"width": 1400, "height": 1000})
    tab = context.new_page()
    tab.goto(app.url)
    tab.wait_for_selector("#chat-input textarea")
    yield tab
    context.close()


def shot(page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


def set_number(page, elem_id: str, value: int) -> None:
    box = page.locator(f"#{elem_id} input[type=number]")
    box.fill(str(value))
    box.press("Enter")


def send(page, text: str) -> None:
    page.fill("#chat-input textarea", text)
    page.press("#chat-input textarea", "Enter")


def status(page) -> str:
    return page.get_attribute("#chat-stats .sd-status", "data-status") or ""


def stat(page, key: str) -> str:
    return page.inner_text(f'#chat-stats [data-stat="{key}"] .sd-card-value')


def wait_status(page, prefix: str, timeout_s: float = 120) -> None:
    page.wait_for_selector(f'#chat-stats .sd-status[data-status^="{prefix}"]',
                           timeout=timeout_s * 1000)


def bot_messages(page):
    return page.locator('#chatbot [data-testid="bot"]')


def test_chat_streams_a_reply_while_the_stats_move_and_drafts_light_up(page):
    set_number(page, "chat-max-new", 48)
    send(page, PROMPT)
    lengths, counts = [], []
    deadline = time.perf_counter() + 120
    while time.perf_counter() < deadline and not status(page).startswith("done"):
        if bot_messages(page).count():
            lengths.append(len(bot_messages(page).last.inner_text()))
            counts.append(int(stat(page, "new_tokens")))
        time.sleep(0.05)
    wait_status(page, "done", 5)
    shot(page, "chat")
    assert len({n for n in lengths if n}) >= 3, f"the reply did not stream: {lengths}"
    assert len(set(counts)) >= 3 and counts == sorted(counts), counts
    assert 0 < int(stat(page, "new_tokens")) <= 48
    assert page.locator("#chatbot .sd-draft").count() > 0
    assert float(stat(page, "tau")) > 1.0
    assert page.locator("#chat-positions g.mark-rect path").count() >= 1  # acceptance bars


def test_race_streams_both_sides_and_ends_with_an_identical_verdict(page):
    page.get_by_role("tab", name="Race").click()
    page.fill("#race-prompt textarea", PROMPT)
    set_number(page, "race-max-new", 32)
    page.click("#race-start")
    page.wait_for_selector("#race-verdict :text('Identical outputs')", timeout=180_000)
    shot(page, "race")
    verdict = page.inner_text("#race-verdict")
    assert re.search(r"Speedup \d+\.\d\d×", verdict) and "all 32 tokens match" in verdict
    assert page.inner_text("#race-plain") and page.locator("#race-spec .sd-draft").count() > 0
    assert page.get_attribute("#race-spec-stats .sd-lane-stats", "data-state") == "done"


def test_stop_mid_reply_then_the_next_message_is_answered(page):
    set_number(page, "chat-max-new", 256)
    send(page, PROMPT)
    page.wait_for_function("() => { const c = document.querySelector("
                           "'#chat-stats [data-stat=\"new_tokens\"] .sd-card-value');"
                           " return c && Number(c.innerText) >= 4; }", timeout=120_000)
    page.click("#chat-stop")
    wait_status(page, "stopped", 60)
    assert "stopped" in bot_messages(page).last.inner_text()
    assert int(stat(page, "new_tokens")) < 256
    shot(page, "stop")
    set_number(page, "chat-max-new", 16)
    send(page, "Thanks. Say goodbye.")
    wait_status(page, "done", 120)
    assert bot_messages(page).count() == 2 and bot_messages(page).last.inner_text().strip()


def test_closing_the_tab_mid_reply_leaves_the_app_serving(browser, app, page):
    gone = browser.new_context().new_page()
    gone.goto(app.url)
    gone.wait_for_selector("#chat-input textarea")
    set_number(gone, "chat-max-new", 256)
    send(gone, PROMPT)
    wait_status(gone, "generating", 120)
    gone.context.close()
    set_number(page, "chat-max-new", 16)
    send(page, "Say hello.")
    wait_status(page, "done", 120)
    assert bot_messages(page).last.inner_text().strip()


def test_models_tab_lists_the_catalogue_with_status_and_the_planners_choice(page):
    page.get_by_role("tab", name="Models").click()
    page.wait_for_selector("#models-table :text('smollm2-135m+ngram')")
    page.wait_for_selector("#models-details .sd-pair")
    assert "auto picks" in page.inner_text("#models-table")
    assert "auto drafter for this target" in page.inner_text("#models-details")
    shot(page, "models")
    choose = page.locator("#models-pair input")
    choose.click()
    choose.fill("smollm2-135m+ngram")
    choose.press("Enter")
    page.wait_for_selector('#models-details [data-pair="smollm2-135m+ngram"]')
    page.click("#models-load")
    page.wait_for_function("() => document.querySelector('#model-bar').innerText"
                           ".startsWith('SmolLM2-135M with prompt lookup')", timeout=120_000)
    assert "installed, loaded" in page.inner_text("#models-table")


def test_bench_tab_runs_plain_against_ngram_and_plots_the_result(page):
    page.get_by_role("tab", name="Bench").click()
    set_number(page, "bench-limit", 1)
    set_number(page, "bench-max-new", 32)
    page.click("#bench-run")
    page.wait_for_function("() => document.querySelector('#bench-log textarea')"
                           ".value.includes('finished in')", timeout=180_000)
    assert "plain" in page.inner_text("#bench-table")
    assert page.locator("#bench-tau g.mark-rect path").count() >= 2
    shot(page, "bench")
