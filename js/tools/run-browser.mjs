#!/usr/bin/env node
// Run a training plan (plan.js) on an artifact in onnxruntime-web inside headless Chromium:
//   node run-browser.mjs ARTIFACT PLAN_DIR OUT_DIR [--threads N] [--state FILE] [--seed N]
// serves the page, the driver, onnxruntime-web and the two folders on 127.0.0.1 only, and writes
// OUT_DIR/result.json ({losses, step_ms, step_cpu_ms, eval_loss, step, runtime, browser, peak_rss_mib: the
// renderer's}) and OUT_DIR/state.safetensors.

import {writeFile} from 'node:fs/promises';
import {basename, dirname, join} from 'node:path';
import {fileURLToPath} from 'node:url';

import {planArgs} from './args.mjs';
import {launch, rendererCpuMs, rendererPeakMiB} from './chromium.mjs';
import {serve} from './static-server.mjs';

const {artifact, planDir, outDir, threads, state, seed} = planArgs('run-browser.mjs');
const js = dirname(dirname(fileURLToPath(import.meta.url)));
const roots = {
  '/ort/': join(js, 'node_modules', 'onnxruntime-web', 'dist'),
  '/js/src/': join(js, 'src'), '/js/tools/': join(js, 'tools'),
  '/artifact/': artifact, '/plan/': planDir,
};
if (state) roots['/state/'] = dirname(state);
const server = await serve(roots);
const chromium = await launch();
try {
  const browserPid = chromium.browser.process().pid;
  if ((await rendererCpuMs(browserPid)) !== null) {
    await chromium.page.exposeFunction('rendererCpuMs', () => rendererCpuMs(browserPid));
  }
  await chromium.page.goto(`${server.origin}/js/tools/harness.html`);
  await chromium.page.waitForFunction(() => typeof window.runPlanInPage === 'function');
  const options = {threads, seed, state: state && basename(state)};
  const {state: saved, ...result} = await chromium.page.evaluate((o) => window.runPlanInPage(o), options);
  await writeFile(join(outDir, 'state.safetensors'), Buffer.from(saved, 'base64'));
  const peak = await rendererPeakMiB(browserPid);
  await writeFile(join(outDir, 'result.json'),
    JSON.stringify({...result, peak_rss_mib: peak, browser: await chromium.browser.version()}));
} finally {
  await chromium.close();
  await server.close();
}
