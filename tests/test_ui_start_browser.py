"""`specdeck ui` with no arguments starts from what is installed, in a real browser (Playwright
on Debian's chromium), over a temporary SPECDECK_HOME that holds only what each test installs.

With SmolLM2's pair linked in, a message typed as soon as the page opens is answered with live
stats, on the Chat tab, without a visit to Models. With nothing installed, the page opens on
Models with the default pair's download button first.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from tests import test_ui_browser
from tests.installed import link_installed
from tests.test_ui_browser import (
    App,
    bot_messages,
    send,
    set_number,
    shot,
    stat,
    status,
    wait_status,
)

pytestmark = [pytest.mark.slow, pytest.mark.browser]
browser = test_ui_browser.browser  # the chromium fixture, shared

PROMPT = "Explain what a Python list is, with a code example."
PAIR = "smollm2-135m+ngram"


@pytest.fixture
def smollm2_home(tmp_path: Path, smollm2_gguf: Path) -> Path:
    if link_installed(tmp_path, "smollm2-135m-instruct") is None:
        pytest.skip("SmolLM2 is not installed in the store")
    return tmp_path


def started(args: list[str], home: Path, log_name: str) -> App:
    app = App(args, env={"SPECDECK_HOME": str(home)}, log_name=log_name)
    app.wait_ready()
    return app


def test_ui_without_arguments_loads_the_only_installed_pair_and_answers_at_once(
        browser, smollm2_home: Path) -> None:
    app = started([], smollm2_home, "start-installed.log")
    try:
        assert any(f"loading pair {PAIR} (the only installed pair)" in line
                   for line in app.lines), app.lines
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(app.url)
        page.wait_for_selector("#chat-input textarea")
        set_number(page, "chat-max-new", 32)
        send(page, PROMPT)  # typed at once: it waits for the pair if it is still loading
        counts = []
        deadline = time.perf_counter() + 400  # 2 shared cores: the load and 32 tokens
        while time.perf_counter() < deadline and not status(page).startswith("done"):
            if bot_messages(page).count():
                counts.append(int(stat(page, "new_tokens")))
            time.sleep(0.05)
        wait_status(page, "done", 5)
        shot(page, "start-installed")
        bar = page.inner_text("#model-bar")
        assert bar.startswith("SmolLM2-135M with prompt lookup"), bar
        assert "loaded at start: the only installed pair" in bar
        assert len(set(counts)) >= 3 and counts == sorted(counts), counts  # live stats
        assert 0 < int(stat(page, "new_tokens")) <= 32
        assert bot_messages(page).last.inner_text().strip()
        assert page.get_attribute("#tab-chat", "hidden") is None  # never left Chat
        page.context.close()
    finally:
        app.stop()
    remembered = json.loads((smollm2_home / "recent.json").read_text())
    assert remembered == {"last_pair": PAIR}


def test_ui_with_nothing_installed_opens_models_with_the_default_download_first(
        browser, tmp_path: Path) -> None:
    app = started([], tmp_path, "start-empty.log")
    try:
        page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
        page.goto(app.url)
        button = page.wait_for_selector("#models-get-default", timeout=60_000)
        page.wait_for_selector("#models-table", timeout=60_000)
        assert button.is_visible()
        assert button.inner_text().startswith("Download qwen2.5-coder-1.5b+0.5b")
        # first in the tab: above the catalogue table and the pair picker
        order = page.evaluate("""() => {
            const b = document.querySelector('#models-get-default');
            const t = document.querySelector('#models-table');
            return b.compareDocumentPosition(t) & Node.DOCUMENT_POSITION_FOLLOWING; }""")
        assert order
        assert "nothing is installed yet" in page.inner_text("#model-bar")
        shot(page, "start-empty")
        page.context.close()
    finally:
        app.stop()
