// Fine-tune the artifact in ./artifact/ (or ?artifact=URL) on the text of the page, draw the loss curve on the
// canvas, and offer the trained state (safetensors) as a download. The driver is js/src/browser.js of this
// repository; the runtime is onnxruntime-web from js/node_modules (npm ci in js/ installs it).

import * as ort from '../../js/node_modules/onnxruntime-web/dist/ort.wasm.min.mjs';

import {loadArtifact, stateBlob} from '../../js/src/browser.js';

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
const artifactUrl = new URL(params.get('artifact') ?? 'artifact/', location.href);

ort.env.wasm.numThreads = 1; // threads need a cross-origin isolated page; one is enough for a model this size
ort.env.wasm.wasmPaths = new URL('../../js/node_modules/onnxruntime-web/dist/', import.meta.url).href;

// the loss curve: the points so far, redrawn whole at each step (window.lossCurve: for scripts driving the page)
const curve = {points: [], color: '#1f77b4'};
window.lossCurve = curve;

function draw(canvas, points) {
  const g = canvas.getContext('2d');
  const {width, height} = canvas;
  const pad = {left: 48, right: 12, top: 12, bottom: 28};
  g.fillStyle = '#fff';
  g.fillRect(0, 0, width, height);
  g.strokeStyle = '#888';
  g.fillStyle = '#444';
  g.font = '11px sans-serif';
  g.strokeRect(pad.left, pad.top, width - pad.left - pad.right, height - pad.top - pad.bottom);
  if (points.length === 0) return;
  const low = Math.min(...points);
  const high = Math.max(...points);
  const span = high - low || 1;
  const x = (i) => pad.left + (i / Math.max(points.length - 1, 1)) * (width - pad.left - pad.right);
  const y = (v) => pad.top + (1 - (v - low) / span) * (height - pad.top - pad.bottom);
  for (const v of [low, (low + high) / 2, high]) g.fillText(v.toFixed(2), 4, y(v) + 4);
  g.fillText('1', pad.left, height - 8);
  g.fillText(String(points.length), width - pad.right - 24, height - 8);
  g.fillText('training loss (nats / character) at each fine-tuning step', width / 2 - 150, height - 8);
  g.strokeStyle = curve.color;
  g.lineWidth = 2;
  g.beginPath();
  points.forEach((v, i) => (i ? g.lineTo(x(i), y(v)) : g.moveTo(x(i), y(v))));
  g.stroke();
  if (points.length === 1) {
    g.fillStyle = curve.color;
    g.fillRect(x(0) - 2, y(points[0]) - 2, 4, 4);
  }
}

function windows(ids, context, batch) {
  // `batch` random windows of context + 1 characters: tokens and, shifted by one, their labels
  const tokens = new BigInt64Array(batch * context);
  const label = new BigInt64Array(batch * context);
  for (let row = 0; row < batch; row++) {
    const start = Math.floor(Math.random() * (ids.length - context));
    for (let t = 0; t < context; t++) {
      tokens[row * context + t] = BigInt(ids[start + t]);
      label[row * context + t] = BigInt(ids[start + t + 1]);
    }
  }
  return {tokens: {data: tokens, dims: [batch, context]}, label: {data: label, dims: [batch, context]}};
}

async function main() {
  const status = $('status');
  const trainer = await loadArtifact(ort, artifactUrl, {sessionOptions: {executionMode: 'sequential'}});
  const vocab = await (await fetch(new URL('vocab.json', artifactUrl))).json();
  const index = new Map([...vocab.chars].map((c, i) => [c, i]));
  const parameters = trainer.manifest.state.filter((e) => e.role === 'parameter')
    .reduce((n, e) => n + e.shape.reduce((a, b) => a * b, 1), 0);
  status.textContent = `ready: ${parameters.toLocaleString()} parameters, ${trainer.manifest.optimizer.name}, ` +
    `${trainer.step} steps done before (onnxruntime-web ${ort.env.versions.web})`;
  draw($('curve'), curve.points);
  const button = $('train');
  button.disabled = false;
  button.addEventListener('click', async () => {
    button.disabled = true;
    document.body.dataset.state = 'training';
    try {
      const ids = [...$('text').value].filter((c) => index.has(c)).map((c) => index.get(c));
      if (ids.length <= vocab.context + 1) throw new Error(`the text needs over ${vocab.context + 1} known characters`);
      const steps = Number($('steps').value);
      const batch = Number($('batch').value);
      const lr = Number($('lr').value);
      const started = performance.now();
      for (let i = 0; i < steps; i++) {
        const {loss} = await trainer.trainStep(windows(ids, vocab.context, batch), {lr});
        curve.points.push(loss);
        draw($('curve'), curve.points);
        const seconds = (performance.now() - started) / 1000;
        status.textContent = `step ${trainer.step}: loss ${loss.toFixed(3)} (${(seconds / (i + 1) * 1000).toFixed(0)} ms a step)`;
        await new Promise((resolve) => setTimeout(resolve, 0)); // let the page repaint
      }
      const link = $('download');
      if (link.href) URL.revokeObjectURL(link.href);
      link.href = URL.createObjectURL(stateBlob(trainer));
      link.download = `state-step${trainer.step}.safetensors`;
      link.classList.remove('disabled');
      document.body.dataset.state = 'done';
    } catch (error) {
      status.textContent = `error: ${error.message}`;
      document.body.dataset.state = 'error';
    } finally {
      button.disabled = false;
    }
  });
  document.body.dataset.state = 'ready';
}

main().catch((error) => {
  $('status').textContent = `error: ${error.message}`;
  document.body.dataset.state = 'error';
});
