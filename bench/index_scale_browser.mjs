// Benchmark: opening the DCPs of bench/index_scale.py in the browser viewer (issue 22 item 6, the
// browser side): headless Chromium (Debian's, through playwright-core) picks every file of the
// checkpoint (`.metadata` and the 512 sparse `.distcp` files) through the page's file input, as a
// user would; the time runs from `setInputFiles` until the status line shows the entry count, and
// memory is the renderer's resident set from /proc (peak `VmHWM`, reset with `clear_refs` before
// opening, minus the resident set before). The first open of each checkpoint is a warm-up (the
// picked files are read into the page cache); the figures are the median of the runs after it.
// `page_open_s` is the page's own time, from the file input's change event to the entries shown
// (without Chromium's handling of the 513 picked files). Each checkpoint is opened each way the
// page can read it (`--ways`): "suspending" (JSPI: the `.metadata` read window by window during
// indexing, never whole) and "rounds" (read whole between indexing rounds, held in JS). The way
// "floor" is the baseline of the same run: a blank page that only does the file work every open
// needs (the size of each picked file, the first 4 KiB of each `.distcp`, the `.metadata` streamed
// front to back and dropped), no parsing; its page time is what Chromium's file handling costs.
//
// usage: node bench/index_scale_browser.mjs DIST CKPT_DIR [CKPT_DIR ...] [--runs N] [--ways W,W]
//   DIST: a built viewer (web/build.sh DIST); CKPT_DIR: e.g. /tmp/index-scale/dcp-1000000
//   (bench/index_scale.py --build-only writes them). Needs web/tests/node_modules
//   (npm install --prefix web/tests) and /usr/bin/chromium (or $CHROMIUM).
// Prints one JSON line per checkpoint and way. See BENCHMARKS.md.

