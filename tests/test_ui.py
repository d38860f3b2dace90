"""The web dashboard in a real headless Chromium (the system's package, driven by Selenium through the system's
chromedriver; nothing is downloaded): the key pasted into the page, the job list showing a submitted job, the
loss chart gaining points while a real job trains (its axes, ticks, eval markers, learning rate and legend), the
chart's edge cases (no points, one, a flat loss, NaN losses, thousands of points), and the cancel button: offered
on a queued or running job, where it works, and never on one that ended."""

from __future__ import annotations

import math
import shutil
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from contract.codes import UNFINISHED_STATUSES, JobStatus
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


def js(browser: Any, script: str, *args: Any) -> Any:
    return browser.execute_script(script, *args)


# What a reader of the chart sees: its text by role, the steps of its eval markers and of its marks where the loss was
# not finite, and each series' lines (how many pieces, how many vertices in all).
READ_CHART = """
const svg = document.querySelector(arguments[0]);
const texts = (sel) => Array.from(svg.querySelectorAll(sel), (n) => n.textContent);
const lines = {}, pieces = {};
for (const n of svg.querySelectorAll("polyline")) {
  const cls = n.getAttribute("class");
  lines[cls] = (lines[cls] || 0) + n.points.numberOfItems; pieces[cls] = (pieces[cls] || 0) + 1;
}
return {axes: texts(".axis-label"), x: texts(".tick.x"), y: texts(".tick.y"), lr: texts(".tick.lr"),
        legend: texts(".legend"), empty: texts(".empty"), points: +svg.dataset.points, evals: +svg.dataset.evals,
        markers: Array.from(svg.querySelectorAll(".eval-marker"), (n) => +n.dataset.step),
        gaps: Array.from(svg.querySelectorAll(".gap-marker"), (n) => +n.dataset.step), lines, pieces};
"""


def chart(browser: Any, selector: str = "#curve") -> dict[str, Any]:
    return dict(js(browser, READ_CHART, selector))


def ticks(labels: list[str], lo: float, hi: float) -> list[float]:
    """The tick values, checked to be evenly spaced round numbers (1, 2, 2.5 or 5 times a power of ten, every
    tick a multiple of the spacing) whose first and last enclose [lo, hi]."""
    values = [float(label) for label in labels]
    assert len(values) >= 2, labels
    gap = values[1] - values[0]
    assert gap > 0, labels
    assert all(math.isclose(b - a, gap, rel_tol=1e-6) for a, b in zip(values, values[1:], strict=False)), labels
    mantissa = gap / 10 ** math.floor(math.log10(gap) + 1e-9)
    assert any(math.isclose(mantissa, m, rel_tol=1e-6) for m in (1, 2, 2.5, 5)), labels
    assert all(math.isclose(v / gap, round(v / gap), abs_tol=1e-6) for v in values), labels
    assert values[0] <= lo and values[-1] >= hi, (labels, lo, hi)
    return values


# What a cancel can still act on: a job not yet ended, nor being cancelled already.
CANCELLABLE = {s.value for s in UNFINISHED_STATUSES} - {JobStatus.CANCELLING.value}
# The job's state as the page shows it and which buttons of the job's page are offered, read in one go (the page
# polls the job every 2 s).
READ_ACTIONS = """
return [document.getElementById("j-status").textContent,
        Array.from(document.querySelectorAll("#job button")).filter((b) => !b.hidden).map((b) => b.id)];
"""


