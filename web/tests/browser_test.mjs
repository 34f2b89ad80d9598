// Real-browser test of the built web bundle: headless Chromium (Debian's /usr/bin/chromium driven
// by playwright-core) loads the page, a fixture file is opened through the file picker, a parameter
// is clicked in the shard map with a real mouse click, and the shown text and a screenshot are
// checked. Then a torch-written DCP checkpoint (tests/fixtures/formats/dcp_torch_save: `.metadata`
// and two `.distcp` files, picked together) is opened, a key is clicked in the checkpoint table and
// the shown key and chunk counts are checked against torch's own metadata dump
// (tests/fixtures/formats/expected/dcp_torch_save_metadata.json, written by gen_formats.py).
// Then a sparse 20 GiB copy of that DCP (each `.distcp` grown to 10 GiB with truncate; its byte
// ranges still point into the start) is opened through the picker in a fresh browser: it must open
// within a time limit with the entry count torch wrote, while the renderer's resident memory grows
// by less than 512 MiB; the same checkpoint opens by URL (`?url=`, Range requests to serve.py); a
// DCP with a broken `.metadata` shows an error on the page. The sparse files live in a temporary
// folder that is removed at the end.
//
// node web/tests/browser_test.mjs [DIST_DIR] [SCREENSHOT_DIR]   (defaults: dist/web, docs/img)
import { spawn } from "node:child_process";
import {
  copyFileSync, mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, symlinkSync, truncateSync,
  writeFileSync,
} from "node:fs";
import os from "node:os";
import { createRequire } from "node:module";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";

const require = createRequire(import.meta.url);
const { chromium } = require("playwright-core");

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "../..");
const dist = path.resolve(root, process.argv[2] ?? "dist/web");
const shots = path.resolve(root, process.argv[3] ?? "docs/img");
const fixture = path.join(root, "viewer/tests/fixtures/spec_example_a.json");
mkdirSync(shots, { recursive: true });

function fail(msg) {
  console.error(`FAIL: ${msg}`);
  process.exitCode = 1;
  throw new Error(msg);
}

async function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function waitFor(fn, what, timeoutMs = 30000) {
  const t0 = Date.now();
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() - t0 > timeoutMs) fail(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 100));
  }
}

// Counts pixels that differ between two PNG screenshots inside a region, and distinct colours,
// decoding them in the page (no image library needed).
async function compare(page, a, b, region) {
  return page.evaluate(async ({ a, b, region }) => {
    const load = async (b64) => {
      const img = new Image();
      img.src = "data:image/png;base64," + b64;
      await img.decode();
      const c = new OffscreenCanvas(img.width, img.height);
      const g = c.getContext("2d");
      g.drawImage(img, 0, 0);
      return g.getImageData(region.x, region.y, region.w, region.h).data;
    };
    const da = await load(a);
    const db = await load(b);
    let diff = 0;
    const colours = new Set();
    for (let i = 0; i < da.length; i += 4) {
      if (Math.abs(da[i] - db[i]) + Math.abs(da[i + 1] - db[i + 1]) + Math.abs(da[i + 2] - db[i + 2]) > 30) diff++;
      colours.add((db[i] << 16) | (db[i + 1] << 8) | db[i + 2]);
    }
    return { diff, colours: colours.size };
  }, { a: a.toString("base64"), b: b.toString("base64"), region });
}

