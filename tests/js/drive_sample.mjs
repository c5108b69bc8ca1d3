#!/usr/bin/env node
// Drive samples/train_in_browser in headless Chromium (tests/js/test_sample_page.py):
//   node drive_sample.mjs ARTIFACT OUT_DIR STEPS
// serves the page, the driver, onnxruntime-web and ARTIFACT (as the page's artifact/) on 127.0.0.1 only, trains
// STEPS steps through the page's own button, downloads the weights through its link, and writes to OUT_DIR:
// result.json ({points, curve_pixels, status}), page.png (a screenshot) and the downloaded state file.

import {readdir, writeFile} from 'node:fs/promises';
import {dirname, join, resolve} from 'node:path';
import {fileURLToPath} from 'node:url';

import {launch} from '../../js/tools/chromium.mjs';
import {serve} from '../../js/tools/static-server.mjs';

const [artifact, outDir, steps] = process.argv.slice(2);
const repo = resolve(dirname(fileURLToPath(import.meta.url)), '..', '..');
const server = await serve({
  '/samples/train_in_browser/artifact/': artifact,
  '/samples/train_in_browser/': join(repo, 'samples', 'train_in_browser'),
  '/js/src/': join(repo, 'js', 'src'),
  '/js/node_modules/onnxruntime-web/dist/': join(repo, 'js', 'node_modules', 'onnxruntime-web', 'dist'),
});
const downloads = join(outDir, 'downloads');
const chromium = await launch();
try {
  const {page} = chromium;
  const cdp = await page.createCDPSession();
  await cdp.send('Browser.setDownloadBehavior', {behavior: 'allow', downloadPath: downloads});
  await page.setViewport({width: 800, height: 720});
  await page.goto(`${server.origin}/samples/train_in_browser/`);
  await page.waitForFunction(() => ['ready', 'error'].includes(document.body.dataset.state), {timeout: 120_000});
  await page.$eval('#steps', (input, n) => { input.value = n; }, steps);
  await page.click('#train');
  await page.waitForFunction(() => ['done', 'error'].includes(document.body.dataset.state), {timeout: 300_000});
  const status = await page.$eval('#status', (p) => p.textContent);
  if (await page.evaluate(() => document.body.dataset.state) === 'error') throw new Error(`the page failed: ${status}`);
  // the curve's pixels: those of the curve's colour on the canvas
  const {points, curvePixels} = await page.evaluate(() => {
    const canvas = document.getElementById('curve');
    const {data} = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height);
    let curvePixels = 0;
    for (let i = 0; i < data.length; i += 4) if (data[i] < 80 && data[i + 1] > 90 && data[i + 2] > 160) curvePixels++;
    return {points: window.lossCurve.points, curvePixels};
  });
  await page.screenshot({path: join(outDir, 'page.png'), fullPage: true});
  await page.click('#download');
  let files = [];
  for (let i = 0; i < 200 && !files.some((f) => f.endsWith('.safetensors')); i++) {
    await new Promise((r) => setTimeout(r, 50));
    files = await readdir(downloads).catch(() => []);
  }
  await writeFile(join(outDir, 'result.json'), JSON.stringify({points, curve_pixels: curvePixels, status, downloads: files}));
} finally {
  await chromium.close();
  await server.close();
}
