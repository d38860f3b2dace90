"""The dashboard's picture in the docs (docs/dashboard.png): the demo's job page once the job succeeded.

`python -m scripts.dashboard_picture [PATH]` starts the stack as `make demo` does, runs the demo job
(examples/demo-job.json), opens its page in headless Chromium (the system's `chromium` and `chromedriver`, driven
by Selenium, as tests/test_ui.py does) with the dev stack's key, waits until the page holds every event of the job,
scrolls the log pane to its last lines and saves the picture (default docs/dashboard.png). It fails, saving nothing,
where a log line in view shows an absolute path: the picture is published, a machine's paths are not.
"""

from __future__ import annotations

import json
import re
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from contract.codes import EventKind, JobStatus
from scripts.demo import DEMO_JOB, prepared, run_demo, running
from scripts.stack import ROOT

PICTURE = ROOT / "docs" / "dashboard.png"
WINDOW = (1200, 1040)  # tall enough for the whole job page: state line, chart, checkpoints, output, log pane
# An absolute path of two parts or more, standing on its own: not the tail of a URL, of a relative path or of a
# placeholder the service shows for a server's folder (`<site-packages>/torch/...`).
ABSOLUTE_PATH = re.compile(r"(?<![\w.~:/>-])/[\w.@+-]+/[\w.@+/-]*")

# The lines of the log pane a reader sees: a line wrapped over several rows counts if any row is in view.
VISIBLE_LOG_LINES = """
const pane = document.getElementById("log"), box = pane.getBoundingClientRect(), node = pane.firstChild;
if (!node) return [];
const seen = [];
let start = 0;
for (const line of node.textContent.split("\\n")) {
  const range = document.createRange();
  range.setStart(node, start); range.setEnd(node, start + line.length);
  if (Array.from(range.getClientRects()).some((r) => r.bottom > box.top && r.top < box.bottom)) seen.push(line);
  start += line.length + 1;
}
return seen;
"""


def wait(predicate: Any, timeout: float, what: str) -> Any:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.3)
    raise TimeoutError(f"timed out after {timeout} s waiting for {what}")


def take(api_url: str, key: str, job_id: str, path: Path) -> list[str]:
    """Saves the picture of the job's page at `path`; returns the log lines in view."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service
    from selenium.webdriver.common.by import By

    chromium, driver_path = shutil.which("chromium") or shutil.which("chromium-browser"), shutil.which("chromedriver")
    if chromium is None or driver_path is None:
        raise RuntimeError("needs chromium and chromium-driver (apt-get install chromium chromium-driver)")
    events = httpx.get(f"{api_url}/jobs/{job_id}/events", params={"type": [EventKind.PROGRESS], "limit": 1000},
                       headers={"Authorization": f"Bearer {key}"}, timeout=30).json()["data"]
    points = sum(isinstance(e.get("loss"), float) for e in events)
    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--hide-scrollbars",
                "--window-size={},{}".format(*WINDOW)):
        options.add_argument(arg)
    browser = webdriver.Chrome(service=Service(executable_path=driver_path), options=options)
    try:
        browser.get(api_url + "/ui")
        browser.find_element(By.ID, "key").send_keys(key)
        browser.find_element(By.CSS_SELECTOR, "#login button").click()
        browser.get(f"{api_url}/ui#job/{job_id}")
        wait(lambda: browser.find_element(By.ID, "j-status").text == JobStatus.SUCCEEDED
             and int(browser.find_element(By.ID, "curve").get_attribute("data-points")) == points
             and browser.find_elements(By.CSS_SELECTOR, "#j-output a.output-file")
             and browser.find_element(By.ID, "log").text.strip(), 60, "the job's page to hold the whole job")
        # The pane shows the log's end, as a reader following a job looks at it.
        browser.execute_script("const p = document.getElementById('log'); p.scrollTop = p.scrollHeight;")
        time.sleep(0.5)  # one frame for the scroll and the chart's last draw
        seen = [str(line) for line in browser.execute_script(VISIBLE_LOG_LINES)]
        every = str(browser.execute_script("return document.getElementById('log').textContent")).splitlines()
        leaks = [line for line in seen if ABSOLUTE_PATH.search(line) or str(ROOT) in line]
        hidden = [line for line in every if (ABSOLUTE_PATH.search(line) or str(ROOT) in line) and line not in seen]
        if hidden:
            print(f"\n{len(hidden)} log lines out of view show absolute paths:\n  " + "\n  ".join(hidden),
                  file=sys.stderr)
        if leaks:
            raise RuntimeError("the log lines in view show absolute paths; no picture saved:\n" + "\n".join(leaks))
        path.parent.mkdir(parents=True, exist_ok=True)
        browser.save_screenshot(str(path))
        return seen
    finally:
        browser.quit()


def main(argv: list[str]) -> int:
    path = Path(argv[0]) if argv else PICTURE
    env, key = prepared()
    if key is None:
        print("outside development FT_KEY must name an admin key", file=sys.stderr)
        return 2
    with running(env) as stack:
        job = run_demo(stack, json.loads(DEMO_JOB.read_text()), key=key)["job"]
        if job["status"] != JobStatus.SUCCEEDED:
            print(f"\nthe demo job {job['id']} ended {job['status']}: {json.dumps(job['error'])}", file=sys.stderr)
            return 1
        seen = take(stack.api_url, key, job["id"], path)
    print(f"\nsaved {path}: job {job['id']}, log lines in view:\n  " + "\n  ".join(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