def actions(browser: Any) -> tuple[str, list[str]]:
    status, offered = js(browser, READ_ACTIONS)
    return status, offered


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
    training = api.post("/jobs", json=make_job(name="ui-train", hyperparameters={"max_steps": 16,
                                                                                  "eval_every_steps": 4})).json()["id"]
    browser.get(f"{stack.api_url}/ui#job/{training}")
    # Each look at the page while the job is queued, starts, trains and ends also notes what it offered.
    looked: list[tuple[str, list[str]]] = []

    def points() -> int:
        looked.append(actions(browser))
        return int(js(browser, "return +document.getElementById('curve').dataset.points"))

    # The curve gains points as the job trains: first a few, then more, drawn from the live stream.
    first = wait_for(lambda: points() or 0, 300, "the loss curve's first points", interval=0.3)
    wait_for(lambda: points() > first, 300, "the curve to gain points while the job trains", interval=0.3)
    wait_status(api, training, {"succeeded"}, 300)
    wait_for(lambda: points() and looked[-1][0] == "succeeded", 30, "the page to show the end")
    # Cancel was offered at every look while the job could be cancelled, running included, and at no other (the
    # running job is left to finish: that the button works is shown on the parked job).
    assert ("running", ["cancel"]) in looked, looked
    assert [look for look in looked if (look[1] == ["cancel"]) != (look[0] in CANCELLABLE)] == [], looked
    assert actions(browser) == ("succeeded", [])  # nothing to cancel once it ended
    # Every progress event the job has is on the curve, every evaluation has its marker at its step, and the
    # axes' ticks cover the steps, the losses and the learning rates the job reported.
    events = events_of(api, training, ["progress", "eval"])
    progress = [e for e in events if e["type"] == "progress" and isinstance(e.get("loss"), float)]
    evals = [e for e in events if e["type"] == "eval" and isinstance(e.get("loss"), float)]
    assert len(evals) == 4  # steps 4, 8 and 12, and the final one at 16
    seen = wait_for(lambda: (c := chart(browser))["points"] == len(progress) and len(c["markers"]) == len(evals) and c,
                    30, "the chart to hold every progress and eval event")
    assert sorted(seen["markers"]) == sorted(e["step"] for e in evals)
    assert {"step", "loss", "learning rate"} <= set(seen["axes"])
    assert {"train loss", "eval loss", "learning rate"} <= set(seen["legend"])
    steps = [e["step"] for e in progress + evals]
    losses = [e["loss"] for e in progress + evals]
    rates = [e["lr"] for e in progress]
    ticks(seen["x"], min(steps), max(steps))
    ticks(seen["y"], min(losses), max(losses))
    ticks(seen["lr"], min(rates), max(rates))
    assert seen["lines"]["series-loss"] == len(progress) and seen["lines"]["series-lr"] == len(progress)
    assert seen["empty"] == [] and seen["gaps"] == []
    assert browser.find_element(By.ID, "log").text.strip()
    assert not browser.find_element(By.ID, "j-rewards").is_displayed()  # a supervised job has no reward figures
    # Each file of the export is linked; the link's own fetch, with the key, gets the file's bytes.
    listed = api.get(f"/jobs/{training}/output").json()["files"]
    links = wait_for(lambda: browser.find_elements(By.CSS_SELECTOR, "#j-output a.output-file"), 30, "output links")
    assert sorted(a.get_attribute("href") for a in links) == sorted(stack.api_url + f["url"] for f in listed)
    config = next(f for f in listed if f["path"] == "config.json")
    got = browser.execute_async_script(
        "const done = arguments[arguments.length - 1];"
        "fetch(arguments[0], {headers: {Authorization: 'Bearer ' + sessionStorage.getItem('ft-key')}})"
        ".then((r) => r.arrayBuffer()).then((b) => done(b.byteLength));", config["url"])
    assert got == config["bytes"]

    browser.get(f"{stack.api_url}/ui#job/{waiting}")
    wait_for(lambda: actions(browser) == ("queued", ["cancel"]), 30, "the parked job's page offering Cancel")
    assert browser.find_element(By.ID, "j-output").text == "none"  # no export to link before a job succeeded
    browser.find_element(By.ID, "cancel").click()
    wait_for(lambda: actions(browser) == ("cancelled", []), 30, "the page to show the cancel, with no Cancel left")
    assert api.get(f"/jobs/{waiting}").json()["status"] == "cancelled"
    assert browser.find_element(By.ID, "error").text == ""

    # Opened afresh, the ended job's page replays its whole stream, "running" state events included: Cancel is not
    # offered at any moment of it. Each record's old value is the button's state before one change, however many
    # changes one task made.
    js(browser, """window.offered = [];
        new MutationObserver((records) => { for (const r of records) window.offered.push(r.oldValue === null); })
            .observe(document.getElementById("cancel"), {attributeFilter: ["hidden"], attributeOldValue: true});""")
    js(browser, "location.hash = arguments[0]", f"#job/{training}")  # the same document: the observer stays
    wait_for(lambda: chart(browser)["points"] == len(progress) and actions(browser) == ("succeeded", []), 30,
             "the ended job's page, replayed")
    assert browser.find_element(By.ID, "log").text.strip()
    changes = js(browser, "return window.offered.concat([!document.getElementById('cancel').hidden])")
    assert len(changes) > 1 and True not in changes, f"Cancel offered while an ended job's page loaded: {changes}"
    # Every status the contract has: Cancel is offered on those a cancel can still act on, and on no other.
    statuses = [s.value for s in JobStatus]
    offered = js(browser, "return arguments[0].map((s) => { showStatus(s); return !$('cancel').hidden; });", statuses)
    assert dict(zip(statuses, offered, strict=True)) == {s: s in CANCELLABLE for s in statuses}


