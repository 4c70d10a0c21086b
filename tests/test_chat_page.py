"""The chat page (GET /, chat.html) against a real serve.py: served as it is, and driven in headless
Chromium (Debian's chromium and chromium-driver, through selenium): an error shown readably, a
streamed greedy answer equal to the API's, a second turn that hits the prefix cache, and Stop."""
import re
import shutil
import time
import urllib.request

import pytest

from conftest import ROOT
from test_serve import API_KEY, metrics, post, start_server, stop_server

SYSTEM = "You are a helpful assistant. Answer in one sentence."
TURNS = ["What is the capital of France?", "And of Italy?"]
MAX_TOKENS = 24
WAIT = 300  # seconds for an answer: two shared cores, eager step


@pytest.fixture(scope="module")
def server(smollm2_dir):
    proc, url = start_server(smollm2_dir, "--no-compile", "--max_seq_length", 1024)
    yield url
    assert stop_server(proc) == 0


@pytest.fixture(scope="module")
def browser():
    chromium, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip("needs Chromium and chromedriver (make test installs them with apt-get where it runs as root)")
    webdriver = pytest.importorskip("selenium.webdriver", reason="needs selenium (pip install selenium)")
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for flag in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(flag)  # no sandbox: root in a container has none to give
    browser = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=driver))
    yield browser
    browser.quit()


def test_root_serves_the_page(server):
    with urllib.request.urlopen(server + "/") as r:  # no API key: the page asks for it
        assert r.status == 200 and r.headers["content-type"].startswith("text/html")
        assert r.read() == (ROOT / "chat.html").read_bytes()


def wait(browser):
    from selenium.webdriver.support.ui import WebDriverWait
    return WebDriverWait(browser, WAIT)


def field(browser, name: str, value: str):
    from selenium.webdriver.common.keys import Keys
    element = browser.find_element("id", name)
    element.clear()
    element.send_keys(value + Keys.TAB)  # leaving the field fires its change event


def answer(browser, count: int):
    """The count-th assistant message once it has finished (or stopped): its element and text."""
    def finished(b):
        found = b.find_elements("css selector", ".assistant")
        return len(found) >= count and found[count - 1].get_attribute("data-state") != "streaming" and found[count - 1]

    element = wait(browser).until(finished)
    return element, element.find_element("css selector", ".content").get_property("textContent")


def watch_answers(browser):
    """Record each text the answers show, to see them grow piece by piece."""
    browser.execute_script("""window.seen = [];
        new MutationObserver((records) => records.forEach((r) => {
            const c = r.target.closest && r.target.closest(".assistant .content");
            if (c) window.seen.push(c.textContent);
        })).observe(document.getElementById("log"), {subtree: true, childList: true, characterData: true});""")


def api_reply(server, messages) -> str:
    code, body = post(server, "/v1/chat/completions", {"messages": messages, "temperature": 0,
                                                       "max_tokens": MAX_TOKENS})
    assert code == 200, body
    return body["choices"][0]["message"]["content"]


def test_chat_in_the_browser(server, browser):
    browser.get(server + "/")
    field(browser, "input", TURNS[0])
    browser.find_element("id", "send").click()  # no API key yet: the server's 401, shown
    error = wait(browser).until(lambda b: b.find_element("css selector", ".error"))
    assert error.text.startswith("401: invalid or missing API key")
    assert browser.find_element("id", "input").get_property("value") == TURNS[0]  # back, to send again
    assert not browser.find_elements("css selector", ".user")

    field(browser, "api_key", API_KEY)
    field(browser, "system", SYSTEM)
    field(browser, "temperature", "0")
    field(browser, "max_tokens", str(MAX_TOKENS))
    watch_answers(browser)
    browser.find_element("id", "send").click()
    _, first = answer(browser, 1)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": TURNS[0]}]
    assert first and first == api_reply(server, messages)
    seen = browser.execute_script("return window.seen")
    assert len(set(seen)) > 2 and seen[-1] == first  # streamed: the answer grew piece by piece

    hits = metrics(server)["minillm_prefix_cache_hits_total"]
    field(browser, "input", TURNS[1])
    browser.find_element("css selector", "#input").send_keys("\n")  # Enter sends
    element, second = answer(browser, 2)
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": TURNS[1]}]
    assert second and second == api_reply(server, messages)
    # the second turn's prompt begins with the first turn's: found in the prefix cache, not prefilled again
    cached = re.search(r"(\d+) of (\d+) prompt tokens cached", element.text)
    assert cached and int(cached[1]) >= 16, element.text
    assert metrics(server)["minillm_prefix_cache_hits_total"] >= hits + int(cached[1])


def test_stop_ends_the_request(server, browser):
    browser.get(server + "/")  # the key and settings are kept (localStorage); the conversation is not
    assert browser.find_element("id", "api_key").get_property("value") == API_KEY
    field(browser, "max_tokens", "")
    field(browser, "input", "Write a long story about a dragon who learns to cook.")
    browser.find_element("id", "send").click()
    wait(browser).until(lambda b: b.find_element("css selector", ".assistant .content").get_property("textContent"))
    browser.find_element("id", "stop").click()
    element, text = answer(browser, 1)
    assert element.get_attribute("data-state") == "stopped" and text
    deadline = time.time() + 30
    while metrics(server)["minillm_requests_running"] and time.time() < deadline:
        time.sleep(0.2)
    assert metrics(server)["minillm_requests_running"] == 0  # the server cancelled it when the page hung up
    assert browser.find_element("id", "send").is_displayed()
