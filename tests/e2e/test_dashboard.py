"""The dashboard page in a real headless Chromium (Debian's `chromium` and `chromium-driver`),
against a real pool service filled by a short real training run of the tiny model.

The browser is required: when it is missing, scripts/install_browser.sh installs it with apt-get,
and the tests fail (they never skip) when it cannot be installed or started. The last test saves a
screenshot of the page to test-artifacts/dashboard.png.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException, TimeoutException, WebDriverException
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver
from selenium.webdriver.remote.webelement import WebElement
from selenium.webdriver.support.ui import WebDriverWait

from exgrpo_client import Client

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")
INSTALL = ROOT / "scripts" / "install_browser.sh"
FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
)
READ_TOKEN = "dashboard-reader-token-0001"
ADMIN_TOKEN = "dashboard-admin-token-00001"

pytestmark = pytest.mark.timeout(300)


# ------------------------------------------------------------------------------------ browser
def _install_browser() -> None:
    if CHROMIUM.is_file() and CHROMEDRIVER.is_file():
        return
    try:
        proc = subprocess.run(
            ["bash", str(INSTALL)], capture_output=True, text=True, timeout=900, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        pytest.fail(f"could not run {INSTALL}: {e}")
    if proc.returncode != 0 or not (CHROMIUM.is_file() and CHROMEDRIVER.is_file()):
        pytest.fail(
            f"the dashboard tests need {CHROMIUM} and {CHROMEDRIVER}; {INSTALL} failed "
            f"(exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )


@pytest.fixture(scope="module")
def browser() -> Iterator[WebDriver]:
    _install_browser()
    profile = tempfile.mkdtemp(prefix="exgrpo-chromium-")
    opts = Options()
    opts.binary_location = str(CHROMIUM)
    for flag in FLAGS:
        opts.add_argument(flag)
    opts.add_argument(f"--user-data-dir={profile}")
    opts.add_argument("--window-size=1400,1000")
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SE_OFFLINE", "true")  # selenium must never fetch a browser or driver itself
            driver = webdriver.Chrome(service=Service(executable_path=str(CHROMEDRIVER)), options=opts)
    except WebDriverException as e:
        shutil.rmtree(profile, ignore_errors=True)
        pytest.fail(f"headless Chromium did not start: {e.msg or e}")
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def _wait(driver: WebDriver, what: str, cond: Callable[[WebDriver], Any], timeout: float = 15) -> Any:
    try:
        return WebDriverWait(
            driver, timeout, poll_frequency=0.1, ignored_exceptions=(StaleElementReferenceException,)
        ).until(cond)
    except TimeoutException:
        err = driver.find_elements(By.ID, "error-banner")
        banner = err[0].text if err and err[0].is_displayed() else "(no error shown)"
        raise AssertionError(f"timed out waiting for {what}; error banner: {banner}") from None


def _css(driver: WebDriver, selector: str) -> list[WebElement]:
    return driver.find_elements(By.CSS_SELECTOR, selector)


def _one(driver: WebDriver, what: str, selector: str, timeout: float = 15) -> WebElement:
    return _wait(
        driver, what, lambda d: (found := _css(d, selector)) and found[0].is_displayed() and found[0]
    )


def _click(driver: WebDriver, what: str, selector: str) -> None:
    """Clicks the element `selector` finds, scrolled to the middle of the window (clear of the
    sticky top bar). The page re-renders lists while it refreshes, so an element found a moment
    ago can be gone by the click: the lookup and the click are retried together until one lands."""

    def click(d: WebDriver) -> bool:
        found = _css(d, selector)
        if not found or not found[0].is_displayed():
            return False
        d.execute_script("arguments[0].scrollIntoView({block: 'center'})", found[0])
        found[0].click()
        return True

    _wait(driver, what, click)


def _points(driver: WebDriver, chart: str) -> int:
    return int(driver.find_element(By.ID, f"chart-{chart}").get_attribute("data-points") or 0)


def _series_points(driver: WebDriver, chart: str, key: str) -> int:
    found = _css(driver, f'#chart-{chart} path[data-series="{key}"]')
    return int(found[0].get_attribute("data-points") or 0) if found else 0


def _console_errors(driver: WebDriver) -> list[str]:
    return [e["message"] for e in driver.get_log("browser") if e["level"] == "SEVERE"]


# ---------------------------------------------------------------------------------- the tests
def test_page_with_a_bearer_token_and_empty_states(
    browser: WebDriver, start_live_server: Any, tmp_path: Path
) -> None:
    tokens = [
        {"name": "viewer", "token": READ_TOKEN, "scopes": ["read"]},
        {"name": "ops", "token": ADMIN_TOKEN, "scopes": ["admin"]},
    ]
    with start_live_server(
        f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}", allow_anonymous=False, tokens=tokens
    ) as srv:
        page = httpx.get(f"{srv.url}/dashboard")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert (
            httpx.get(f"{srv.url}/dashboard/dashboard.js")
            .headers["content-type"]
            .startswith("text/javascript")
        )
        assert httpx.get(f"{srv.url}/dashboard/secret.py").status_code == 404
        with Client(srv.url, token=ADMIN_TOKEN) as admin:
            admin.create_pool("empty-pool", config={"k": 4, "batch_size": 4})

        # no token: the service answers 401 and the page shows its problem detail
        browser.get(f"{srv.url}/dashboard")
        banner = _one(browser, "the 401 error", "#error-banner")
        assert banner.get_attribute("data-status") == "401"
        assert "needs a bearer token" in banner.text
        assert browser.find_element(By.ID, "token-state").get_attribute("data-mode") == "anonymous"

        # with the read token, kept in localStorage, the pools load
        browser.find_element(By.ID, "token-input").send_keys(READ_TOKEN)
        _click(browser, "the token-save button", "#token-save")
        _one(browser, "the pool list", '[data-testid=pool-item][data-pool="empty-pool"]')
        assert not browser.find_element(By.ID, "error-banner").is_displayed()
        assert browser.execute_script("return localStorage.getItem('exgrpo.dashboard.token')") == READ_TOKEN
        browser.refresh()
        _one(browser, "the pool list after a reload", '[data-testid=pool-item][data-pool="empty-pool"]')
        assert browser.find_element(By.ID, "token-state").get_attribute("data-mode") == "token"

        # the only pool is opened: no runs, no questions, each said so
        _one(browser, "the empty runs notice", "#runs-empty")
        assert "No runs" in browser.find_element(By.ID, "runs-empty").text
        _one(browser, "the empty questions notice", "#questions-empty")
        assert browser.find_element(By.ID, "welcome").is_displayed() is False

        # a question that does not exist: the 404 problem detail is shown
        browser.find_element(By.ID, "question-id-input").send_keys("987654")
        _click(browser, "the go-to button", "#goto-button")
        _wait(
            browser,
            "the 404 error",
            lambda d: d.find_element(By.ID, "error-banner").get_attribute("data-status") == "404",
        )
        assert "question 987654 does not exist" in browser.find_element(By.ID, "error-banner").text

        # a wrong token is refused, clearing it goes back to anonymous (refused here)
        browser.find_element(By.ID, "token-input").send_keys("not-a-real-token-at-all")
        _click(browser, "the token-save button", "#token-save")
        _wait(
            browser,
            "the unknown-token error",
            lambda d: "unknown bearer token" in d.find_element(By.ID, "error-banner").text,
        )
        _click(browser, "the token-clear button", "#token-clear")
        _wait(
            browser,
            "the anonymous 401",
            lambda d: "needs a bearer token" in d.find_element(By.ID, "error-banner").text,
        )
        assert browser.execute_script("return localStorage.getItem('exgrpo.dashboard.token')") is None
        assert not [m for m in _console_errors(browser) if "Content Security Policy" in m]


def test_dashboard_shows_a_real_training_run(
    browser: WebDriver, start_live_server: Any, tmp_path: Path
) -> None:
    import torch

    # tests/ is on sys.path (its conftest.py has no package): the trainer tests' helpers, with the
    # dotted-path `parity` grader that passes about half of the random tiny model's rollouts
    from distributed._helpers import make_pool, run_config

    from exgrpo_onebox.tiny import build_tiny_model
    from exgrpo_trainer.trainer import run_training

    torch.set_num_threads(1)
    pool, run = "dash-pool", "run-1"
    model = build_tiny_model(tmp_path / "model")
    with start_live_server(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}") as srv, Client(srv.url) as client:
        # a short real ExGRPO run: about half the rollouts are correct, it switches to mixed after
        # step 1, stores partially solved groups and replays them from step 3 on
        make_pool(client, pool, start_threshold=0.2)
        cfg = run_config(
            srv.url,
            pool,
            model,
            tmp_path / "run",
            "run.steps=4",
            "schedule.publish_every=2",
            "schedule.checkpoint_every=0",
        )
        run_training(cfg, client=client)
        client.post_run_metrics(pool, run, 2, {"eval/accuracy": 0.25})
        client.post_run_metrics(pool, run, 4, {"eval/accuracy": 0.5})
        stats = client.run_stats(pool, run)
        assert stats.phase == "mixed" and stats.trajectories > 0
        known = next(
            d for q in client.iter_questions(pool) if (d := client.question(pool, q.id)).trajectories
        )

        started = time.monotonic()
        browser.get(f"{srv.url}/dashboard")
        _click(browser, "the pool", f'[data-testid=pool-item][data-pool="{pool}"]')
        _click(browser, "the run", f'[data-testid=run-item][data-run="{run}"]')
        _wait(browser, "the solved chart", lambda d: _points(d, "solved") > 0)

        # charts carry their data: one point per step, two held-out accuracies, buckets, IS weights
        assert _series_points(browser, "solved", "batch/solved") == 4
        assert _series_points(browser, "solved", "eval/accuracy") == 2
        assert len(_css(browser, "#chart-solved circle.point")) == 6
        for chart in ("buckets", "bucket-now", "experience", "replay", "is", "loss", "entropy", "length"):
            assert _points(browser, chart) > 0, f"chart {chart} has no data"
        assert _series_points(browser, "is", "is/w_mean") >= 1
        assert _series_points(browser, "experience", "experience/eligible") == 4
        assert len(_css(browser, "#chart-buckets rect.point")) > 0
        assert not browser.find_element(By.ID, "chart-solved-empty").is_displayed()
        assert not browser.find_element(By.ID, "metrics-empty").is_displayed()

        # current run stats
        text = {
            k: browser.find_element(By.CSS_SELECTOR, f"[data-testid=stat-{k}]").text
            for k in ("phase", "step", "policy-version", "eligible", "retired", "trajectories")
        }
        assert text["phase"].startswith("mixed") and text["step"] == "4"
        assert text["policy-version"] == "4"
        assert text["eligible"] == str(stats.eligible) and text["retired"] == str(stats.retired)
        assert text["trajectories"] == str(stats.trajectories)
        assert browser.find_element(By.ID, "live-indicator").get_attribute("data-state") == "live"

        # live: a held-out accuracy posted now is appended by the polling, without a reload
        client.post_run_metrics(pool, run, 5, {"eval/accuracy": 0.75})
        _wait(
            browser,
            "the polled step",
            lambda d: _series_points(d, "solved", "eval/accuracy") == 3,
            timeout=10,
        )

        # the trajectory browser: search for the known question's prompt, open it
        prompt = known.prompt[-1].content
        box = browser.find_element(By.ID, "question-search")
        box.send_keys(prompt)
        _click(browser, "the search button", "#search-button")
        _wait(
            browser, "the search", lambda d: "Matches for" in d.find_element(By.ID, "questions-status").text
        )
        assert len(_css(browser, "[data-testid=question-row]")) == 1
        _click(browser, "the search hit", f'[data-testid=question-row][data-qid="{known.id}"]')
        _wait(
            browser,
            "the question detail",
            lambda d: d.find_element(By.ID, "question-detail").get_attribute("data-qid") == str(known.id),
        )
        assert browser.find_element(By.ID, "question-gold").text == known.ground_truth
        assert prompt in browser.find_element(By.ID, "question-prompt").text
        rows = _css(browser, "[data-testid=trajectory-row]")
        assert [r.get_attribute("data-tid") for r in rows] == [str(t.id) for t in known.trajectories]
        first = known.trajectories[0]
        cells = [c.text for c in rows[0].find_elements(By.TAG_NAME, "td")]
        assert cells[1:7] == [
            f"{first.reward:.2f}",
            "\u2013" if first.entropy is None else f"{first.entropy:.3f}",
            str(first.policy_version),
            run,
            str(first.step),
            str(first.num_tokens),
        ]
        states = _css(browser, f'[data-testid=run-state-row][data-run="{run}"]')
        assert states and "selected" in (states[0].get_attribute("class") or "")
        assert f"q={known.id}" in browser.current_url

        # a direct link opens the same question; the eligible sample lists replayable questions
        browser.get("about:blank")
        browser.get(f"{srv.url}/dashboard#pool={pool}&run={run}&q={known.id}")
        _wait(
            browser,
            "the linked question",
            lambda d: d.find_element(By.ID, "question-gold").text == known.ground_truth,
        )
        _click(browser, "the eligible button", "#eligible-button")
        _wait(
            browser,
            "the eligible sample",
            lambda d: "eligible questions of run" in d.find_element(By.ID, "questions-status").text,
        )
        assert len(_css(browser, "[data-testid=question-row]")) > 0
        _wait(browser, "the charts after the reload", lambda d: _points(d, "solved") > 0)
        assert not browser.find_element(By.ID, "error-banner").is_displayed()
        assert _console_errors(browser) == []
        browsing = time.monotonic() - started

        ARTIFACTS.mkdir(exist_ok=True)
        for _ in range(4):  # the whole page in one picture: grow the window to the page's height
            inner, full = browser.execute_script(
                "return [window.innerHeight, document.documentElement.scrollHeight]"
            )
            if inner >= min(full, 4000):
                break
            outer = browser.get_window_size()["height"]
            browser.set_window_size(1400, min(outer + full - inner + 8, 4000 + outer - inner))
        browser.execute_script("window.scrollTo(0, 0)")
        shot = ARTIFACTS / "dashboard.png"
        assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
        print(f"browser checks {browsing:.1f} s; screenshot {shot}")


def _ema(values: list[float], weight: float) -> list[float]:
    """The dashboard's smoothing: an exponential moving average with the start-up bias removed."""
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc = acc * weight + (1 - weight) * v
        out.append(acc / (1 - weight ** (i + 1)))
    return out


