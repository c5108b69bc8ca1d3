// Headless Chromium for the tests and benchmarks: Debian's /usr/bin/chromium (or CHROMIUM) driven by
// puppeteer-core, a new empty profile each launch, no network beyond the page's own server.

import {mkdtemp, rm} from 'node:fs/promises';
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
