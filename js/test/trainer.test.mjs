// Needs ARTIFACT: the folder of tests/js/linear_artifact.py (tests/js/test_js_units.py sets it).
import assert from 'node:assert/strict';
import {cp, readFile, writeFile} from 'node:fs/promises';
import {tmpdir} from 'node:os';
import {join} from 'node:path';
import {test} from 'node:test';

import * as ort from 'onnxruntime-node';

import {ArtifactError, loadArtifact, readSafetensors, saveState, writeSafetensors} from '../src/node.js';

const ARTIFACT = process.env.ARTIFACT;
assert.ok(ARTIFACT, 'set ARTIFACT to the folder written by tests/js/linear_artifact.py');

const batch = (n = 2) => ({
  x: {data: new Float32Array(n * 4).fill(0.5), dims: [n, 4]},
  y: new ort.Tensor('float32', new Float32Array(n).fill(1), [n, 1]),
});

async function copy(change) {
  const folder = join(tmpdir(), `artifact-${process.pid}-${Math.random().toString(36).slice(2)}`);
  await cp(ARTIFACT, folder, {recursive: true});
  await change?.(folder);
  return folder;
}

async function rejects(promise, pattern) {
  await assert.rejects(promise, (e) => {
    assert.match(e.message, pattern);
    return true;
  });
}

test('a step takes Tensors, {data, dims} records and plain arrays, and the state moves', async () => {
  const trainer = await loadArtifact(ort, ARTIFACT, {seed: 1});
  const before = Float32Array.from(trainer.stateTensor('linear.weight').data);
  const {loss, step, outputs} = await trainer.trainStep(batch(), {lr: 0.1});
  assert.ok(Number.isFinite(loss) && step === 1 && trainer.step === 1);
  assert.equal(outputs.grad_norm.dims.length, 0);
  assert.notDeepEqual(trainer.stateTensor('linear.weight').data, before);
  assert.equal(trainer.stateTensor('seen').data[0], 2);
  await trainer.trainStep({x: {data: [1, 2, 3, 4], dims: [1, 4]}, y: {type: 'float32', data: [1], dims: [1, 1]}}, {lr: 0.1});
  assert.equal(trainer.stateTensor('seen').data[0], 3);
  const {loss: evalLoss, outputs: evalOutputs} = await trainer.evalStep(batch(3));
  assert.ok(Number.isFinite(evalLoss));
  assert.deepEqual(evalOutputs.pred.dims, [3, 1]);
  await trainer.release();
});

test('a batch that does not fit the manifest is named, and the state and step stay as they were', async () => {
  const trainer = await loadArtifact(ort, ARTIFACT, {seed: 1});
  const weight = trainer.stateTensor('linear.weight');
  await rejects(trainer.trainStep({x: batch().x}, {lr: 0.1}), /train batch has no "y" \(float32 \["batch",1\]\)/);
  await rejects(trainer.trainStep({...batch(), z: batch().x}, {lr: 0.1}), /train batch has "z", which the train graph does not take .*\["x","y","random_0","random_1"\]/);
  await rejects(trainer.trainStep({...batch(), lr: batch().x}, {lr: 0.1}), /train batch has "lr"/);
  await rejects(trainer.trainStep({...batch(), x: {type: 'int64', data: new BigInt64Array(8), dims: [2, 4]}}, {lr: 0.1}), /train input "x" is int64, expected float32/);
  await rejects(trainer.trainStep({...batch(), x: {data: new Float64Array(8), dims: [2, 4]}}, {lr: 0.1}), /train input "x": data is a Float64Array, expected a Float32Array/);
  await rejects(trainer.trainStep({...batch(), x: {data: new Float32Array(7), dims: [2, 4]}}, {lr: 0.1}), /train input "x" has 7 values, expected 8 for shape \[2,4\]/);
  await rejects(trainer.trainStep({...batch(), x: {data: new Float32Array(6), dims: [2, 3]}}, {lr: 0.1}), /input "x" has 3 at axis 1, expected 4/);
  await rejects(trainer.trainStep({...batch(3), y: batch(2).y}, {lr: 0.1}), /input "y" has 2 at axis 0 \(dim "batch"\), but another input set "batch" to 3/);
  await rejects(trainer.trainStep({...batch(), random_1: {data: new Float32Array(9), dims: [9]}}, {lr: 0.1}), /train random input "random_1" has shape \[9\], expected \[8\] \(\["batch\*4"\]\)/);
  await rejects(trainer.trainStep(batch(), {lr: '0.1'}), /lr is 0.1, expected a finite number/);
  await rejects(trainer.trainStep(batch(), {}), /lr is undefined/);
  await rejects(trainer.evalStep({x: batch().x}), /eval batch has no "y"/);
  assert.equal(trainer.step, 0);
  assert.equal(trainer.stateTensor('linear.weight'), weight);
  assert.throws(() => trainer.stateTensor('nope'), /no state tensor "nope"/);
  await trainer.release();
});