// Opens the torch-written DCP fixture (all three files in one pick, so they form one checkpoint),
// clicks a key's row in the checkpoint table and checks the status line against torch's metadata.
async function checkpointTest(browser, port) {
  const dir = path.join(root, "tests/fixtures/formats/dcp_torch_save");
  const expected = JSON.parse(readFileSync(
    path.join(root, "tests/fixtures/formats/expected/dcp_torch_save_metadata.json"), "utf8"));
  const key = "model.embed.weight";
  const want = expected.items[key];
  if (!want || !want.chunks) fail(`${key} is not a tensor in torch's metadata`);
  const page = await browser.newPage({ viewport: { width: 1400, height: 860 }, deviceScaleFactor: 1 });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
  await page.goto(`http://127.0.0.1:${port}/index.html?empty`);
  await waitFor(() => page.evaluate(() => document.body.dataset.ready === "1"), "the viewer to start");
  await page.setInputFiles("#files", [".metadata", "__0_0.distcp", "__1_0.distcp"].map((f) => path.join(dir, f)));
  const opened = await waitFor(async () => {
    const s = await page.textContent("#status");
    return s.includes("checkpoint ") && s.includes(" entries") ? s : null;
  }, "the checkpoint to open");
  console.log(`status after opening the checkpoint: ${opened}`);
  const entries = Object.keys(expected.items).length;
  // One checkpoint of all three files (one batch), holding every item torch wrote.
  if (!opened.includes(`${entries} entries`)) fail(`expected ${entries} entries: ${opened}`);
  // Tensor items have their chunk lists; every bytes item is stored once.
  const chunks = Object.values(expected.items).reduce((n, it) => n + (it.chunks ? it.chunks.length : 1), 0);
  if (!opened.includes(` ${chunks} chunks`)) fail(`torch wrote ${chunks} chunks in all: ${opened}`);
  if (!opened.includes("2 ranks")) fail(`expected 2 ranks (two .distcp files): ${opened}`);

  const canvasBox = await page.locator("#viewer").boundingBox();
  await page.waitForTimeout(300);
  const before = await page.screenshot();
  await page.evaluate((k) => window.shardscope.probe(k), key);
  const at = await waitFor(async () => {
    const r = await page.evaluate(() => Array.from(window.shardscope.probe_result()));
    return r.length === 2 ? r : null;
  }, `the row of ${key} to be on screen`);
  await page.mouse.move(canvasBox.x + at[0], canvasBox.y + at[1]);
  await page.waitForTimeout(100);
  await page.mouse.down();
  await page.mouse.up();
  const selected = await waitFor(async () => {
    const s = await page.textContent("#status");
    return s.includes(`selected: ${key} (`) ? s : null;
  }, `${key} to be selected`, 10000);
  console.log(`status after click: ${selected}`);
  const m = selected.match(/selected: \S+ \((\d+) chunks\)/);
  if (!m || Number(m[1]) !== want.chunks.length) {
    fail(`${key}: torch wrote ${want.chunks.length} chunks, the viewer shows: ${selected}`);
  }
  await page.mouse.move(canvasBox.x + 5, canvasBox.y + canvasBox.height - 5);
  await page.waitForTimeout(400);
  const after = await page.screenshot({ path: path.join(shots, "web_checkpoint.png") });
  const whole = await compare(page, before, after, { x: 0, y: 0, w: 1400, h: 860 });
  console.log(`checkpoint screenshot: ${whole.colours} colours, ${whole.diff} pixels changed by the click`);
  if (whole.colours < 50) fail(`the checkpoint screenshot looks blank (${whole.colours} colours)`);
  if (whole.diff < 500) fail("nothing changed on screen after clicking the key");
  if (errors.length) fail(`page errors: ${errors.join("\n")}`);
  await page.close();
}

// Renderer processes under a process (this script: its only browser is the one measured):
// pid -> { rss, hwm } in bytes (from /proc).
function renderers(rootPid) {
  const parent = new Map();
  const out = new Map();
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const stat = readFileSync(`/proc/${d}/stat`, "utf8");
      parent.set(Number(d), Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]));
    } catch { /* gone */ }
  }
  const descends = (pid) => {
    for (let p = pid, n = 0; p > 1 && n < 64; p = parent.get(p) ?? 0, n++) if (p === rootPid) return true;
    return false;
  };
  for (const pid of parent.keys()) {
    if (!descends(pid)) continue;
    try {
      if (!readFileSync(`/proc/${pid}/cmdline`, "utf8").includes("--type=renderer")) continue;
      const st = readFileSync(`/proc/${pid}/status`, "utf8");
      const kb = (k) => Number((st.match(new RegExp(`^${k}:\\s+(\\d+) kB`, "m")) ?? [0, 0])[1]) * 1024;
      out.set(pid, { rss: kb("VmRSS"), hwm: kb("VmHWM") });
    } catch { /* gone */ }
  }
  return out;
}

const MiB = 1048576;

