"""The HTML report: what it summarizes, the page it writes, and that page opened in a real
headless Chromium (no console errors, no network, every chart drawn with its series)."""

from __future__ import annotations

import html.parser
import json
import os
import sys
from pathlib import Path

import pytest

from gputrace.analyzers import analyze
from gputrace.analyzers.core.detail import MAX_BARS
from gputrace.report import html as report_html
from gputrace.trace import load
from tests.conftest import run_gputrace
from tests.tracebuilder import Builder, ddp_iterations

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]
CASE2_UNITS = [([4], 40, 62), ([3], 62, 72), ([2], 72, 84), ([1], 85, 92)]
STACK = ["t_io", "t_h2d", "t_f", "t_b", "t_u", "exposed comm", "other"]


def gpu_iterations(b: Builder, kernels: int, n: int = 4) -> Builder:
    """n iterations of 100 ms; `kernels` kernels on each of two streams in each, launched in
    forward (stream 7) and backward (stream 8)."""
    for k in range(n):
        base = k * 100
        b.span("iteration", base, base + 100, step=k)
        b.span("forward", base, base + 40, step=k)
        b.span("backward", base + 40, base + 95, step=k)
        for stream, lo, hi in ((7, 0, 40), (8, 40, 95)):
            width = (hi - lo) / kernels
            for j in range(kernels):
                s = base + lo + j * width
                b.span("kernel", s, s + width * 0.6, name="k", device=0, stream=stream, step=k)
    return b


# -- what analyze(detail=True) keeps ------------------------------------------------------


def test_timeline_of_a_median_ddp_iteration(tmp_path):
    b = ddp_iterations(Builder(), CASE2_UNITS, update=(92, 98))
    a = analyze(load(b.write(tmp_path / "t.arrow")), skip=1, detail=True)
    tl = a.main.detail.timeline
    assert tl.index == 3      # all iterations last 100 ms: the middle of the analyzed 1..5
    assert tl.t_iter_s == pytest.approx(0.100)
    assert tl.lanes == ["host", "layer 4", "layer 3", "layer 2", "layer 1",
                        "unit 0", "unit 1", "unit 2", "unit 3"]
    host = [(x.what, x.start_s, x.end_s) for x in tl.bars if x.lane == "host"]
    assert host == [("io", 0.0, pytest.approx(0.005)), ("forward", pytest.approx(0.005),
                    pytest.approx(0.030)), ("update", pytest.approx(0.092), pytest.approx(0.098))]
    unit1 = [x for x in tl.bars if x.lane == "unit 1"]
    # ready when layer 3's backward ends (55 ms), on the link 62-72 ms, exposed
    assert [(x.part, x.start_s, x.end_s, x.what) for x in unit1] == [
        ("queued", pytest.approx(0.055), pytest.approx(0.062), "comm exposed"),
        ("on the link", pytest.approx(0.062), pytest.approx(0.072), "comm exposed")]
    assert [x.what for x in tl.bars if x.lane == "unit 2"] == ["comm hidden"] * 2
    assert "layer 3" in unit1[0].note and "1.00 MB" in unit1[0].note
    s = a.main.detail.series
    assert s.warmup == 1 and list(s.step) == [0, 1, 2, 3, 4, 5]
    assert list(s.comm_exposed_s) == pytest.approx([0.007] * 6)


def test_gpu_records_merge_per_stream_and_phase_into_few_bars(tmp_path):
    a = analyze(load(gpu_iterations(Builder(), 5000).write(tmp_path / "t.arrow")),
                detail=True)
    tl = a.main.detail.timeline
    gpu = [x for x in tl.bars if x.lane.startswith("GPU")]
    assert sorted({x.lane for x in gpu}) == ["GPU 0 stream 7", "GPU 0 stream 8"]
    for lane in ("GPU 0 stream 7", "GPU 0 stream 8"):
        mine = [x for x in gpu if x.lane == lane]
        assert 1 <= len(mine) <= MAX_BARS
        assert sum(x.count for x in mine) == 5000      # every kernel is in one bar
    # merged bars cover the kernels: stream 7 from 0 to the last kernel's end in forward
    s7 = [x for x in gpu if x.lane == "GPU 0 stream 7"]
    assert min(x.start_s for x in s7) == pytest.approx(0.0)
    assert max(x.end_s for x in s7) == pytest.approx(0.040 - 0.040 / 5000 * 0.4)


def with_counters(b: Builder) -> Builder:
    """400 ms of samples: 1 MB from disk and 3 MB read() per 10 ms (so 2 MB from the page
    cache), 0.5 MB received on eth0, nothing on lo."""
    for t in range(0, 401, 10):
        b.sample("proc.read_bytes", t, t * 100_000)
        b.sample("proc.read_chars", t, t * 300_000)
        b.sample("net.eth0.recv_bytes", t, t * 50_000, cat="net")
        b.sample("net.lo.recv_bytes", t, 7.0, cat="net")
    return b


