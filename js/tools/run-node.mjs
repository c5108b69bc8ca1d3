#!/usr/bin/env node
// Run a training plan (plan.js) on an artifact in onnxruntime-node:
//   node run-node.mjs ARTIFACT PLAN_DIR OUT_DIR [--threads N] [--state FILE] [--seed N]
// writes OUT_DIR/result.json ({losses, step_ms, step_cpu_ms, eval_loss, step, runtime, peak_rss_mib}) and
// OUT_DIR/state.safetensors.

import {readFile, writeFile} from 'node:fs/promises';
import {join} from 'node:path';

import * as ort from 'onnxruntime-node';

import {loadArtifact, readSafetensors, saveState} from '../src/node.js';
import {planArgs} from './args.mjs';
import {batchesOf, runPlan} from './plan.js';

const {artifact, planDir, outDir, threads, state, seed} = planArgs('run-node.mjs');
const trainer = await loadArtifact(ort, artifact, {
  state,
  seed,
  sessionOptions: {intraOpNumThreads: threads, interOpNumThreads: 1, executionMode: 'sequential'},
});
const plan = JSON.parse(await readFile(join(planDir, 'plan.json'), 'utf8'));
const {tensors} = readSafetensors(await readFile(join(planDir, 'batches.safetensors')), 'batches.safetensors');
const cpuMs = () => {
  const {user, system} = process.cpuUsage();
  return (user + system) / 1000;
};
const result = await runPlan(trainer, plan, batchesOf(tensors), cpuMs);
await saveState(trainer, join(outDir, 'state.safetensors'));
const peak = process.resourceUsage().maxRSS / 1024; // KiB -> MiB
await writeFile(join(outDir, 'result.json'),
  JSON.stringify({...result, peak_rss_mib: peak, runtime: `onnxruntime-node ${ort.env.versions.node}`}));
await trainer.release();
