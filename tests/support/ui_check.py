"""The Prefect UI, checked in a real browser: headless Chromium driven over the DevTools protocol.

Used by ``tests/end_to_end/test_ui.py``; also a script that regenerates the README's screenshots:

    uv run --all-extras python tests/support/ui_check.py --out docs/screenshots

The script starts its own ``prefect server start`` (UI included) with a temporary PREFECT_HOME, runs
the EuroSAT flow on the shared sample (tiny preset, 1 epoch), then opens the flow run page, its logs,
the training job's page and the artifacts in headless Chromium (Debian's ``chromium``), checks what the
rendered DOM shows and saves screenshots; then the edit page of a ``kinetic-gke`` and a ``kinetic-local`` pool in
both of Prefect's UIs (``--pool-forms-only``: those alone). Before each screenshot this machine's folders in the
page's text are replaced by neutral names (``../shared``, ``$TMPDIR``, ``~``). Only ``websockets`` (a Prefect
dependency) is used besides
the standard library.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from kinetic_prefect.contract import TRACKING_TASK_KEY_PREFIX

ROOT = Path(__file__).resolve().parents[2]
SAMPLE_ZIP = ROOT.parent / "shared" / "data" / "eurosat" / "EuroSAT_RGB_sample.zip"
SCREEN = (1400, 1000)
MAX_PNG_BYTES = 300_000


def find_chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        path = shutil.which(name)
        if path:
            return path
    return None


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_http(url: str, timeout: float, proc: subprocess.Popen | None = None) -> None:
    deadline = time.time() + timeout
    while True:
        try:
            with urllib.request.urlopen(url, timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        if (proc is not None and proc.poll() is not None) or time.time() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout:.0f} s")
        time.sleep(0.3)


def get_json(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def post_json(url: str, body: dict):
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), method="POST", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


# ------------------------------------------------------------------------------------------ browser


class Browser:
    """One headless Chromium page, driven over the DevTools protocol (a websocket)."""

    def __init__(self, executable: str, size: tuple[int, int] = SCREEN):
        from websockets.sync.client import connect

        self.profile = tempfile.mkdtemp(prefix="kinetic-ui-chromium-")
        args = [
            executable,
            "--headless=new",
            "--remote-debugging-port=0",
            f"--user-data-dir={self.profile}",
            f"--window-size={size[0]},{size[1]}",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-dev-shm-usage",
            "--disable-extensions",
            "--hide-scrollbars",
            "--mute-audio",
            "--enable-unsafe-swiftshader",
            "about:blank",
        ]
        if os.geteuid() == 0:
            args.insert(1, "--no-sandbox")  # Chromium refuses to run as root with its sandbox
        # its own process group, so that closing it also ends its renderer/GPU/zygote processes; the child
        # writes the log through its own copy of the descriptor
        with open(Path(self.profile) / "chromium.log", "wb") as log:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        port_file = Path(self.profile) / "DevToolsActivePort"
        deadline = time.time() + 60
        while not (port_file.exists() and port_file.read_text().strip()):
            if self.proc.poll() is not None or time.time() > deadline:
                raise RuntimeError(
                    "Chromium did not start:\n" + (Path(self.profile) / "chromium.log").read_text()[-2000:]
                )
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        wait_http(f"http://127.0.0.1:{port}/json/version", 30)
        pages = [t for t in get_json(f"http://127.0.0.1:{port}/json/list") if t["type"] == "page"]
        self.ws = connect(pages[0]["webSocketDebuggerUrl"], max_size=None, open_timeout=30)
        self._id = 0
        self.console: list[str] = []  # console errors and failed requests, for the report
        self.call("Page.enable")
        self.call("Runtime.enable")
        self.call("Network.enable")
        self._viewport(*size)

    def _viewport(self, width: int, height: int) -> None:
        self.call("Emulation.setDeviceMetricsOverride", width=width, height=height, deviceScaleFactor=1, mobile=False)

    def call(self, method: str, timeout: float = 60, **params):
        self._id += 1
        ident = self._id
        self.ws.send(json.dumps({"id": ident, "method": method, "params": params}))
        deadline = time.time() + timeout
        while True:
            message = json.loads(self.ws.recv(timeout=max(0.1, deadline - time.time())))
            if message.get("id") == ident:
                if "error" in message:
                    raise RuntimeError(f"{method}: {message['error']}")
                return message.get("result", {})
            self._event(message)

    def _event(self, message: dict) -> None:
        method, params = message.get("method"), message.get("params", {})
        if method == "Runtime.consoleAPICalled" and params.get("type") == "error":
            self.console.append(
                "console: "
                + " ".join(str(a.get("value", a.get("description", ""))) for a in params.get("args", []))[:300]
            )
        elif method == "Runtime.exceptionThrown":
            self.console.append("exception: " + params.get("exceptionDetails", {}).get("text", "")[:300])
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            self.console.append(f"request failed: {params.get('errorText')} ({params.get('type')})")

    def evaluate(self, expression: str):
        result = self.call("Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression[:80]}...: {result['exceptionDetails'].get('text')}")
        return result["result"].get("value")

    def goto(self, url: str) -> None:
        """Navigates and waits until the new document has replaced the old one."""
        self.evaluate("window.__kineticOldPage = true")
        self.call("Page.navigate", url=url)
        self.wait_for("!window.__kineticOldPage && document.readyState !== 'loading'", 60, what=f"the page {url}")

    def wait_for(self, expression: str, timeout: float = 60, what: str = "") -> object:
        """Polls a JS expression until it is truthy; fails naming ``what`` and the page's text."""
        deadline = time.time() + timeout
        while True:
            try:
                value = self.evaluate(expression)
            except RuntimeError:
                value = None
            if value:
                return value
            if time.time() > deadline:
                text = self.text()[:1500]
                raise AssertionError(
                    f"the UI never showed {what or expression} within {timeout:.0f} s; "
                    f"the page shows:\n{text}\nbrowser errors: {self.console[-5:]}"
                )
            time.sleep(0.4)

    def wait_text(self, *needles: str, timeout: float = 60, scope: str = "body") -> None:
        """Waits until the element ``scope`` (a CSS selector) shows every needle in its rendered text."""
        element = f"document.querySelector({json.dumps(scope)})"
        js = " && ".join(f"{element}.innerText.includes({json.dumps(n)})" for n in needles)
        self.wait_for(
            f"!!{element} && {js}",
            timeout,
            what=" and ".join(repr(n) for n in needles) + ("" if scope == "body" else f" in {scope}"),
        )

    def click_tab(self, name: str, timeout: float = 60) -> str:
        """Clicks the page's tab named ``name`` (the UI keeps the tab in its state, not in the URL); returns
        a CSS selector for the tab's content panel (the page's body if it has none)."""
        find = f"""Array.from(document.querySelectorAll('[role=tablist] > *, [role=tab], .p-tab'))
            .find(e => e.textContent.trim() === {json.dumps(name)} && e.getBoundingClientRect().width > 0)"""
        self.wait_for(
            f"(() => {{ const tab = {find}; if (!tab) return false; tab.click(); return true; }})()",
            timeout,
            what=f"the tab {name!r}",
        )
        self.wait_for(
            f"""(() => {{ const tab = {find};
            return tab && (tab.classList.contains('p-tab__active') || tab.getAttribute('aria-selected') === 'true');
            }})()""",
            10,
            what=f"the tab {name!r} selected",
        )
        panel = self.evaluate(f"""(() => {{ const tab = {find};
            const id = tab.getAttribute('aria-controls') || tab.getAttribute('area-controls');
            return id && document.getElementById(id) ? '#' + CSS.escape(id) : 'body'; }})()""")
        return panel or "body"

    def text(self) -> str:
        return self.evaluate("document.body ? document.body.innerText : ''") or ""

    def redact_paths(self, replacements: dict[str, str] | None = None) -> None:
        """Replaces this machine's absolute paths in the page's text with neutral names (``../shared``,
        ``$TMPDIR``, ``~``), so a committed screenshot shows no machine's layout; fails if any is left."""
        replacements = replacements or machine_paths()
        pairs = sorted(replacements.items(), key=lambda item: -len(item[0]))
        self.evaluate(f"""(() => {{
            const pairs = {json.dumps(pairs)};
            const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
            for (let node = walker.nextNode(); node; node = walker.nextNode()) {{
                let text = node.nodeValue;
                for (const [path, name] of pairs) text = text.split(path).join(name);
                if (text !== node.nodeValue) node.nodeValue = text;
            }}
        }})()""")
        left = [path for path in replacements if path in self.text()]
        if left:
            raise AssertionError(f"the page still shows machine paths {left} after redaction")

    def settle(self, seconds: float = 1.5) -> None:
        """Lets animations and late requests finish before a screenshot."""
        end = time.time() + seconds
        while time.time() < end:
            self.evaluate("1")
            time.sleep(0.2)

    def screenshot(self, path: Path, height: int | None = None, max_bytes: int = MAX_PNG_BYTES) -> Path:
        """A PNG of the viewport; ``height``: of a taller viewport, for pages longer than the screen."""
        if height:
            self._viewport(SCREEN[0], height)
            self.settle(1.0)
        try:
            data = base64.b64decode(self.call("Page.captureScreenshot", format="png")["data"])
        finally:
            if height:
                self._viewport(*SCREEN)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(shrink_png(data, max_bytes))
        return path

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.ws.close()
        for sig, wait in ((signal.SIGTERM, 10), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)  # the group Popen started: Chromium and its helpers
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                continue
            if sig == signal.SIGTERM:
                time.sleep(0.5)  # let the helpers follow the browser out, then make sure of it
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            break
        shutil.rmtree(self.profile, ignore_errors=True)


