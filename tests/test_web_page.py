"""The chat page at ``/`` in a real headless browser (Debian's chromium and chromedriver, driven by selenium).

A module fixture serves the tiny model with an API key and jump-forward; each test drives the page as a person
would (type, press Enter, press Stop, pick an output format) and reads what the page shows. On a failure the test
saves a screenshot and the browser's console next to the server log (in the run's folder, kept when a test fails),
named after the test.
"""

from __future__ import annotations

import json
import shutil
import threading
import time
from collections.abc import Callable, Iterator

import httpx
import jsonschema
import pytest
from server_process import KEY, ServerProcess, aborted, metrics, run_folder_path, wait_idle

CHROMIUM, CHROMEDRIVER = shutil.which("chromium"), shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(not (CHROMIUM and CHROMEDRIVER),
                                reason="needs Debian's chromium and chromium-driver (scripts/install_system_deps.sh)")
webdriver = pytest.importorskip("selenium.webdriver")
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.remote.webdriver import WebDriver  # noqa: E402


@pytest.fixture(scope="module")
def server() -> Iterator[ServerProcess]:
    proc = ServerProcess("--model", "tiny", "--jump-forward", "--max-batch", "1", "--max-queue", "1")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def driver() -> Iterator[WebDriver]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--window-size=1280,900"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    browser = webdriver.Chrome(service=webdriver.ChromeService(CHROMEDRIVER), options=options)
    browser.set_script_timeout(30)
    yield browser
    browser.quit()


@pytest.fixture
def page(server: ServerProcess, driver: WebDriver, request: pytest.FixtureRequest) -> Iterator[WebDriver]:
    """The page freshly loaded, the API key typed in, the model's name shown."""
    driver.get(server.url + "/")
    driver.execute_script("sessionStorage.clear()")
    driver.refresh()
    until(driver, lambda: "API key" in text(driver, "server-status"), "the page asks for the key")
    key = driver.find_element(By.ID, "api-key")
    key.send_keys(KEY, Keys.TAB)  # the change event reloads /props with the key
    until(driver, lambda: text(driver, "model-name").startswith("tiny-llama"), "the model's name is shown")
    failed_before = request.session.testsfailed
    yield driver
    if request.session.testsfailed > failed_before:
        base = run_folder_path(f"web-{request.node.name}")
        driver.save_screenshot(base + ".png")
        with open(base + ".console.txt", "w") as f:
            f.write("\n".join(str(e) for e in driver.get_log("browser")))
        print(f"screenshot: {base}.png; server log: {server.log_path}")


def text(driver: WebDriver, element_id: str) -> str:
    return driver.find_element(By.ID, element_id).text


def until(driver: WebDriver, check: Callable[[], object], what: str, timeout: float = 60) -> object:
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting until {what}"
        time.sleep(0.05)


def fill(driver: WebDriver, element_id: str, value: str) -> None:
    box = driver.find_element(By.ID, element_id)
    box.clear()
    if value:
        box.send_keys(value)


def ask(driver: WebDriver, question: str) -> None:
    fill(driver, "prompt", question)
    driver.find_element(By.ID, "prompt").send_keys(Keys.ENTER)


def last_answer(driver: WebDriver, timeout: float = 60) -> dict[str, str]:
    """The last assistant message once it ended: its state, text (without the role and meta lines), meta, error."""
    def ended() -> dict[str, str] | None:
        return driver.execute_script("""
            const all = document.querySelectorAll('.message.assistant');
            const last = all[all.length - 1];
            if (!last || last.dataset.state === 'running') return null;
            const pick = (sel) => { const e = last.querySelector(sel); return e ? e.textContent : ''; };
            return {state: last.dataset.state, content: pick('.content'), meta: pick('.meta'), error: pick('.error'),
                    pieces: last.querySelector('.content').childNodes.length};""")
    return until(driver, ended, "the answer ended", timeout)


def select_format(driver: WebDriver, kind: str, spec: str = "") -> None:
    driver.execute_script("const s = document.getElementById('format-kind'); s.value = arguments[0];"
                          "s.dispatchEvent(new Event('change'));", kind)
    if spec:
        fill(driver, "format-spec", spec)


# ---------------------------------------------------------------------------------------------------- tests
def test_the_page_is_served_with_its_files_and_a_strict_policy(server: ServerProcess) -> None:
    page = httpx.get(server.url + "/", timeout=10)  # no key needed for the page itself
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert '<script src="/static/chat.js">' in page.text
    for name, kind in (("chat.js", "text/javascript"), ("chat.css", "text/css")):
        r = httpx.get(f"{server.url}/static/{name}", timeout=10)
        assert r.status_code == 200 and r.headers["content-type"].startswith(kind)
    assert httpx.get(server.url + "/static/secret.py", timeout=10).status_code == 404
    assert httpx.get(server.url + "/props", timeout=10).status_code == 401  # the API is still guarded
    props = httpx.get(server.url + "/props", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).json()
    assert props["features"] == {"jump_forward": True, "speculative": None, "tools": None, "reasoning": False}
    assert props["max_model_len"] > 0


