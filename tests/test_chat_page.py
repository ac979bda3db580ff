"""The chat page at GET /, end to end in headless Chromium driven by Playwright."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page, Route

    from tests.server_util import Server

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
REPLY_TIMEOUT_MS = 120_000  # the CPU engine on two cores: model load, prefill, then ~8 tok/s

if not CHROMIUM.exists():
    pytest.skip(f"{CHROMIUM} is missing (Debian: apt-get install -y chromium)", allow_module_level=True)
playwright_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
expect = playwright_api.expect

# True once the last assistant message shows text while its reply is still streaming.
STREAMING_WITH_TEXT = """() => {
  const reply = [...document.querySelectorAll('.message.assistant')].pop();
  return reply && reply.dataset.state === 'streaming' && reply.querySelector('.answer').textContent.trim() !== '';
}"""


@pytest.fixture(scope="module")
def base_url(smollm2_server: Server) -> str:
    return smollm2_server.base_url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield browser
        browser.close()


@pytest.fixture
def page(browser: Browser) -> Iterator[Page]:
    context = browser.new_context()
    page = context.new_page()
    yield page
    context.close()


def open_page(page: Page, base_url: str) -> None:
    page.goto(f"{base_url}/")
    expect(page.locator("#model")).not_to_have_text(re.compile(r"^(loading…|model unavailable)$"))


def send(page: Page, prompt: str, max_tokens: int) -> None:
    if not page.locator("#settings").evaluate("details => details.open"):
        page.click("#settings > summary")
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.press("#prompt", "Enter")


def sse(*chunks: dict) -> str:
    frames = [f"data: {json.dumps(c)}\n\n" for c in chunks]
    return "".join(frames) + "data: [DONE]\n\n"


def delta(**fields: str) -> dict:
    return {
        "object": "chat.completion.chunk",
        "choices": [{"index": 0, "delta": fields, "finish_reason": None}],
    }


def test_page_shows_the_model_and_streams_a_reply(page: Page, base_url: str) -> None:
    open_page(page, base_url)
    expect(page.locator("#context")).to_have_text(re.compile(r"^[\d,]+ tokens context$"))
    expect(page.locator("#api-key")).to_be_hidden()

    send(page, "Write one sentence about the sea.", max_tokens=24)
    page.wait_for_function(STREAMING_WITH_TEXT, timeout=REPLY_TIMEOUT_MS)
    expect(page.locator("#stop")).to_be_enabled()
    expect(page.locator("#send")).to_be_disabled()

    reply = page.locator(".message.assistant").last
    expect(reply).to_have_attribute("data-state", "done", timeout=REPLY_TIMEOUT_MS)
    expect(reply.locator(".answer")).to_have_text(re.compile(r"\S"))
    expect(reply.locator(".thinking")).to_be_hidden()
    expect(page.locator("#stop")).to_be_disabled()
    expect(page.locator("#prompt")).to_have_value("")


def test_fresh_pages_answer_right_with_the_servers_sampling(browser: Browser, base_url: str) -> None:
    """The page leaves sampling to the server, whose defaults for the embedded demo model are
    greedy (sampled as SmolLM2's card says, its first answer token is a near coin flip between
    "The" and "L"): ten fresh pages all say Paris."""
    sent: list[dict] = []
    answers, console_errors = [], []
    for _ in range(10):
        context = browser.new_context()
        page = context.new_page()
        page.on("request", lambda r: sent.append(r.post_data_json) if r.url.endswith("/chat/completions") else None)
        page.on("console", lambda m: console_errors.append(m.text) if m.type == "error" else None)
        open_page(page, base_url)
        send(page, "What is the capital of France?", max_tokens=24)
        reply = page.locator(".message.assistant").last
        expect(reply).to_have_attribute("data-state", "done", timeout=REPLY_TIMEOUT_MS)
        answers.append(reply.locator(".answer").text_content() or "")
        context.close()
    assert len(sent) == 10 and not any({"temperature", "top_p", "top_k"} & set(body) for body in sent)
    assert all("Paris" in a for a in answers), answers
    assert console_errors == []  # no favicon 404 either


def test_stop_ends_a_long_reply_and_the_chat_goes_on(page: Page, base_url: str) -> None:
    open_page(page, base_url)
    send(page, "Tell me a very long story about a lighthouse keeper.", max_tokens=4096)
    page.wait_for_function(STREAMING_WITH_TEXT, timeout=REPLY_TIMEOUT_MS)
    page.click("#stop")

    reply = page.locator(".message.assistant").last
    expect(reply).to_have_attribute("data-state", "stopped")
    expect(reply.locator(".meta")).to_contain_text("stopped")
    expect(page.locator("#send")).to_be_enabled()
    stopped_at = reply.locator(".answer").text_content()
    page.wait_for_timeout(1500)
    assert reply.locator(".answer").text_content() == stopped_at, "text kept arriving after Stop"
    for _ in range(50):  # aborting the stream ends the generation on the server too
        if page.request.get(f"{base_url}/health").json()["active_sequences"] == 0:
            break
        page.wait_for_timeout(200)
    else:
        pytest.fail("the stopped generation is still running on the server")

    # The server let go of the stopped generation: a new short reply finishes promptly.
    send(page, "Now say goodbye.", max_tokens=8)
    expect(page.locator(".message.assistant").last).to_have_attribute(
        "data-state", "done", timeout=REPLY_TIMEOUT_MS
    )


def test_reasoning_is_shown_apart_from_the_answer(page: Page, base_url: str) -> None:
    body = sse(
        delta(role="assistant"), delta(reasoning_content="The user greets me."), delta(content="Hello!")
    )
    page.route(
        "**/v1/chat/completions", lambda route: route.fulfill(content_type="text/event-stream", body=body)
    )
    open_page(page, base_url)
    send(page, "Hi", max_tokens=8)

    reply = page.locator(".message.assistant").last
    expect(reply).to_have_attribute("data-state", "done")
    expect(reply.locator(".answer")).to_have_text("Hello!")
    thinking = reply.locator("details.thinking")
    expect(thinking).to_be_visible()
    expect(thinking).not_to_have_attribute("open", "")  # folded once the answer started
    thinking.locator("summary").click()
    expect(thinking.locator(".reasoning")).to_have_text("The user greets me.")


def test_api_key_field_and_error_envelope(page: Page, base_url: str) -> None:
    seen_auth: list[str | None] = []

    def chat(route: Route) -> None:
        auth = route.request.headers.get("authorization")
        seen_auth.append(auth)
        if auth != "Bearer sk-test":
            error = {"message": "Missing or invalid API key.", "type": "authentication_error"}
            route.fulfill(status=401, json={"error": error})
        else:
            route.fulfill(content_type="text/event-stream", body=sse(delta(content="Welcome.")))

    page.route("**/v1/chat/completions", chat)
    open_page(page, base_url)
    expect(page.locator("#api-key")).to_be_hidden()

    send(page, "Hello?", max_tokens=8)
    expect(page.locator("#messages .error")).to_contain_text("Missing or invalid API key.")
    expect(page.locator("#api-key")).to_be_visible()  # a 401 reveals the key field

    page.fill("#api-key", "sk-test")
    send(page, "Hello again?", max_tokens=8)
    expect(page.locator(".message.assistant").last.locator(".answer")).to_have_text("Welcome.")
    assert seen_auth == [None, "Bearer sk-test"]


def test_key_field_shows_when_health_says_auth_is_required(page: Page, base_url: str) -> None:
    page.route("**/health", lambda route: route.fulfill(json={"status": "ok", "auth_required": True}))
    page.goto(f"{base_url}/")
    expect(page.locator("#api-key")).to_be_visible()