def machine_paths() -> dict[str, str]:
    """This machine's absolute paths that pages may show (data, checkout, temp and home folders), each with the
    name the docs use for it."""
    names = {ROOT.parent / "shared": "../shared", ROOT: ".", Path(tempfile.gettempdir()): "$TMPDIR", Path.home(): "~"}
    paths = {}
    for path, name in names.items():
        for spelling in (str(path), os.path.realpath(path)):  # ../shared may be a link, logs show its target
            if len(spelling) > 1:
                paths.setdefault(spelling, name)
    return paths


def shrink_png(data: bytes, max_bytes: int) -> bytes:
    """The screenshot as a small PNG (at most ``max_bytes``): 128-colour palette, downscaled if need be."""
    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    scale = 1.0
    while True:
        size = (int(image.width * scale), int(image.height * scale))
        small = image.resize(size, Image.LANCZOS) if scale < 1 else image
        out = io.BytesIO()
        small.quantize(colors=128, method=Image.Quantize.MEDIANCUT).save(out, "PNG", optimize=True)
        if out.tell() <= max_bytes or scale < 0.3:
            return out.getvalue() if out.tell() < len(data) else data
        scale *= 0.85


# ------------------------------------------------------------------------------------------ server + flow


class Server:
    """``prefect server start`` (UI included) with a temporary PREFECT_HOME and SQLite database."""

    def __init__(self, port: int | None = None, start_timeout: float = 180):
        self.dir = Path(tempfile.mkdtemp(prefix="kinetic-ui-server-"))
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {
            **os.environ,
            "PREFECT_HOME": str(self.dir / "home"),
            "PREFECT_API_URL": f"{self.url}/api",
            "PREFECT_UI_API_URL": f"{self.url}/api",  # what the UI in the browser talks to
            "PREFECT_UI_ENABLED": "true",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_LOGGING_TO_API_BATCH_INTERVAL": "0.3",
            "PREFECT_API_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{self.dir}/prefect.db",
            "KINETIC_CACHE_DIR": str(self.dir / "kinetic-cache"),
        }
        self.env.pop("KINETIC_STORE", None)
        self.env.pop("KINETIC_WORK_POOL", None)
        with open(self.dir / "server.log", "wb") as server_log:  # the child writes through its own descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(self.port)],
                stdout=server_log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        try:
            wait_http(f"{self.url}/api/health", start_timeout, self.proc)
        except RuntimeError:
            log = (self.dir / "server.log").read_text()[-3000:]  # before stop() removes the folder
            self.stop()
            raise RuntimeError("prefect server start failed:\n" + log) from None

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
        shutil.rmtree(self.dir, ignore_errors=True)


