// Headless Chromium for the tests and benchmarks: Debian's /usr/bin/chromium (or CHROMIUM) driven by
// puppeteer-core, a new empty profile each launch, no network beyond the page's own server.

import {mkdtemp, readFile, readdir, rm} from 'node:fs/promises';
import {tmpdir} from 'node:os';
import {join} from 'node:path';

import puppeteer from 'puppeteer-core';

export const FLAGS = [
  '--headless', '--no-sandbox', '--disable-gpu', '--disable-quic', '--no-first-run',
  '--disable-background-networking', '--disable-component-update', '--disable-sync',
];

/**
 * Launch Chromium with a fresh --user-data-dir, and open a page whose console and errors go to stderr.
 * @returns {Promise<{browser: object, page: object, close: () => Promise<void>}>}
 */
export async function launch() {
  const profile = await mkdtemp(join(tmpdir(), 'ort-trainer-chromium-'));
  const browser = await puppeteer.launch({
    executablePath: process.env.CHROMIUM ?? '/usr/bin/chromium',
    headless: true,
    args: [...FLAGS, `--user-data-dir=${profile}`],
    protocolTimeout: 600_000,
  });
  const page = await browser.newPage();
  page.on('console', (message) => process.stderr.write(`page: ${message.text()}\n`));
  page.on('pageerror', (error) => process.stderr.write(`page error: ${error.message}\n`));
  page.on('response', (response) => {
    if (response.status() >= 400) process.stderr.write(`page: HTTP ${response.status()} for ${response.url()}\n`);
  });
  const close = async () => {
    await browser.close();
    await rm(profile, {recursive: true, force: true});
  };
  return {browser, page, close};
}

/**
 * CPU time (user + system, ms) of Chromium's renderer processes, from /proc: the processes below `browserPid`
 * whose command line says --type=renderer. null where /proc cannot tell (not Linux).
 * @param {number} browserPid  browser.process().pid
 * @returns {Promise<number|null>}
 */
export async function rendererCpuMs(browserPid) {
  const renderers = await rendererStats(browserPid);
  return renderers && renderers.reduce((ms, r) => ms + r.ticks * 10, 0); // USER_HZ is 100 on Linux
}

/**
 * The peak resident memory (VmHWM, MiB) of Chromium's largest renderer process: what a page's wasm heap costs.
 * @param {number} browserPid
 * @returns {Promise<number|null>}
 */
export async function rendererPeakMiB(browserPid) {
  const renderers = await rendererStats(browserPid);
  if (!renderers) return null;
  let peak = 0;
  for (const {pid} of renderers) {
    const status = await readFile(`/proc/${pid}/status`, 'utf8').catch(() => '');
    const kb = Number(/^VmHWM:\s+(\d+) kB/m.exec(status)?.[1] ?? 0);
    peak = Math.max(peak, kb / 1024);
  }
  return peak;
}

// [{pid, ticks}] of the renderer processes below browserPid (ticks: utime + stime), null without /proc
async function rendererStats(browserPid) {
  const stats = new Map();
  let entries;
  try {
    entries = await readdir('/proc');
  } catch {
    return null;
  }
  for (const entry of entries.filter((e) => /^[0-9]+$/.test(e))) {
    const text = await readFile(`/proc/${entry}/stat`, 'utf8').catch(() => null);
    if (!text) continue;
    // fields after the command's closing parenthesis: state ppid ... utime(14) stime(15), in clock ticks
    const fields = text.slice(text.lastIndexOf(')') + 2).split(' ');
    stats.set(Number(entry), {ppid: Number(fields[1]), ticks: Number(fields[11]) + Number(fields[12])});
  }
  const below = (pid) => {
    for (let p = pid, hops = 0; p > 1 && hops < 16; p = stats.get(p)?.ppid ?? 0, hops++) if (p === browserPid) return true;
    return false;
  };
  const renderers = [];
  for (const [pid, stat] of stats) {
    if (pid === browserPid || !below(pid)) continue;
    const cmdline = await readFile(`/proc/${pid}/cmdline`, 'utf8').catch(() => '');
    if (cmdline.includes('--type=renderer')) renderers.push({pid, ticks: stat.ticks});
  }
  return renderers;
}
