// A training plan run the same way in node and in the browser (the tests' and benchmarks' runner):
//
//   plan.json           {"steps": [{"lr": 0.01, "batch": "0"}, ...], "eval": "e" (optional)}
//   batches.safetensors the tensors of every batch, named "<batch key>/<input name>" (random inputs included
//                       when the plan feeds them instead of letting the driver draw them)
//
// It times each step (performance.now around trainStep) for the benchmarks.

import {ArtifactError} from '../src/manifest.js';

/**
 * Group "<key>/<name>" tensors by key.
 * @param {Map<string, {type: string, dims: number[], data: ArrayBufferView}>} tensors  from readSafetensors
 * @returns {Map<string, Object<string, object>>} key -> {input name: tensor record}
 */
export function batchesOf(tensors) {
  const batches = new Map();
  for (const [name, tensor] of tensors) {
    const cut = name.indexOf('/');
    if (cut < 1) throw new ArtifactError(`batches: tensor ${JSON.stringify(name)} is not named "<batch>/<input>"`);
    const key = name.slice(0, cut);
    if (!batches.has(key)) batches.set(key, {});
    batches.get(key)[name.slice(cut + 1)] = tensor;
  }
  return batches;
}

/**
 * Run a plan on a trainer.
 * @param {import('../src/trainer.js').ArtifactTrainer} trainer
 * @param {{steps: {lr: number, batch: string}[], eval?: string}} plan
 * @param {Map<string, object>} batches  from batchesOf
 * @param {() => number|Promise<number>} [cpuMs]  CPU time in ms of the process that computes (node:
 *   process.cpuUsage; a page: its renderer's, read from /proc by run-browser.mjs)
 * @returns {Promise<{losses: number[], step_ms: number[], step_cpu_ms: number[]|null, eval_loss: number|null,
 *   step: number}>}
 */
export async function runPlan(trainer, plan, batches, cpuMs = undefined) {
  const batch = (key) => {
    if (!batches.has(key)) throw new ArtifactError(`plan names batch ${JSON.stringify(key)}, which batches.safetensors lacks`);
    return batches.get(key);
  };
  const losses = [];
  const stepMs = [];
  const stepCpuMs = [];
  for (const {lr, batch: key} of plan.steps) {
    const feeds = batch(key);
    const cpu = await cpuMs?.();
    const start = performance.now();
    const {loss} = await trainer.trainStep(feeds, {lr});
    stepMs.push(performance.now() - start);
    if (cpuMs) stepCpuMs.push((await cpuMs()) - cpu);
    losses.push(loss);
  }
  let evalLoss = null;
  if (plan.eval !== undefined) {
    const all = batch(plan.eval);
    const inputs = Object.fromEntries(trainer.manifest.eval.inputs.filter((n) => n in all).map((n) => [n, all[n]]));
    evalLoss = (await trainer.evalStep(inputs)).loss ?? null;
  }
  return {losses, step_ms: stepMs, step_cpu_ms: cpuMs ? stepCpuMs : null, eval_loss: evalLoss, step: trainer.step};
}