FLOW_DRIVER = """
import json, sys, time
sys.path.insert(0, sys.argv[1])
import eurosat_vit
params = json.loads(sys.argv[2])
state = eurosat_vit.eurosat_vit(return_state=True, **params)
print("UI-CHECK-RESULT " + json.dumps({"flow_run_id": str(state.state_details.flow_run_id), "state": state.name}))
"""


def run_eurosat_flow(env: dict, work_dir: Path, source: Path = SAMPLE_ZIP, timeout: float = 900) -> dict:
    """The EuroSAT flow on the sample (tiny preset, 1 epoch) in its own process, against ``env``'s API."""
    params = dict(
        source=str(source),
        epochs=1,
        model_size="tiny",
        batch_size=64,
        cache_dir=str(work_dir / "eurosat-cache"),
        output_dir=str(work_dir / "eurosat-out"),
    )
    started = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", FLOW_DRIVER, str(ROOT / "flows"), json.dumps(params)],
        cwd=ROOT,
        env={**env, "KERAS_BACKEND": "jax"},
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("UI-CHECK-RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"the EuroSAT flow failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        )
    result = json.loads(lines[-1].split(" ", 1)[1])
    result["seconds"] = round(time.time() - started, 1)
    if result["state"] != "Completed":
        raise RuntimeError(f"the EuroSAT flow ended {result['state']}:\n{proc.stderr[-3000:]}")
    return result


