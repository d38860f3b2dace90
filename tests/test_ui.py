"""The web dashboard in a real headless Chromium (the system's package, driven by Selenium through the system's
chromedriver; nothing is downloaded): the key pasted into the page, the job list showing a submitted job, the
loss curve gaining points while a real job trains, and the cancel button."""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.helpers import events_of, wait_for, wait_status

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
DRIVER = shutil.which("chromedriver")
pytestmark = pytest.mark.skipif(CHROMIUM is None or DRIVER is None,
                                reason="needs chromium and chromium-driver (apt-get install chromium "
                                       "chromium-driver; .ci/run installs them)")


@pytest.fixture
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM  # type: ignore[assignment]
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu",
                "--window-size=1200,900"):
        options.add_argument(arg)
    driver = webdriver.Chrome(service=Service(executable_path=DRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def js(browser: Any, script: str) -> Any:
    return browser.execute_script(script)


def test_list_curve_and_cancel(browser: Any, stack: Any, api: httpx.Client, admin_key: str,
                               make_job: Any) -> None:
    from selenium.webdriver.common.by import By

    browser.get(stack.api_url + "/ui")
    browser.find_element(By.ID, "key").send_keys(admin_key)
    browser.find_element(By.CSS_SELECTOR, "#login button").click()

    parked = "parked-" + uuid.uuid4().hex[:8]
    waiting = api.post("/jobs", json=make_job(name="ui-parked", resources={"queue": parked})).json()["id"]
    wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, f'tr[data-id="{waiting}"]'), 30,
             "the list to show the submitted job")
    training = api.post("/jobs", json=make_job(name="ui-train", hyperparameters={"max_steps": 16})).json()["id"]
    browser.get(f"{stack.api_url}/ui#job/{training}")
    # The curve gains points as the job trains: first a few, then more, drawn from the live stream.
    first = wait_for(lambda: int(js(browser, "return +document.getElementById('curve').dataset.points")) or 0, 300,
                     "the loss curve's first points", interval=0.3)
    wait_for(lambda: int(js(browser, "return +document.getElementById('curve').dataset.points")) > first, 300,
             "the curve to gain points while the job trains", interval=0.3)
    wait_status(api, training, {"succeeded"}, 300)
    wait_for(lambda: browser.find_element(By.ID, "j-status").text == "succeeded", 30, "the page to show the end")
    # Every progress event the job has is on the curve, and its log reached the tail.
    progress = [e for e in events_of(api, training, ["progress"]) if isinstance(e.get("loss"), float)]
    assert int(js(browser, "return +document.getElementById('curve').dataset.points")) == len(progress)
    assert browser.find_element(By.ID, "log").text.strip()
    if os.environ.get("FT_UI_SCREENSHOT"):  # how the README's picture is made
        browser.save_screenshot(os.environ["FT_UI_SCREENSHOT"])

    browser.get(f"{stack.api_url}/ui#job/{waiting}")
    wait_for(lambda: browser.find_element(By.ID, "j-status").text == "queued", 30, "the parked job's page")
    browser.find_element(By.ID, "cancel").click()
    wait_for(lambda: browser.find_element(By.ID, "j-status").text == "cancelled", 30, "the page to show the cancel")
    assert api.get(f"/jobs/{waiting}").json()["status"] == "cancelled"
    assert browser.find_element(By.ID, "error").text == ""
