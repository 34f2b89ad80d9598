// Real-browser test of the built web bundle: headless Chromium (Debian's /usr/bin/chromium driven
// by playwright-core) loads the page, a fixture file is opened through the file picker, a parameter
// is clicked in the shard map with a real mouse click, and the shown text and a screenshot are
// checked. Then a torch-written DCP checkpoint (tests/fixtures/formats/dcp_torch_save: `.metadata`
// and two `.distcp` files, picked together) is opened, a key is clicked in the checkpoint table and
// the shown key and chunk counts are checked against torch's own metadata dump
// (tests/fixtures/formats/expected/dcp_torch_save_metadata.json, written by gen_formats.py).
//
// node web/tests/browser_test.mjs [DIST_DIR] [SCREENSHOT_DIR]   (defaults: dist/web, docs/img)
import { spawn } from "node:child_process";
import { mkdirSync, readFileSync } from "node:fs";
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

const port = await freePort();
const server = spawn("python3", [path.join(here, "serve.py"), String(port), dist], { stdio: "inherit" });
let browser;
try {
  await waitFor(async () => {
    try { return (await fetch(`http://127.0.0.1:${port}/index.html`)).ok; } catch { return false; }
  }, "the static server");

  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking",
      "--disable-component-update", "--disable-sync", "--no-first-run", "--use-gl=angle",
      "--use-angle=swiftshader", "--enable-unsafe-swiftshader"],
  });
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
  console.log("PASS: browser test");
} finally {
  if (browser) await browser.close();
  server.kill();
}