# ------------------------------------------------------------------------------------------ API facts


def run_facts(api_url: str, flow_run_id: str) -> dict:
    """What the API says about the run: task runs, the training job (child flow run), artifacts."""
    task_runs = post_json(f"{api_url}/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200})
    # A job hangs under a tracking task run of its own (named like the job), whose parent is the task.
    train = [
        t
        for t in task_runs
        if t["name"].startswith("eurosat-train") and not t["task_key"].startswith(TRACKING_TASK_KEY_PREFIX)
    ]
    assert train, f"no eurosat-train task run in {[t['name'] for t in task_runs]}"
    train_ids = {t["id"] for t in train}
    trackers = [t for t in task_runs if {p["id"] for p in t["task_inputs"].get("__parents__", [])} & train_ids]
    assert trackers, "the training task run has no job node (a tracking task run whose parent is the task)"
    jobs = post_json(
        f"{api_url}/flow_runs/filter", {"flow_runs": {"parent_task_run_id": {"any_": [t["id"] for t in trackers]}}}
    )
    assert jobs, "the training job has no child flow run nested under its tracking task run"
    flow_run = get_json(f"{api_url}/flow_runs/{flow_run_id}")
    run_ids = [flow_run_id] + [j["id"] for j in jobs]
    artifacts = post_json(f"{api_url}/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": run_ids}}})
    return {
        "flow_run": flow_run,
        "task_runs": task_runs,
        "train_task_run": train[-1],
        "job": jobs[-1],
        "job_tracker": next(t for t in trackers if t["id"] == jobs[-1]["parent_task_run_id"]),
        "artifacts": artifacts,
    }


# ------------------------------------------------------------------------------------------ the checks