// The sparse 20 GiB DCP: torch's fixture with each .distcp grown to 10 GiB (sparse: no disk used).
function makeLargeCheckpoints(dir) {
  const src = path.join(root, "tests/fixtures/formats/dcp_torch_save");
  const files = [".metadata", "__0_0.distcp", "__1_0.distcp"];
  for (const sub of ["big", "broken"]) {
    mkdirSync(path.join(dir, sub));
    for (const f of files) copyFileSync(path.join(src, f), path.join(dir, sub, f));
    for (const f of files.slice(1)) truncateSync(path.join(dir, sub, f), 10 * 1024 * MiB);
  }
  // A .metadata cut in half: the page must say what is wrong.
  const meta = readFileSync(path.join(src, ".metadata"));
  writeFileSync(path.join(dir, "broken/.metadata"), meta.subarray(0, meta.length >> 1));
  // A sparse 10 GiB safetensors file (one F32 tensor): only its header may be read.
  const header = Buffer.from(JSON.stringify({
    big: { dtype: "F32", shape: [2684354560], data_offsets: [0, 10 * 1024 * MiB] },
  }).padEnd(104, " "));
  const len = Buffer.alloc(8);
  len.writeBigUInt64LE(BigInt(header.length));
  writeFileSync(path.join(dir, "big.safetensors"), Buffer.concat([len, header]));
  truncateSync(path.join(dir, "big.safetensors"), 8 + header.length + 10 * 1024 * MiB);
  // HF sharded safetensors, opened by the URL of its index.
  const hf = path.join(root, "tests/fixtures/formats/hf_sharded");
  mkdirSync(path.join(dir, "hf"));
  for (const f of readdirSync(hf)) copyFileSync(path.join(hf, f), path.join(dir, "hf", f));
  for (const f of readdirSync(dist)) symlinkSync(path.join(dist, f), path.join(dir, f));
  return files;
}

async function waitStatus(page, pred, what, timeoutMs) {
  return waitFor(async () => {
    const s = await page.textContent("#status");
    return pred(s) ? s : null;
  }, what, timeoutMs);
}