PROBE = {"results": {"disk_read": {"status": "ok", "bytes_per_s": 5e8},
                     "cache_read": {"status": "ok", "bytes_per_s": 4e9}}}


def test_bandwidth_over_time_splits_disk_and_page_cache(tmp_path):
    b = with_counters(ddp_iterations(Builder(), CASE2_UNITS, n=4))
    a = analyze(load(b.write(tmp_path / "t.arrow", probe=PROBE)), detail=True)
    series = {s.name: s for s in a.main.detail.bandwidth}
    assert list(series) == ["disk", "cache", "net.eth0.recv_bytes"]
    assert series["disk"].bytes_per_s == pytest.approx([100e6] * series["disk"].t_s.size)
    assert series["cache"].bytes_per_s == pytest.approx([200e6] * series["cache"].t_s.size)
    assert series["net.eth0.recv_bytes"].bytes_per_s.mean() == pytest.approx(50e6)
    assert series["disk"].t_s[-1] < 0.400
    assert [s.peak_bytes_per_s for s in series.values()] == [5e8, 4e9, None]


# -- the page ----------------------------------------------------------------------------


class _Resources(html.parser.HTMLParser):
    """What a page would load from elsewhere, and its section and link targets."""

    def __init__(self) -> None:
        super().__init__()
        self.external: list[str] = []
        self.ids: set[str] = set()
        self.links: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if "id" in a:
            self.ids.add(a["id"])
        if "src" in a or tag == "link":
            self.external.append(f"<{tag} {attrs}>")
        href = a.get("href")
        if href is not None:
            if not href.startswith("#"):
                self.external.append(f"<{tag} href={href}>")
            self.links.append(href[1:])


def page_data_bytes(page: str) -> int:
    """The page less the inline Vega bundle: what grows with the trace."""
    start = page.index("<script>/* Vega")
    end = page.index("</script>", start)
    return len(page.encode()) - (end - start)


def test_page_is_self_contained_and_links_each_finding_to_its_chart(tmp_path):
    b = ddp_iterations(Builder(), CASE2_UNITS, update=(92, 98), n=8)
    a = analyze(load(b.write(tmp_path / "t.arrow", world_size=2)), skip=1, detail=True)
    page = report_html.render(a, None, report_html.vega_script(), "t.arrow")
    p = _Resources()
    p.feed(page)
    assert p.external == []          # no <script src>, <link>, <img src>: nothing to fetch
    charts = {"breakdown", "timeline", "ranks", "speedup", "what-if"}
    assert charts <= p.ids and {f"vis-{c}" for c in charts} <= p.ids
    assert set(p.links) <= p.ids
    ids = [f.id for f in a.main.findings]
    assert "comm_exposed" in ids
    assert 'data-finding="comm_exposed"' in page and \
        page.split('data-finding="comm_exposed"')[1].split("</li>")[0].count('href="#timeline"')
    assert "Comm per rank, waiting vs transferring: needs comm units that two" in page


def test_page_does_not_grow_with_events(tmp_path):
    sizes = []
    for kernels in (300, 15000):     # 50x the events, the same iterations and streams
        path = gpu_iterations(Builder(), kernels).write(tmp_path / f"k{kernels}.arrow")
        a = analyze(load(path), detail=True)
        sizes.append(page_data_bytes(report_html.render(a, None, "", str(path))))
    assert sizes[1] <= sizes[0] * 1.1, sizes


def test_report_command_errors_are_one_line(tmp_path):
    trace = ddp_iterations(Builder(), CASE2_UNITS).write(tmp_path / "t.arrow")
    for args, says in (
            (["report", str(tmp_path / "missing.arrow"), "-o", str(tmp_path / "r.html")],
             "missing.arrow"),
            (["report", str(trace), "-o", str(tmp_path / "no" / "r.html")], "does not exist"),
            (["report", str(trace), "-o", str(tmp_path)], "is a directory"),
            (["report", str(trace), "--rank", "7", "-o", str(tmp_path / "r.html")], "no rank 7"),
    ):
        p = run_gputrace(*args)
        assert p.returncode == 2, (args, p.stderr)
        assert len(p.stderr.strip().splitlines()) == 1 and says in p.stderr, p.stderr
    assert not (tmp_path / "r.html").exists()