def _images_js() -> str:
    """Every <img> inside the page's main content: src kind, loaded, natural size, rendered size."""
    return """(() => Array.from(document.querySelectorAll('img')).filter(i => !i.closest('nav, aside, header'))
        .map(i => ({src: i.src.slice(0, 40), complete: i.complete, w: i.naturalWidth, h: i.naturalHeight,
                    shown: i.getBoundingClientRect().width, alt: i.alt})))()"""


class UICheck:
    """The run's pages in headless Chromium: each step checks the rendered DOM and saves screenshots.

    A step raises AssertionError when the UI does not show what it must; what works goes to
    ``report["checks"]``, what is missing but not fatal to ``report["problems"]``.
    """

    TASKS = ("eurosat-fetch", "eurosat-decode", "eurosat-split", "eurosat-train", "eurosat-evaluate", "eurosat-publish")

    def __init__(self, ui_url: str, api_url: str, flow_run_id: str, out_dir: Path, chromium: str):
        self.ui_url, self.api_url, self.flow_run_id, self.out_dir = ui_url, api_url, flow_run_id, Path(out_dir)
        self.facts = run_facts(api_url, flow_run_id)
        self.flow_run, self.job, self.train = self.facts["flow_run"], self.facts["job"], self.facts["train_task_run"]
        self.report: dict = {
            "flow_run": self.flow_run["name"],
            "job": self.job["name"],
            "train_task_run": self.train["name"],
            "screenshots": {},
            "timings_s": {},
            "checks": [],
            "problems": [],
            "notes": [],
            "artifacts": {},
        }
        self.browser = Browser(chromium)

    def close(self) -> None:
        self.report["browser_errors"] = self.browser.console[-20:]
        self.browser.close()

    # helpers
    def _open(self, path: str, label: str, *needles: str, tab: str | None = None, timeout: float = 90) -> None:
        t0 = time.time()
        self.browser.goto(f"{self.ui_url}{path}")
        scope = self.browser.click_tab(tab, timeout=timeout) if tab else "body"
        if needles:
            self.browser.wait_text(*needles, timeout=timeout, scope=scope)
        self.report["timings_s"][label] = round(time.time() - t0, 1)

    def _shot(self, name: str, height: int | None = None) -> None:
        self.browser.settle()
        self.browser.redact_paths()
        self.report["screenshots"][name] = str(self.browser.screenshot(self.out_dir / name, height=height))

    def _scroll_to(self, needle: str) -> None:
        """Scrolls the innermost element showing ``needle`` to the middle of the screen."""
        self.browser.evaluate(f"""(() => {{
            const hits = Array.from(document.querySelectorAll('body *'))
                .filter(e => e.children.length === 0 && e.textContent.includes({json.dumps(needle)}));
            if (hits.length) hits[hits.length - 1].scrollIntoView({{block: 'center'}});
        }})()""")

    def _ok(self, line: str) -> None:
        self.report["checks"].append(line)

    # steps
    def ui_settings(self) -> None:
        settings = get_json(f"{self.ui_url}/ui-settings")
        assert settings["api_url"].rstrip("/") == self.api_url.rstrip("/"), (
            f"the UI talks to {settings['api_url']}, not to this server's API {self.api_url}"
        )
        self._ok(f"/ui-settings: the UI talks to {settings['api_url']}")

    def flow_run_page(self) -> None:
        """The run page (state, graph), its Task Runs tab and the job in its Subflow Runs tab."""
        run, job = self.flow_run, self.job
        self._open(f"/runs/flow-run/{self.flow_run_id}", "flow_run_page", run["name"], "Completed")
        self.browser.wait_for("document.querySelector('canvas') !== null", 30, what="the run graph (a canvas)")
        self._ok(f"flow run page: {run['name']} Completed, with its graph (canvas)")
        self._shot("flow-run.png")

        self._open(f"/runs/flow-run/{self.flow_run_id}", "task_runs_tab", *self.TASKS, tab="Task Runs")
        self._ok("Task Runs tab lists " + ", ".join(self.TASKS))
        self._shot("flow-run-task-runs.png")

        self._open(f"/runs/flow-run/{self.flow_run_id}", "subflow_runs_tab", job["name"], tab="Subflow Runs")
        self._ok(
            f"Subflow Runs tab lists the training job {job['name']} (under its tracking task run, whose "
            f"parent is the {self.train['name']} task run)"
        )
        self._shot("flow-run-subflows.png")

    def logs(self) -> None:
        """The flow's logs (task lines, the evaluate line) and the job's own epoch lines on its run."""
        self._open(
            f"/runs/flow-run/{self.flow_run_id}",
            "logs_tab",
            "Beginning flow run",
            "eurosat-decode",
            "test accuracy",
            tab="Logs",
        )
        self._ok("flow run Logs tab: flow + task lines, the evaluate line (test accuracy ...)")
        self._scroll_to("test accuracy")
        self._shot("flow-run-logs.png")

        self._open(f"/runs/flow-run/{self.job['id']}", "job_logs_tab", "epoch 1/1", tab="Logs")
        self.browser.wait_text(self.job["name"], "Parent Run", self.flow_run["name"], timeout=30)
        self._ok(
            f"the job's run {self.job['name']}: 'Parent Run {self.flow_run['name']}' in its header, its "
            "epoch lines (epoch 1/1) in Logs"
        )
        self._shot("job-logs.png")

    def artifacts(self) -> None:
        """The run's Artifacts tab, then each artifact's own page (tables, markdown, images, progress)."""
        keys = sorted({a["key"] for a in self.facts["artifacts"] if a.get("key")})
        self._open(f"/runs/flow-run/{self.flow_run_id}", "artifacts_tab", "eurosat-report", tab="Artifacts")
        self._ok("Artifacts tab of the flow run lists " + ", ".join(k for k in keys if k.startswith("eurosat")))
        self._shot("flow-run-artifacts.png")
        for artifact in self.facts["artifacts"]:
            self._artifact(artifact)

    def _artifact(self, artifact: dict) -> None:
        browser = self.browser
        kind, key = artifact["type"], self.artifact_name(artifact)
        t0 = time.time()
        browser.goto(f"{self.ui_url}/artifacts/artifact/{artifact['id']}")
        data = artifact["data"]
        if kind == "table":
            rows = json.loads(data) if isinstance(data, str) else data
            first = rows[0] if rows else {}
            needle = str(next(iter(first.values()))) if first else key
            browser.wait_for(
                "document.querySelectorAll('table tr, [role=row]').length > 1",
                60,
                what=f"the rows of table artifact {key}",
            )
            browser.wait_text(needle, timeout=30)
            self._ok(f"table artifact {key}: a table ({len(rows)} rows, first cell {needle!r})")
        elif kind == "markdown":
            browser.wait_for(
                "document.querySelectorAll('h1, h2, table').length > 0", 60, what=f"the rendered markdown of {key}"
            )
            self._ok(f"markdown artifact {key}: headings/tables rendered")
        elif kind == "progress":
            browser.wait_text(f"{float(data):.0f}%", timeout=60)
            self._ok(f"progress artifact {key}: {float(data):.0f}% shown ({artifact.get('description')!r})")
        elif kind == "image":
            browser.wait_for("document.querySelector('img') !== null", 60, what=f"the image of {key}")
        browser.settle(2.0)
        images = browser.evaluate(_images_js()) or []
        self.report["timings_s"][f"artifact {key}"] = round(time.time() - t0, 1)
        rendered = [i for i in images if i["complete"] and i["w"] > 0 and i["shown"] > 0]
        if carries_image(artifact):
            if rendered and len(rendered) == len(images):
                self._ok(
                    f"{kind} artifact {key}: {len(rendered)} image(s) rendered ("
                    + ", ".join(f"{i['w']}x{i['h']}" for i in rendered)
                    + ")"
                )
            else:
                self.report["problems"].append(
                    f"{kind} artifact {key}: its image does not render in the UI (images in the DOM: {images})"
                )
        self.report["artifacts"][key] = {"type": kind, "images": images, "rendered": len(rendered)}
        safe = "".join(c if c.isalnum() or c in "-_" else "-" for c in key)
        self._shot(f"artifact-{safe}.png", height=1600 if kind == "markdown" else None)

    def artifact_name(self, artifact: dict) -> str:
        """Its key, or (keyless) its type and the run it belongs to: ``table-eurosat-train``."""
        if artifact.get("key"):
            return artifact["key"]
        owner = next(
            (t["name"].rsplit("-", 1)[0] for t in self.facts["task_runs"] if t["id"] == artifact.get("task_run_id")),
            None,
        )
        if owner is None:
            owner = "job" if artifact.get("flow_run_id") == self.job["id"] else artifact["id"][:8]
        return f"{artifact['type']}-{owner}"

    def summary(self) -> None:
        """Problems that are not a page failing: images that exist only on disk, no progress artifact."""
        if not any(carries_image(a) for a in self.facts["artifacts"]):
            self.report["problems"].append(
                "no artifact of the run carries an image: confusion_matrix.png and learning_curves.png exist only "
                "as files in the output directory, so the UI cannot show them"
            )
        if not self.job_progress():
            others = [self.artifact_name(a) for a in self.facts["artifacts"] if a["type"] == "progress"]
            self.report["problems"].append(
                f"no progress artifact on the job's run {self.job['name']}: the training job reports no progress "
                "(kinetic_prefect.pod.progress.report)"
                + (f"; other progress artifacts: {', '.join(others)}" if others else "")
            )

    def job_progress(self) -> list[dict]:
        """The progress artifacts on the job's own run (what the job reported while training)."""
        return [
            a for a in self.facts["artifacts"] if a["type"] == "progress" and a.get("flow_run_id") == self.job["id"]
        ]

    def run_all(self) -> dict:
        self.ui_settings()
        self.flow_run_page()
        self.logs()
        self.artifacts()
        self.summary()
        return self.report


