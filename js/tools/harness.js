// The page side of run-browser.mjs: run a plan (plan.js) on an artifact in onnxruntime-web (wasm), and hand
// back the result and the saved state (base64) to the caller.

import * as ort from '/ort/ort.wasm.min.mjs';

import {loadArtifact, readSafetensors} from '/js/src/browser.js';
import {batchesOf, runPlan} from '/js/tools/plan.js';

function base64(bytes) {
  let text = '';
  for (let i = 0; i < bytes.length; i += 0x8000) text += String.fromCharCode(...bytes.subarray(i, i + 0x8000));
  return btoa(text);
}

window.runPlanInPage = async ({threads, seed, state}) => {
  ort.env.wasm.numThreads = threads;
  ort.env.wasm.wasmPaths = '/ort/';
  const trainer = await loadArtifact(ort, '/artifact/', {
    seed, state: state ? `/state/${state}` : undefined, sessionOptions: {executionMode: 'sequential'},
  });
  const plan = await (await fetch('/plan/plan.json')).json();
  const bytes = new Uint8Array(await (await fetch('/plan/batches.safetensors')).arrayBuffer());
  // the renderer's CPU time, where run-browser.mjs could expose it (Linux /proc)
  const cpuMs = typeof window.rendererCpuMs === 'function' ? () => window.rendererCpuMs() : undefined;
  const batches = batchesOf(readSafetensors(bytes, 'batches.safetensors').tensors);
  const result = await runPlan(trainer, plan, batches, cpuMs);
  const saved = trainer.stateBytes();
  await trainer.release();
  return {...result, runtime: `onnxruntime-web ${ort.env.versions.web} (wasm, ${threads} thread)`, state: base64(saved)};
};
document.getElementById('status').textContent = 'ready';