test('two steps at once are refused: the second would train on a stale state', async () => {
  const trainer = await loadArtifact(ort, ARTIFACT, {seed: 1});
  const first = trainer.trainStep(batch(), {lr: 0.1});
  await rejects(trainer.trainStep(batch(), {lr: 0.1}), /another step of this trainer is still running/);
  await first;
  assert.equal(trainer.step, 1);
  await trainer.release();
});

test('a state file that does not match the manifest is refused naming the tensor', async () => {
  const {tensors} = readSafetensors(await readFile(join(ARTIFACT, 'state.safetensors')));
  const write = (map, metadata) => async (folder) => writeFile(join(folder, 'state.safetensors'), writeSafetensors(map, metadata));
  const without = new Map(tensors);
  without.delete('seen');
  await rejects(loadArtifact(ort, await copy(write(without))), /state: no tensor "seen", which manifest.json lists/);
  const reshaped = new Map(tensors);
  reshaped.set('linear.bias', {type: 'float32', dims: [1, 1], data: new Float32Array(1)});
  await rejects(loadArtifact(ort, await copy(write(reshaped))), /tensor "linear.bias" is float32 \[1,1\], manifest.json says float32 \[1\]/);
  const extra = new Map(tensors);
  extra.set('ghost', {type: 'float32', dims: [], data: new Float32Array(1)});
  await rejects(loadArtifact(ort, await copy(write(extra))), /tensors that manifest.json does not list: \["ghost"\]/);
  await rejects(loadArtifact(ort, await copy(write(tensors, {step: '-3'}))), /__metadata__.step is "-3"/);
  await rejects(loadArtifact(ort, await copy(write(tensors, {format: 'other'}))), /__metadata__.format is "other"/);
});

test('files and graphs that do not match the manifest are refused naming them', async () => {
  const edit = (change) => async (folder) => {
    const m = JSON.parse(await readFile(join(folder, 'manifest.json'), 'utf8'));
    change(m);
    await writeFile(join(folder, 'manifest.json'), JSON.stringify(m));
  };
  await rejects(loadArtifact(ort, '/nonexistent/artifact'), /manifest \/nonexistent\/artifact\/manifest.json cannot be read: ENOENT/);
  await rejects(loadArtifact(ort, await copy(async (f) => writeFile(join(f, 'manifest.json'), '{'))), /manifest.json is not JSON/);
  await rejects(loadArtifact(ort, await copy(edit((m) => { m.files.eval = 'missing.onnx'; }))), /eval graph .*missing.onnx cannot be read: ENOENT/);
  await rejects(loadArtifact(ort, await copy(async (f) => writeFile(join(f, 'train_step.onnx'), 'not onnx'))), /train_step.onnx: ONNX Runtime could not load the graph/);
  await rejects(loadArtifact(ort, await copy(edit((m) => { m.train.inputs = m.train.inputs.filter((n) => n !== 'random_1'); }))), /the graph's inputs differ from manifest.json's list: not in the graph \[\], not in the manifest \["random_1"\]/);
  await rejects(loadArtifact(ort, await copy(edit((m) => { m.train.updated.seen = 'seen.next'; }))), /manifest.json names outputs the graph does not have: \["seen.next"\]/);
  await rejects(loadArtifact(ort, await copy(edit((m) => { m.version = 7; }))), /manifest.json: version is 7/);
});

test('a saved state resumes with its step, and the file is replaced whole', async () => {
  const trainer = await loadArtifact(ort, ARTIFACT, {seed: 1});
  await trainer.trainStep(batch(), {lr: 0.1});
  const path = join(await copy(), 'saved.safetensors');
  await saveState(trainer, path);
  const again = await loadArtifact(ort, ARTIFACT, {state: path});
  assert.equal(again.step, 1);
  assert.deepEqual(again.stateTensor('linear.weight').data, trainer.stateTensor('linear.weight').data);
  const {step} = await again.trainStep(batch(), {lr: 0.1});
  assert.equal(step, 2);
});
