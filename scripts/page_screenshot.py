"""Takes the README's screenshot of the chat page: serves a model, asks two questions in headless chromium, saves a PNG.

    python scripts/page_screenshot.py --out docs/images/chat_page.png [--model default]

Needs the `serve` and `test` extras (selenium) and Debian's chromium + chromium-driver (scripts/install_system_deps.sh).
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import time

import httpx
from selenium import webdriver
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_answer(driver: webdriver.Chrome, count: int, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    script = ("const a = document.querySelectorAll('.message.assistant');"
              "return a.length >= arguments[0] && a[a.length - 1].dataset.state !== 'running';")
    while not driver.execute_script(script, count):
        if time.monotonic() > deadline:
            raise TimeoutError("no answer")
        time.sleep(0.1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="docs/images/chat_page.png")
    parser.add_argument("--model", default="default")
    args = parser.parse_args()
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "logitproc", "serve", "--model", args.model, "--port", str(port),
                               "--jump-forward"])
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1100,820"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=webdriver.ChromeService("/usr/bin/chromedriver"), options=options)
    try:
        for _ in range(1200):
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        driver.get(url + "/")
        prompt = driver.find_element(By.ID, "prompt")
        prompt.send_keys("What is the capital of France?", Keys.ENTER)
        wait_answer(driver, 1)
        driver.execute_script("const s = document.getElementById('format-kind'); s.value = 'json_schema';"
                              "s.dispatchEvent(new Event('change'));")
        spec = driver.find_element(By.ID, "format-spec")
        spec.send_keys('{"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},'
                       ' "required": ["city", "country"]}')
        prompt.send_keys("Give me a city and its country as JSON.", Keys.ENTER)
        wait_answer(driver, 2)
        driver.save_screenshot(args.out)
        print(f"saved {args.out}")
    finally:
        driver.quit()
        server.terminate()
        server.wait(60)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