def test_without_the_report_extra_the_commands_say_what_to_install(tmp_path):
    trace = ddp_iterations(Builder(), CASE2_UNITS).write(tmp_path / "t.arrow")
    for args in (["report", str(trace), "-o", str(tmp_path / "r.html")],
                 ["analyze", str(trace), "--report", str(tmp_path / "r.html")],
                 ["record", "-o", str(tmp_path / "x.arrow"), "--report",
                  str(tmp_path / "r.html"), "--", sys.executable, "-c", "pass"]):
        code = ("import sys; sys.modules['vl_convert'] = None\n"   # as if not installed
                "from gputrace.cli import main; raise SystemExit(main(sys.argv[1:]))")
        import subprocess

        p = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 2, p.stderr
        assert p.stderr.strip().splitlines() == [
            "gputrace: error: the HTML report needs the report extra: "
            "pip install 'gputrace[report]'"]
    assert not (tmp_path / "r.html").exists() and not (tmp_path / "x.arrow").exists()


# -- in a real browser ---------------------------------------------------------------------


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed (pip install -e '.[dev]')")
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(f"{CHROMIUM} is missing and could not be installed here: `make test` "
                    "installs Debian's chromium when run as root (apt-get install chromium)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield b
        b.close()


CHART_STATE = """() => Object.fromEntries(Object.entries(window.gputraceViews).map(([id, v]) => {
  const svg = document.querySelector('#vis-' + id + ' svg');
  const box = svg ? svg.getBoundingClientRect() : {width: 0, height: 0};
  const items = {};
  if (svg) svg.querySelectorAll('g.role-mark').forEach(g => {
    const k = g.classList[2];
    items[k] = (items[k] || 0) + g.querySelectorAll('path, line').length; });
  const domain = n => { try { return v.scale(n).domain(); } catch (e) { return null; } };
  return [id, {width: box.width, height: box.height, items: items, colour: domain('color'),
               y: domain('y'), dash: domain('strokeDash')}];
}))"""


def open_in_browser(browser, page_path: Path, shots: Path) -> tuple[dict, object]:
    """Open the page from its file; assert it fetched nothing and logged no error or warning;
    save a screenshot of the page and of each chart. Returns each chart's drawn state."""
    page = browser.new_page(viewport={"width": 1100, "height": 900})
    requests, console, errors = [], [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("console", lambda m: console.append(f"{m.type}: {m.text}"))
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.route("**/*", lambda route: route.continue_() if route.request.url.startswith(
        "file://") else route.abort())
    page.goto(page_path.as_uri())
    page.wait_for_selector("body[data-rendered]", timeout=60_000)
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / "page.png"), full_page=True)
    for section in page.query_selector_all("section.chart"):
        section.screenshot(path=str(shots / f"{section.get_attribute('id')}.png"))
    print(f"screenshots of {page_path.name}: {shots}")
    assert errors == [] and [c for c in console if c.startswith(("error", "warning"))] == []
    assert requests == [page_path.as_uri()]          # the page itself, nothing else
    sections = page.eval_on_selector_all("section.chart", "s => s.map(x => x.id)")
    assert page.evaluate("document.body.dataset.rendered") == str(len(sections))
    state = page.evaluate(CHART_STATE)
    assert sorted(state) == sorted(sections)
    for cid, s in state.items():       # every chart drew something of its own
        assert s["width"] > 100 and s["height"] > 40 and sum(s["items"].values()) > 0, cid
    targets = page.eval_on_selector_all(
        "li[data-finding] a", "as => as.map(a => document.getElementById("
        "a.getAttribute('href').slice(1)) !== null)")
    assert all(targets)
    return state, page


def torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
            "2", str(ROOT / "samples" / "train_cnn.py"), *args]