// Opens the sparse 20 GiB DCP through the picker and by URL, and a broken one, in a fresh browser
// (one page, so one renderer to measure).
async function largeTest(launch) {
  const expected = JSON.parse(readFileSync(
    path.join(root, "tests/fixtures/formats/expected/dcp_torch_save_metadata.json"), "utf8"));
  const entries = Object.keys(expected.items).length;
  const tmp = mkdtempSync(path.join(os.tmpdir(), "shardscope-web-"));
  let server2;
  let browser2;
  try {
    const files = makeLargeCheckpoints(tmp);
    const port2 = await freePort();
    server2 = spawn("python3", [path.join(here, "serve.py"), String(port2), tmp], { stdio: "inherit" });
    await waitFor(async () => {
      try { return (await fetch(`http://127.0.0.1:${port2}/index.html`)).ok; } catch { return false; }
    }, "the static server for the large checkpoint");
    browser2 = await launch();
    const page = await browser2.newPage({ viewport: { width: 1400, height: 860 }, deviceScaleFactor: 1 });
    const errors = [];
    page.on("pageerror", (e) => errors.push(String(e)));
    await page.goto(`http://127.0.0.1:${port2}/index.html?empty`);
    await waitFor(() => page.evaluate(() => document.body.dataset.ready === "1"), "the viewer to start");
    await waitStatus(page, (s) => s.includes("no model"), "the empty status", 30000);
    await page.waitForTimeout(500);
    const pid = process.pid; // the first browser is closed: every renderer below is browser2's
    const before = renderers(pid);
    if (before.size === 0) fail("no renderer process found under the browser");
    // Ours is the renderer holding the viewer (the largest); its peak is reset where Linux lets us.
    const [rpid, base] = [...before.entries()].sort((a, b) => b[1].rss - a[1].rss)[0];
    try { writeFileSync(`/proc/${rpid}/clear_refs`, "5"); } catch { /* peak stays from load */ }
    const baseline = Math.min(base.rss, renderers(pid).get(rpid)?.rss ?? base.rss);

    const t0 = Date.now();
    await page.setInputFiles("#files", files.map((f) => path.join(tmp, "big", f)));
    const opened = await waitStatus(page, (s) => s.includes(" entries") || s.includes("error"),
      "the 20 GiB checkpoint to open", 60000);
    const seconds = (Date.now() - t0) / 1000;
    console.log(`20 GiB sparse DCP: ${opened} (${seconds.toFixed(2)} s)`);
    if (!opened.includes(`${entries} entries`)) fail(`expected ${entries} entries (torch's metadata): ${opened}`);
    if (!opened.includes("2 ranks")) fail(`expected 2 ranks: ${opened}`);
    if (seconds > 30) fail(`opening took ${seconds.toFixed(1)} s (limit 30 s)`);
    await page.waitForTimeout(500);
    const after = renderers(pid).get(rpid);
    if (!after) fail("the renderer went away");
    const growth = Math.max(after.hwm, after.rss) - baseline;
    const heap = await page.evaluate(() => ({
      wasm: window.shardscopeMemory ? window.shardscopeMemory.buffer.byteLength : 0,
      js: performance.memory ? performance.memory.usedJSHeapSize : 0,
    }));
    console.log(`renderer ${rpid}: resident ${(baseline / MiB).toFixed(0)} MiB before, ` +
      `${(after.rss / MiB).toFixed(0)} MiB after, peak ${(after.hwm / MiB).toFixed(0)} MiB: ` +
      `grew ${(growth / MiB).toFixed(0)} MiB; wasm memory ${(heap.wasm / MiB).toFixed(0)} MiB, ` +
      `JS heap ${(heap.js / MiB).toFixed(0)} MiB`);
    if (growth >= 512 * MiB) fail(`the renderer grew by ${(growth / MiB).toFixed(0)} MiB (limit 512)`);

    // A broken .metadata: an error on the page naming the file, not a hang.
    await page.setInputFiles("#files", files.map((f) => path.join(tmp, "broken", f)));
    const broken = await waitStatus(page, (s) => s.includes("error:"), "the error of the broken DCP", 60000);
    console.log(`broken DCP: ${broken}`);
    if (!broken.includes(".metadata")) fail(`the error does not name .metadata: ${broken}`);

    // By URL: the same DCP folder, read with Range requests.
    const t1 = Date.now();
    await page.goto(`http://127.0.0.1:${port2}/index.html?url=big/`);
    const byUrl = await waitStatus(page, (s) => s.includes(" entries") || s.includes("error:"),
      "the DCP to open by URL", 60000);
    console.log(`by URL: ${byUrl} (${((Date.now() - t1) / 1000).toFixed(2)} s)`);
    if (!byUrl.includes(`${entries} entries`)) fail(`expected ${entries} entries by URL: ${byUrl}`);
    await page.goto(`http://127.0.0.1:${port2}/index.html?url=missing/`);
    const missing = await waitStatus(page, (s) => s.includes("error:"), "the error of a missing URL", 60000);
    console.log(`missing URL: ${missing}`);
    if (!missing.includes("404")) fail(`a missing .metadata should say 404: ${missing}`);
    // Other formats, lazily too: HF sharded safetensors by the URL of its index, a torch.save
    // file through the picker; entry counts from the generator's dumps of what torch wrote.
    const want = (f) => Object.keys(JSON.parse(readFileSync(
      path.join(root, "tests/fixtures/formats/expected", f), "utf8")).entries).length;
    await page.goto(`http://127.0.0.1:${port2}/index.html?url=hf/model.safetensors.index.json`);
    const hfStatus = await waitStatus(page, (s) => s.includes(" entries") || s.includes("error:"),
      "the HF checkpoint to open by URL", 60000);
    console.log(`HF index by URL: ${hfStatus}`);
    if (!hfStatus.includes(`${want("hf_sharded.json")} entries`)) fail(`HF index by URL: ${hfStatus}`);
    await page.goto(`http://127.0.0.1:${port2}/index.html?empty`);
    await waitFor(() => page.evaluate(() => document.body.dataset.ready === "1"), "the viewer to start");
    await page.setInputFiles("#files", path.join(root, "tests/fixtures/formats/plain/state_dict.pt"));
    const pt = await waitStatus(page, (s) => s.includes(" entries") || s.includes("error:"),
      "the torch.save file to open", 60000);
    console.log(`torch.save file: ${pt}`);
    if (!pt.includes(`${want("plain__state_dict.json")} entries`)) fail(`torch.save file: ${pt}`);
    await page.setInputFiles("#files", path.join(tmp, "big.safetensors"));
    const st = await waitStatus(page, (s) => (s.includes("checkpoint big.safetensors: ") && !s.includes("indexing")) || s.includes("error:"),
      "the 10 GiB safetensors file to open", 60000);
    console.log(`10 GiB sparse safetensors: ${st}`);
    if (!st.includes("1 entries")) fail(`10 GiB safetensors: ${st}`);
    if (errors.length) fail(`page errors: ${errors.join("\n")}`);
    console.log("PASS: browser test, 20 GiB sparse DCP (picker, URL, broken file), HF index by URL, " +
      "torch.save, 10 GiB safetensors");
  } finally {
    if (browser2) await browser2.close();
    if (server2) server2.kill();
    rmSync(tmp, { recursive: true, force: true });
  }
}