# ------------------------------------------------------------------------------------------ pool forms


NONE_MESSAGE = 'Property is type "None"'


def pool_form_labels(template: dict) -> list[str]:
    """The label each variable gets in the form: its title (a block reference is labelled by its block type)."""
    return [prop["title"] for prop in template["variables"]["properties"].values() if "$ref" not in prop]


def check_pool_form(
    browser: Browser,
    server_url: str,
    pool: str,
    worker_type: str,
    template: dict,
    ui: str,
    screenshot: Path | None = None,
) -> str:
    """Opens the pool's edit page in the V1 (``/``) or V2 (``/v2``) UI and checks that "Base Job Template" shows
    the template's variables as form fields, none of them `Property is type "None"`."""
    base = server_url.rstrip("/") + ("/v2" if ui == "v2" else "")
    browser.goto(f"{base}/work-pools/work-pool/{pool}/edit")
    browser.wait_text("Base Job Template", "The fields below control the default values", timeout=90)
    labels = pool_form_labels(template)
    browser.wait_text(*labels, timeout=60)
    if any("$ref" in prop for prop in template["variables"]["properties"].values()):
        browser.wait_text("KubernetesClusterConfig" if ui == "v1" else "Cluster config", timeout=30)
    browser.settle(1.0)
    text = browser.text()
    assert NONE_MESSAGE not in text, f"{ui} shows {NONE_MESSAGE} {text.count(NONE_MESSAGE)} times for {pool}"
    fields = browser.evaluate(
        "document.querySelectorAll('input:not([type=hidden]), textarea, select, [role=combobox], "
        "[role=switch], .cm-content, .p-code-highlight').length"
    )
    assert fields >= len(labels) - 2, f"{ui}: only {fields} form controls for {len(labels)} variables of {pool}"
    if ui == "v2":  # V2 shows the pool's type (a disabled input); V1 only types in Prefect's registry
        shows_type = f"Array.from(document.querySelectorAll('input')).some(i => i.value === {json.dumps(worker_type)})"
        browser.wait_for(shows_type, 30, what=f"the pool's type {worker_type} in the Type field")
    if screenshot:
        browser.redact_paths()
        browser.screenshot(screenshot, height=2200)
    return f"{ui} edit page of {pool}: {len(labels)} labelled variables, {fields} form controls"