def test_the_icon_is_served_and_the_key_placeholder_is_not_cut_off(server: ServerProcess, page: WebDriver) -> None:
    for path in ("/favicon.ico", "/static/favicon.svg"):
        r = httpx.get(server.url + path, timeout=10)
        assert r.status_code == 200 and r.headers["content-type"] == "image/svg+xml" and b"<svg" in r.content
    assert not [e for e in page.get_log("browser") if "favicon" in e["message"] or "404" in e["message"]]
    width, room = page.execute_script(
        "const e = document.getElementById('api-key'), s = getComputedStyle(e);"
        "const c = document.createElement('canvas').getContext('2d'); c.font = s.font;"
        "return [c.measureText(e.placeholder).width,"
        "        e.clientWidth - parseFloat(s.paddingLeft) - parseFloat(s.paddingRight)];")
    assert 0 < width <= room, (width, room)


# The tiny random model's bytes are seldom valid UTF-8 (the server holds them back until they decode): a regex keeps
# its answers to letters, so that they stream token by token.
LETTERS = "[a-z]+( [a-z]+)*"


def test_a_question_streams_its_answer_with_statistics(page: WebDriver) -> None:
    select_format(page, "regex", LETTERS)
    fill(page, "max_tokens", "40")
    ask(page, "Say something.")
    answer = last_answer(page)
    assert answer["state"] == "length" and answer["error"] == ""
    assert answer["pieces"] > 5, "the answer arrived as one piece: it was not streamed"
    assert "finish: length" in answer["meta"] and "40 tokens" in answer["meta"]
    assert "first token" in answer["meta"] and "tok/s" in answer["meta"]
    messages = page.find_elements(By.CSS_SELECTOR, ".message")
    assert [m.get_attribute("class") for m in messages] == ["message user", "message assistant"]

    ask(page, "And again.")  # the conversation goes on: the second request carries the history
    assert last_answer(page)["state"] == "length"
    assert len(page.find_elements(By.CSS_SELECTOR, ".message")) == 4
    page.find_element(By.ID, "new-chat").click()
    assert page.find_elements(By.CSS_SELECTOR, ".message") == []


def test_stop_ends_the_answer_and_the_server_aborts_it(server: ServerProcess, page: WebDriver) -> None:
    before = aborted(wait_idle(server))
    select_format(page, "regex", LETTERS)
    fill(page, "max_tokens", "4000")
    ask(page, "Go on forever.")
    until(page, lambda: len(page.execute_script(
        "const c = document.querySelectorAll('.message.assistant .content'); return c[c.length - 1].textContent"))
        > 20, "some text streamed in")
    page.find_element(By.ID, "stop").click()
    answer = last_answer(page)
    assert answer["state"] == "stopped" and "finish: stopped" in answer["meta"]
    # The server aborts the request when it sees the connection closed (at its next write): well before the 4000
    # tokens are out, however loaded the machine.
    until(page, lambda: aborted(metrics(server)) == before + 1, "the server aborted the request", timeout=60)
    wait_idle(server, timeout=30)


def test_a_json_schema_gives_json_and_a_bad_schema_shows_the_servers_400(page: WebDriver) -> None:
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                               "age": {"type": "integer", "minimum": 0, "maximum": 120}},
              "required": ["name", "age"], "additionalProperties": False}
    select_format(page, "json_schema", json.dumps(schema))
    fill(page, "max_tokens", "200")
    ask(page, "Who are you?")
    answer = last_answer(page)
    jsonschema.validate(json.loads(answer["content"]), schema)

    select_format(page, "json_schema", '{"type": 5}')
    ask(page, "Again?")
    answer = last_answer(page)
    assert answer["state"] == "error"
    assert answer["error"].startswith("400: ") and "json_schema" in answer["error"]

    select_format(page, "json_schema", "{not json")  # caught in the page, nothing sent
    ask(page, "Once more?")
    assert "not valid JSON" in page.find_elements(By.CSS_SELECTOR, ".message.system .error")[-1].text

    select_format(page, "text")
    fill(page, "top_p", "5")
    ask(page, "Out of range?")
    assert last_answer(page)["error"] == "400: top_p must be in (0.0, 1.0], got 5"