import { spawn } from "node:child_process";
import { readdirSync, readFileSync, writeFileSync } from "node:fs";
import { createRequire } from "node:module";
import net from "node:net";
import path from "node:path";
import { fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(here, "..");
const require = createRequire(path.join(root, "web/tests/browser_test.mjs"));
const { chromium } = require("playwright-core");

const args = process.argv.slice(2);
let runs = 3;
const at = args.indexOf("--runs");
if (at >= 0) {
  runs = Number(args[at + 1]);
  args.splice(at, 2);
}
// How the page reads: "suspending" (the default where the browser has JSPI: a large `.metadata`
// read window by window during the indexing step) and/or "rounds" (read whole between rounds).
let ways = ["suspending", "rounds", "floor"];
const wat = args.indexOf("--ways");
if (wat >= 0) {
  ways = args[wat + 1].split(",");
  args.splice(wat, 2);
}
const [dist, ...checkpoints] = args;
if (!dist || checkpoints.length === 0) {
  console.error("usage: node bench/index_scale_browser.mjs DIST CKPT_DIR [CKPT_DIR ...] [--runs N] [--ways suspending,rounds,floor]");
  process.exit(2);
}
const MiB = 1048576;

function freePort() {
  return new Promise((resolve) => {
    const s = net.createServer();
    s.listen(0, "127.0.0.1", () => {
      const { port } = s.address();
      s.close(() => resolve(port));
    });
  });
}

async function waitFor(fn, what, timeoutMs) {
  const t0 = Date.now();
  for (;;) {
    const v = await fn();
    if (v) return v;
    if (Date.now() - t0 > timeoutMs) throw new Error(`timed out waiting for ${what}`);
    await new Promise((r) => setTimeout(r, 20));
  }
}

// Resident and peak bytes of each renderer process under this process.
function renderers() {
  const parent = new Map();
  for (const d of readdirSync("/proc")) {
    if (!/^\d+$/.test(d)) continue;
    try {
      const stat = readFileSync(`/proc/${d}/stat`, "utf8");
      parent.set(Number(d), Number(stat.slice(stat.lastIndexOf(")") + 2).split(" ")[1]));
    } catch { /* gone */ }
  }
  const descends = (pid) => {
    for (let p = pid, n = 0; p > 1 && n < 64; p = parent.get(p) ?? 0, n++) if (p === process.pid) return true;
    return false;
  };
  const out = new Map();
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

const median = (xs) => [...xs].sort((a, b) => a - b)[Math.floor(xs.length / 2)];

const port = await freePort();
const server = spawn("python3", [path.join(root, "web/tests/serve.py"), String(port), path.resolve(dist)],
  { stdio: "ignore" });
let browser;
try {
  await waitFor(async () => {
    try { return (await fetch(`http://127.0.0.1:${port}/index.html`)).ok; } catch { return false; }
  }, "the static server", 30000);
  browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
      "--disable-sync", "--no-first-run", "--use-gl=angle", "--use-angle=swiftshader", "--enable-unsafe-swiftshader"],
  });
  for (const dir of checkpoints) for (const way of ways) {
    const files = readdirSync(dir).filter((f) => f === ".metadata" || f.endsWith(".distcp")).map((f) => path.join(dir, f));
    const times = [];
    const pageTimes = [];
    const growths = [];
    let status = "";
    let suspends = 0;
    let progress = 0;
    if (way === "floor") {
      for (let run = 0; run <= runs; run++) {
        const page = await browser.newPage();
        await page.setContent("<input type=file id=files multiple>");
        await page.evaluate(() => {
          const input = document.getElementById("files");
          input.addEventListener("change", async () => {
            const t0 = performance.now();
            const picked = [...input.files];
            let bytes = 0;
            for (const f of picked) bytes += f.size;
            const heads = picked.filter((f) => f.name.endsWith(".distcp"))
              .map((f) => f.slice(0, 4096).arrayBuffer());
            const meta = picked.find((f) => f.name === ".metadata");
            const reader = meta.stream().getReader();
            for (;;) {
              const { done, value } = await reader.read();
              if (done) break;
              bytes += value.byteLength;
            }
            await Promise.all(heads);
            window.benchFloor = { seconds: (performance.now() - t0) / 1000, bytes };
          });
        });
        const t0 = Date.now();
        await page.setInputFiles("#files", files);
        const floor = await waitFor(() => page.evaluate(() => window.benchFloor), "the floor page", 600000);
        if (run > 0) {
          times.push((Date.now() - t0) / 1000);
          pageTimes.push(floor.seconds);
        }
        await page.close();
      }
      console.log(JSON.stringify({
        checkpoint: dir, way, files: files.length, runs, open_s: median(times), open_s_all: times,
        page_open_s: Number(median(pageTimes).toFixed(3)),
      }));
      continue;
    }
    for (let run = 0; run <= runs; run++) {
      // A fresh page (one renderer) per open.
      const page = await browser.newPage({ viewport: { width: 1400, height: 860 }, deviceScaleFactor: 1 });
      await page.goto(`http://127.0.0.1:${port}/index.html?empty`);
      await waitFor(() => page.evaluate(() => document.body.dataset.ready === "1"), "the viewer to start", 60000);
      await page.evaluate((w) => {
        window.shardscope.set_suspending_reads(w === "suspending");
        // The page's own time: from the file input's change event to the status line showing
        // the entries (without Chromium's file picking, which the wall time includes).
        const input = document.getElementById("files");
        input.addEventListener("change", () => { window.benchT0 = performance.now(); }, { capture: true });
        const status = document.getElementById("status");
        window.benchProgress = new Set();
        new MutationObserver(() => {
          if (status.textContent.includes("indexing")) window.benchProgress.add(status.textContent);
          if (window.benchT1 === undefined && status.textContent.includes(" entries")) window.benchT1 = performance.now();
        }).observe(status, { childList: true, characterData: true, subtree: true });
      }, way);
      if (way === "suspending" && !(await page.evaluate(() => window.shardscope.suspending_reads()))) {
        throw new Error("this browser cannot suspend wasm (JSPI): run with --ways rounds");
      }
      await page.waitForTimeout(300);
      const before = renderers();
      const [rpid, base] = [...before.entries()].sort((a, b) => b[1].rss - a[1].rss)[0];
      try { writeFileSync(`/proc/${rpid}/clear_refs`, "5"); } catch { /* the peak stays from the load */ }
      const t0 = Date.now();
      await page.setInputFiles("#files", files);
      status = await waitFor(async () => {
        const s = await page.textContent("#status");
        return s.includes(" entries") || s.includes("error") ? s : null;
      }, `${dir} to open`, 600000);
      const seconds = (Date.now() - t0) / 1000;
      await page.waitForTimeout(300);
      const after = renderers().get(rpid) ?? base;
      if (!status.includes(" entries")) throw new Error(`${dir}: ${status}`);
      const pageSeconds = await page.evaluate(() => (window.benchT1 - window.benchT0) / 1000);
      suspends = await page.evaluate(() => window.shardscope.suspending_reads_done());
      progress = await page.evaluate(() => window.benchProgress.size);
      if (run > 0) {
        times.push(seconds);
        pageTimes.push(pageSeconds);
        growths.push((Math.max(after.hwm, after.rss) - base.rss) / MiB);
      }
      await page.close();
    }
    console.log(JSON.stringify({
      checkpoint: dir, way, files: files.length, runs, open_s: median(times), open_s_all: times,
      page_open_s: Number(median(pageTimes).toFixed(3)), suspending_reads: suspends,
      // How many different "indexing ..." status lines the page showed during the last open.
      progress_lines: progress,
      renderer_growth_mib: Math.round(median(growths)), status,
    }));
  }
} finally {
  await browser?.close();
  server.kill();
}