@pytest.mark.slow
def test_recorded_run_report_in_chromium(browser, tmp_path):
    pytest.importorskip("torch")
    trace, page_path = tmp_path / "run.arrow", tmp_path / "run.html"
    p = run_gputrace("record", "-o", str(trace), "--report", str(page_path), "--",
                     *torchrun("--preset", "case2", "--iterations", "8", "--data",
                               str(tmp_path / "data")), timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert f"report: {page_path} (" in p.stderr and page_path.stat().st_size < 3e6
    again = run_gputrace("analyze", str(trace), "--json", "--report",
                         str(tmp_path / "again.html"), check=True)
    doc = json.loads(again.stdout)          # stdout stays the JSON; the path goes to stderr
    assert f"report: {tmp_path / 'again.html'} (" in again.stderr
    state, page = open_in_browser(browser, page_path, tmp_path / "shots")
    # the what-if replay is withheld, with its reason, where its replay of the run itself
    # missed it by over 5 % (a loaded machine): then no chart of it
    replayed = doc["what_if"] is not None
    assert replayed or doc["what_if_unavailable"]
    assert sorted(state) == sorted(["breakdown", "timeline", "ranks", "comm-wait", "bandwidth",
                                    "speedup", "memory", "flops"] + ["what-if"] * replayed
                                   + ["goodput"] * (doc["goodput"] is not None))
    assert doc["goodput"] is not None      # a recorded run: the process's start to its end
    n = doc["iterations"]["count"]
    bd = state["breakdown"]
    assert bd["colour"] == STACK and bd["items"] == {"layer_0_marks": 7 * n, "layer_1_marks": n}
    tl = state["timeline"]
    units = doc["units"]
    layers = {ly for u in units for ly in u["layers"]}
    assert tl["y"][0] == "host"
    assert {f"unit {u['index']}" for u in units} <= set(tl["y"])
    # a lane per layer, named by its number, then its module path and class where known
    lanes = {y.split(" ")[1] for y in tl["y"] if y.startswith("layer ")}
    assert {str(ly) for ly in layers} <= lanes, tl["y"]
    assert {"forward", "backward"} <= set(tl["colour"])
    assert {"comm hidden", "comm exposed"} & set(tl["colour"])
    counts = [doc["ranks"][r]["iterations"]["count"] for r in doc["ranks"]]
    assert state["ranks"]["items"] == {"marks": sum(counts)} and state["ranks"]["y"] == [0, 1]
    cw = state["comm-wait"]
    assert cw["colour"] == ["waiting for peers", "transferring"] and cw["items"]["marks"] == 4
    assert {"disk", "cache"} <= set(state["bandwidth"]["colour"])
    sp = state["speedup"]
    # the replay's GPU counts as measured (buckets and link as run), those not withheld
    gpus = [s for s in (doc["what_if"] or {}).get("scenarios", [])
            if s["bucket_rule"] == "measured" and s["bandwidth_x"] == 1 and not s["withheld"]]
    assert sp["colour"] == [f"model (eq. {doc['speedup']['equation']})"] + \
        ["replay"] * bool(gpus) + ["ideal"]
    points = sum(not p["withheld"] for p in doc["speedup"]["points"])
    assert sp["items"]["concat_0_layer_1_marks"] == 2 * points + len(gpus)  # a point each
    if replayed:
        wi = state["what-if"]
        # a row withheld (its reason in the JSON and the terminal) has no bar
        shown = [s for s in doc["what_if"]["scenarios"] if not s["withheld"]]
        assert wi["items"] == {"layer_0_marks": len(shown),   # a bar, an interval where known
                               "layer_1_marks": sum(s["t_iter_low"] is not None for s in shown),
                               "layer_2_marks": 1}
        assert any(s["t_iter_low"] is not None for s in shown)
    # a tooltip names what a bar is
    page.hover("#vis-timeline g.layer_0_marks path >> nth=0")
    assert page.wait_for_selector("#vg-tooltip-element.visible", timeout=5000)
    page.close()


@pytest.mark.slow
@pytest.mark.parametrize("source", ["kineto/two_rank", "nsys/mfu_2gpu_before.sqlite"])
def test_imported_trace_report_in_chromium(browser, shared_data, tmp_path, source):
    page_path = tmp_path / "imported.html"
    run_gputrace("report", str(shared_data / source), "-o", str(page_path), check=True)
    state, page = open_in_browser(browser, page_path, tmp_path / "shots")
    assert {"breakdown", "timeline", "ranks"} <= set(state)
    # a speedup chart where the analysis predicts one (the nsys window runs forward only:
    # no backward measured, no speedup made up)
    doc = json.loads(run_gputrace("analyze", str(shared_data / source), "--json",
                                  check=True).stdout)
    assert ("speedup" in state) == bool(doc["speedup"]["points"])
    gpu_lanes = [lane for lane in state["timeline"]["y"] if lane.startswith("GPU ")]
    assert gpu_lanes, state["timeline"]["y"]           # kernels and copies per stream
    assert {"kernel", "comm", "memcpy", "forward", "backward"} & set(
        state["timeline"]["colour"])
    page.close()


def test_probed_peaks_beside_links_without_one_in_chromium(browser, tmp_path):
    b = with_counters(ddp_iterations(Builder(), CASE2_UNITS, n=4))
    path = b.write(tmp_path / "t.arrow", probe=PROBE)
    page_path = tmp_path / "t.html"
    run_gputrace("report", str(path), "-o", str(page_path), check=True)
    state, page = open_in_browser(browser, page_path, tmp_path / "shots")
    bw = state["bandwidth"]
    assert bw["colour"] == ["disk", "cache", "net.eth0.recv_bytes"]
    assert bw["dash"] == ["achieved", "probed peak"]
    # achieved and peak lines of disk and cache in one panel, eth0 alone in the other
    assert sum(n for k, n in bw["items"].items() if "layer_0" in k) == 5
    page.close()