def _compare_paths(driver: WebDriver, chart: int) -> dict[str, dict[str, str]]:
    """The data attributes of each run's curve in a compare chart, read in one script: the page
    redraws its charts and tables on every poll, so elements looked up one by one can go stale."""
    found: dict[str, dict[str, str]] = driver.execute_script(
        "const out = {};"
        "for (const p of document.querySelectorAll(arguments[0])) out[p.dataset.run || ''] = {...p.dataset};"
        "return out;",
        f'[data-testid=compare-chart][data-chart="{chart}"] path.series',
    )
    return found


def _runs_table(driver: WebDriver) -> dict[str, dict[str, Any]]:
    """Each row of the runs table (its cells by column, and whether it is compared), read in one script."""
    rows: dict[str, dict[str, Any]] = driver.execute_script(
        "const out = {};"
        "for (const tr of document.querySelectorAll('[data-testid=run-row]')) {"
        "  const row = {compared: tr.querySelector('[data-testid=compare-toggle]').checked};"
        "  for (const td of tr.querySelectorAll('[data-col]')) row[td.dataset.col] = td.textContent;"
        "  out[tr.dataset.run] = row;"
        "}"
        "return out;"
    )
    return rows


def test_runs_of_a_pool_side_by_side(browser: WebDriver, start_live_server: Any, tmp_path: Path) -> None:
    import csv

    import torch
    from distributed._helpers import make_pool, run_config
    from selenium.webdriver.support.ui import Select

    from exgrpo_onebox.tiny import build_tiny_model
    from exgrpo_trainer.trainer import run_training

    torch.set_num_threads(1)
    browser.get("about:blank")  # the page of an earlier test polls its stopped service
    browser.get_log("browser")
    pool = "compare-pool"
    model = build_tiny_model(tmp_path / "model")
    with start_live_server(f"sqlite+aiosqlite:///{tmp_path / 'pool.db'}") as srv, Client(srv.url) as client:
        make_pool(client, pool, start_threshold=0.2)
        for run, extra in (("run-a", ()), ("run-b", ("run.seed=5", "experience.ratio=0.25"))):
            settings = ("run.steps=3", "schedule.publish_every=0", "schedule.checkpoint_every=0", *extra)
            run_training(
                run_config(srv.url, pool, model, tmp_path / run, f"run.name={run}", *settings), client=client
            )
        curves = {
            r: {m.step: m.metrics for m in client.run_metrics(pool, r).data} for r in ("run-a", "run-b")
        }
        keys = sorted({k for curve in curves.values() for m in curve.values() for k in m})

        browser.get(f"{srv.url}/dashboard#pool={pool}")
        _one(browser, "the runs table", '[data-testid=run-row][data-run="run-b"]')

        # the run table: each run's config and state, both runs compared by default
        table = _runs_table(browser)
        assert [table[r]["step"] for r in ("run-a", "run-b")] == ["3", "3"]
        assert [table[r]["seed"] for r in ("run-a", "run-b")] == ["0", "5"]
        assert table["run-a"]["ratio"] == "0.500 (pool)" and table["run-b"]["ratio"] == "0.250"
        assert all(row["compared"] for row in table.values())

        # overlaid curves, one per run; every stored metric can be chosen
        _wait(browser, "the compared curves", lambda d: len(_compare_paths(d, 0)) == 2)
        paths = _compare_paths(browser, 0)
        assert {p["metric"] for p in paths.values()} == {"batch/solved"}
        assert all(p["points"] == "3" for p in paths.values())
        metric_select = '[data-testid=compare-chart][data-chart="0"] select'
        options = browser.execute_script(
            "return [...document.querySelector(arguments[0]).options].map((o) => o.value);", metric_select
        )
        assert sorted(options) == keys

        def choose(d: WebDriver) -> bool:
            Select(d.find_element(By.CSS_SELECTOR, metric_select)).select_by_value("actor/entropy")
            return True

        _wait(browser, "the metric chooser", choose)
        _wait(
            browser,
            "the chosen metric",
            lambda d: {p["metric"] for p in _compare_paths(d, 0).values()} == {"actor/entropy"},
        )
        for run, p in _compare_paths(browser, 0).items():
            assert float(p["last"]) == curves[run][3]["actor/entropy"]

        # smoothing: the plotted values are the smoothed ones, the raw curves stay faint behind
        browser.execute_script(
            "const s = document.getElementById('smoothing'); s.value = '0.9';"
            "s.dispatchEvent(new Event('input', {bubbles: true}));"
        )
        _wait(browser, "the smoothed curves", lambda d: len(_css(d, '[data-chart="0"] path.series-raw')) == 2)
        assert browser.find_element(By.ID, "smoothing-value").text == "0.90"
        for run, p in _compare_paths(browser, 0).items():
            want = _ema([curves[run][s]["actor/entropy"] for s in (1, 2, 3)], 0.9)[-1]
            assert float(p["last"]) == pytest.approx(want, rel=1e-12)

        # one run less: its curve goes, the link says which runs are compared; a chart more
        _click(browser, "the run-b toggle", '[data-testid=compare-toggle][data-run="run-b"]')
        _wait(browser, "run-b left out", lambda d: set(_compare_paths(d, 0)) == {"run-a"})
        assert "cmp=run-a" in browser.current_url
        _click(browser, "the compare-add button", "#compare-add")
        _wait(browser, "a third chart", lambda d: len(_css(d, "[data-testid=compare-chart]")) == 3)

        # CSV export: every stored metric of the compared runs, one row per run and step
        downloads = tmp_path / "downloads"
        downloads.mkdir()
        browser.execute_cdp_cmd(
            "Browser.setDownloadBehavior", {"behavior": "allow", "downloadPath": str(downloads)}
        )
        _click(browser, "the run-b toggle", '[data-testid=compare-toggle][data-run="run-b"]')
        _wait(browser, "run-b back", lambda d: len(_compare_paths(d, 0)) == 2)
        _click(browser, "the compare-csv button", "#compare-csv")
        target = downloads / f"{pool}-runs.csv"
        _wait(browser, "the CSV download", lambda d: target.is_file() and target.stat().st_size > 0)
        with target.open(newline="") as f:
            rows = list(csv.DictReader(f))
        assert list(rows[0]) == ["run", "step", *keys]
        assert [(r["run"], int(r["step"])) for r in rows] == [
            (run, s) for run in ("run-a", "run-b") for s in (1, 2, 3)
        ]
        for r in rows:
            stored = curves[r["run"]][int(r["step"])]
            assert {k: float(v) for k, v in r.items() if k not in ("run", "step") and v != ""} == stored

        # stored trajectories read as text
        known = next(
            d for q in client.iter_questions(pool) if (d := client.question(pool, q.id)).trajectories
        )
        browser.get(f"{srv.url}/dashboard#pool={pool}&q={known.id}")
        _wait(
            browser,
            "the question",
            lambda d: len(_css(d, "[data-testid=trajectory-row]")) == len(known.trajectories),
        )
        shown = [c.get_attribute("textContent") for c in _css(browser, "[data-testid=trajectory-text]")]
        assert shown == [t.text for t in known.trajectories] and all(shown)
        assert not browser.find_element(By.ID, "error-banner").is_displayed()
        assert _console_errors(browser) == []