def pool_form_screenshots(server_url: str, out_dir: Path, chromium: str) -> list[str]:
    """A pool of each kinetic type made from the shipped templates, its edit page in both UIs, screenshots."""
    from kinetic_prefect.workers.base import load_template

    browser = Browser(chromium)
    checks = []
    try:
        for worker_type in ("kinetic-gke", "kinetic-local"):
            template = load_template(worker_type)
            pool = f"my-{worker_type.removeprefix('kinetic-')}-pool"
            post_json(
                f"{server_url}/api/work_pools/", {"name": pool, "type": worker_type, "base_job_template": template}
            )
            for ui in ("v2", "v1"):
                shot = out_dir / f"pool-form-{worker_type}-{ui}.png"
                checks.append(check_pool_form(browser, server_url, pool, worker_type, template, ui, shot))
    finally:
        browser.close()
    return checks


def carries_image(artifact: dict) -> bool:
    data = str(artifact.get("data"))
    return artifact["type"] == "image" or "![" in data or "<img" in data


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=str(ROOT / "docs" / "screenshots"))
    parser.add_argument("--source", default=str(SAMPLE_ZIP))
    parser.add_argument("--url", help="check a run on this running server (http://host:port) instead")
    parser.add_argument("--flow-run-id", help="with --url: the EuroSAT flow run to check")
    parser.add_argument(
        "--pool-forms-only", action="store_true", help="only the work pools' edit pages (no EuroSAT run)"
    )
    args = parser.parse_args(argv)
    chromium = find_chromium()
    if not chromium:
        print("chromium is not installed (Debian: apt-get install -y chromium)", file=sys.stderr)
        return 2
    if args.pool_forms_only:
        server = Server(start_timeout=600)
        try:
            print("\n".join(pool_form_screenshots(server.url, Path(args.out), chromium)))
        finally:
            server.stop()
        return 0
    if args.url:
        check = UICheck(args.url, f"{args.url}/api", args.flow_run_id, Path(args.out), chromium)
        try:
            report = check.run_all()
        finally:
            check.close()
        return _print(report)
    t0 = time.time()
    server = Server(start_timeout=600)  # a first start creates the database: minutes on busy cores
    print(f"prefect server start: {server.url} ({time.time() - t0:.0f} s)", flush=True)
    try:
        with tempfile.TemporaryDirectory(prefix="kinetic-ui-run-") as work:
            run = run_eurosat_flow(server.env, Path(work), Path(args.source))
            print(f"EuroSAT flow: {run}", flush=True)
            t1 = time.time()
            check = UICheck(server.url, f"{server.url}/api", run["flow_run_id"], Path(args.out), chromium)
            try:
                report = check.run_all()
            finally:
                check.close()
            report["timings_s"]["browser_total"] = round(time.time() - t1, 1)
            report["timings_s"]["flow"] = run["seconds"]
            report["checks"] += pool_form_screenshots(server.url, Path(args.out), chromium)
    finally:
        server.stop()
    return _print(report)


def _print(report: dict) -> int:
    """The report as JSON, then its problems on stderr; the screenshots are taken either way."""
    print(json.dumps(report, indent=1))
    for problem in report["problems"]:
        print(f"PROBLEM: {problem}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