def test_model_output_is_shown_as_text_never_as_html(page: WebDriver) -> None:
    select_format(page, "regex", r'<img src=x onerror="window\.pwned=1"><script>window\.pwned=2</script>')
    fill(page, "max_tokens", "100")
    page.find_element(By.ID, "logprobs").click()
    page.find_element(By.ID, "jump_forward").click()  # sampled token by token, each with its logprobs
    ask(page, "Inject something.")
    answer = last_answer(page)
    assert answer["content"] == '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>'
    assert page.find_elements(By.CSS_SELECTOR, "#messages img, #messages script") == []
    assert page.execute_script("return window.pwned === undefined")
    token = page.find_elements(By.CSS_SELECTOR, ".message.assistant .tok")[0]  # top logprobs on hover
    assert "logprob" in token.get_attribute("title") and len(token.get_attribute("title").splitlines()) >= 2


def test_jump_forward_switch_is_sent_with_the_request(page: WebDriver) -> None:
    assert page.find_element(By.ID, "jump_forward").is_displayed()
    assert not page.find_element(By.ID, "speculative").is_displayed()  # this server does not report it
    select_format(page, "json_object")
    fill(page, "max_tokens", "30")
    page.find_element(By.ID, "jump_forward").click()  # off for this request: still a valid answer
    ask(page, "JSON please.")
    assert last_answer(page)["state"] in ("stop", "length")


def test_busy_and_gone_servers_are_explained(server: ServerProcess, page: WebDriver) -> None:
    # One long request runs (max batch 1) and one waits (max queue 1): the page's request is refused with 429.
    body = {"prompt": "x", "max_tokens": 4000, "ignore_eos": True, "stream": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    opened = threading.Barrier(3)
    stop = threading.Event()

    def hold() -> None:
        with httpx.stream("POST", server.url + "/v1/completions", json=body, headers=headers, timeout=60) as r:
            lines = r.iter_lines()
            opened.wait()
            for _ in lines:
                if stop.is_set():
                    break

    holders = [threading.Thread(target=hold) for _ in range(2)]
    try:
        holders[0].start()
        until(page, lambda: metrics(server)["logitproc_batch_sequences"] == 1, "the first request runs")
        holders[1].start()
        opened.wait(timeout=30)
        ask(page, "Busy?")
        answer = last_answer(page)
        assert answer["state"] == "error" and answer["error"].startswith("429: the server is busy")
    finally:
        stop.set()
        for t in holders:
            t.join(timeout=60)
    wait_idle(server, timeout=30)

    gone = ServerProcess("--model", "tiny", api_key=None)  # a second server that goes away under the page
    try:
        page.get(gone.url + "/")
        until(page, lambda: text(page, "model-name").startswith("tiny-llama"), "the page is ready")
    finally:
        gone.stop()
    ask(page, "Anyone there?")
    assert "cannot be reached" in last_answer(page)["error"]


def test_tool_calls_and_reasoning_are_shown_collapsed(driver: WebDriver) -> None:
    """Against a server with Qwen3's template: tools pasted as JSON give a collapsed "tool calls" block (the tiny
    random model, made to call by tool choice "required"), a think block a collapsed "reasoning" block."""
    import material

    template = material.llama_cpp_models() / "templates" / "Qwen-Qwen3-0.6B.jinja"
    qwen3 = ServerProcess("--model", "tiny", "--chat-template", str(template), api_key=None)
    try:
        driver.get(qwen3.url + "/")
        until(driver, lambda: text(driver, "model-name").startswith("tiny-llama"), "the page is ready")
        schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}}, "required": ["city"]}
        tools = [{"type": "function", "function": {"name": "get_weather", "parameters": schema}}]
        select_format(driver, "tools", json.dumps(tools))
        driver.execute_script("document.getElementById('tool-choice').value = 'required';")
        for name, value in (("max_tokens", "120"), ("temperature", "1"), ("seed", "3")):
            fill(driver, name, value)
        ask(driver, "Weather in Paris?")
        assert last_answer(driver)["state"] == "tool_calls"
        calls = driver.execute_script("""
            const all = document.querySelectorAll('.message.assistant');
            const d = all[all.length - 1].querySelector('details.tool-calls');
            return {open: d.open, summary: d.querySelector('summary').textContent,
                    lines: [...d.querySelectorAll('.call')].map((e) => e.textContent)};""")
        assert not calls["open"] and calls["summary"] == "tool calls: get_weather", calls
        for line in calls["lines"]:
            assert line.startswith("get_weather(") and line.endswith(")")
            jsonschema.validate(json.loads(line[len("get_weather("):-1]), schema)

        select_format(driver, "regex", "<think>\\n[a-z]{3,8}\\n</think>\\n\\n[a-z]{3,8}")
        ask(driver, "Think first.")
        answer = last_answer(driver)
        reasoning = driver.execute_script("""
            const all = document.querySelectorAll('.message.assistant');
            const d = all[all.length - 1].querySelector('details.reasoning');
            return {open: d.open, text: d.textContent};""")
        assert not reasoning["open"] and reasoning["text"].startswith("reasoning")
        assert reasoning["text"][len("reasoning"):].isalpha() and answer["content"].isalpha(), (reasoning, answer)
    finally:
        qwen3.stop()