def test_chart_edge_cases(browser: Any, stack: Any) -> None:
    """The page's own chart code, fed events shaped as the API sends them (a non-finite loss arrives as the text
    "nan" or "inf"), each drawn into its own chart."""
    browser.get(stack.api_url + "/ui")

    def draw(name: str, events: list[dict[str, Any]]) -> dict[str, Any]:
        js(browser, """
            const svg = document.createElementNS("http://www.w3.org/2000/svg", "svg");
            svg.id = arguments[0]; document.body.append(svg);
            const s = chartSeries(); for (const e of arguments[1]) s.add(e); drawChart(svg, s);""", name, events)
        return chart(browser, "#" + name)

    def progress(step: int, loss: Any, lr: Any = 1e-3) -> dict[str, Any]:
        return {"type": "progress", "step": step, "loss": loss, "lr": lr}

    empty = draw("empty", [])
    assert empty["points"] == 0 and empty["x"] == [] and empty["y"] == [] and empty["markers"] == []
    assert empty["empty"] == ["no loss reported yet"]
    assert {"step", "loss", "learning rate"} <= set(empty["axes"])
    assert {"train loss", "eval loss", "learning rate"} <= set(empty["legend"])

    one = draw("one", [progress(5, 2.25, 3e-4)])
    assert one["points"] == 1
    ticks(one["x"], 5, 5)
    ticks(one["y"], 2.25, 2.25)
    ticks(one["lr"], 0, 3e-4)

    flat = draw("flat", [progress(step, 3.0) for step in range(1, 11)] + [{"type": "eval", "step": 10, "loss": 3.0}])
    assert flat["points"] == 10 and flat["markers"] == [10]
    ticks(flat["x"], 1, 10)
    assert len(set(ticks(flat["y"], 3.0, 3.0))) >= 2

    nan = draw("nan", [progress(1, 4.0), progress(2, "nan"), progress(3, "inf", "nan"), progress(4, "-inf"),
                       progress(5, None), progress(6, 3.5), {"type": "eval", "step": 6, "loss": "nan"},
                       {"type": "eval", "step": "nan", "loss": 3.0}])
    assert nan["points"] == 2 and nan["evals"] == 0 and nan["markers"] == []
    assert max(ticks(nan["y"], 3.5, 4.0)) < 10  # no infinite loss stretched the axis
    # The line breaks at the steps that diverged, which are marked, and named in the legend.
    assert nan["pieces"]["series-loss"] == 2 and nan["gaps"] == [2, 3, 4, 5]
    assert "loss not finite" in nan["legend"]
    assert nan["lines"]["series-lr"] == 5  # the learning rate of a step whose loss was not finite is still drawn

    # A retried attempt resumes at its checkpoint (step 6) and reports those steps again: its points replace the
    # earlier attempt's from there on.
    retried = draw("retried", [progress(step, 5.0 - step / 10) for step in range(1, 11)]
                   + [progress(step, 4.0 - step / 10) for step in range(6, 13)])
    assert retried["points"] == 12 and retried["lines"]["series-loss"] == 12 and retried["pieces"]["series-loss"] == 1

    many = 20000
    curve = [(step, 2 + math.sin(step / 50) + 1000 / (step + 100), 1e-4 * min(1, step / 500))
             for step in range(1, many + 1)]
    big = draw("big", [progress(*point) for point in curve]
               + [{"type": "eval", "step": step, "loss": 2.5} for step in range(1000, many + 1, 1000)])
    assert big["points"] == many and len(big["markers"]) == 20
    assert 100 < big["lines"]["series-loss"] <= 4 * 800  # at most four vertices per pixel column
    assert big["pieces"]["series-loss"] == 1 and "loss not finite" not in big["legend"]
    xs = ticks(big["x"], 1, many)
    assert len(xs) <= 12
    ticks(big["y"], min(loss for _, loss, _ in curve), max(loss for _, loss, _ in curve))
    ticks(big["lr"], 0, 1e-4)