const port = await freePort();
const server = spawn("python3", [path.join(here, "serve.py"), String(port), dist], { stdio: "inherit" });
let browser;
try {
  await waitFor(async () => {
    try { return (await fetch(`http://127.0.0.1:${port}/index.html`)).ok; } catch { return false; }
  }, "the static server");

  const launch = () => chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
      "--disable-component-update", "--disable-sync", "--no-first-run", "--use-gl=angle",
      "--use-angle=swiftshader", "--enable-unsafe-swiftshader", "--enable-precise-memory-info"],
  });
  browser = await launch();
  const page = await browser.newPage({ viewport: { width: 1400, height: 860 }, deviceScaleFactor: 1 });
  const errors = [];
  page.on("pageerror", (e) => errors.push(String(e)));
  page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });

  await page.goto(`http://127.0.0.1:${port}/index.html?empty`);
  await waitFor(() => page.evaluate(() => document.body.dataset.ready === "1"), "the viewer to start");
  await waitFor(async () => (await page.textContent("#status")).includes("no model"), "the empty status");

  // Open the fixture through the file picker.
  await page.setInputFiles("#files", fixture);
  const loaded = await waitFor(async () => {
    const s = await page.textContent("#status");
    return s.includes("spec_example_a.json") && s.includes("FSDP1") ? s : null;
  }, "the fixture to load");
  console.log(`status after open: ${loaded}`);
  // Default controls: FSDP1, 4 ranks, use_orig_params: 1 unit; a on ranks 0-1, b on 2-3, and
  // 2 alignment-padding runs (spec §1.6 example A) -> 4 parameter chunks + 2 padding chunks.
  if (!loaded.includes("1 units · 6 chunks")) fail(`unexpected layout summary: ${loaded}`);

  const canvasBox = await page.locator("#viewer").boundingBox();
  await page.waitForTimeout(300);
  const before = await page.screenshot();

  // Find where `b` is drawn and click it with the mouse.
  await page.evaluate(() => window.shardscope.probe("b"));
  const at = await waitFor(async () => {
    const r = await page.evaluate(() => Array.from(window.shardscope.probe_result()));
    return r.length === 2 ? r : null;
  }, "the slice of b to be on screen");
  const x = canvasBox.x + at[0];
  const y = canvasBox.y + at[1];
  await page.mouse.move(x, y);
  await page.waitForTimeout(100);
  await page.mouse.down();
  await page.mouse.up();
  const selected = await waitFor(async () => {
    const s = await page.textContent("#status");
    return s.includes("selected: b") ? s : null;
  }, "b to be selected", 10000);
  console.log(`status after click: ${selected}`);
  if ((await page.evaluate(() => window.shardscope.selected_fqn())) !== "b") fail("selected_fqn is not b");

  await page.mouse.move(canvasBox.x + 5, canvasBox.y + canvasBox.height - 5); // hide the tooltip
  await page.waitForTimeout(400);
  const after = await page.screenshot({ path: path.join(shots, "web.png") });

  // The inspector (right panel) now shows b's details and chunk map; the shard map outlines it.
  const inspector = { x: 1400 - 330, y: 60, w: 320, h: 400 };
  const cmp = await compare(page, before, after, inspector);
  console.log(`inspector region: ${cmp.diff} pixels changed, ${cmp.colours} colours`);
  if (cmp.diff < 2000) fail("the inspector did not change after the click");
  const whole = await compare(page, before, after, { x: 0, y: 0, w: 1400, h: 860 });
  if (whole.colours < 50) fail(`the screenshot looks blank (${whole.colours} colours)`);
  if (errors.length) fail(`page errors: ${errors.join("\n")}`);
  console.log(`PASS: browser test, layout (screenshot ${path.join(shots, "web.png")})`);
  await checkpointTest(browser, port);
  if (errors.length) fail(`page errors: ${errors.join("\n")}`);
  await browser.close();
  browser = undefined;
  await largeTest(launch);
  console.log("PASS: browser test");
} finally {
  if (browser) await browser.close();
  server.kill();
}
