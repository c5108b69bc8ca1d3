// Needs ARTIFACT: the folder of tests/js/linear_artifact.py (tests/js/test_js_units.py sets it).
import assert from 'node:assert/strict';
import {readFileSync} from 'node:fs';
import {join} from 'node:path';
import {test} from 'node:test';

import {ArtifactError, bindDims, checkManifest, evaluateDim} from '../src/manifest.js';

const ARTIFACT = process.env.ARTIFACT;
assert.ok(ARTIFACT, 'set ARTIFACT to the folder written by tests/js/linear_artifact.py');
const good = () => JSON.parse(readFileSync(join(ARTIFACT, 'manifest.json'), 'utf8'));

function refuses(change, pattern) {
  const manifest = good();
  change(manifest);
  assert.throws(() => checkManifest(manifest), (e) => {
    assert.ok(e instanceof ArtifactError, `${e}`);
    assert.match(e.message, pattern);
    return true;
  });
}

test('the hand-written artifact follows the format', () => {
  assert.deepEqual(checkManifest(good()), good());
});

test('each field that does not follow the format is named', () => {
  refuses((m) => { m.format = 'x'; }, /format is "x", expected "ort_trainer.training_artifact"/);
  refuses((m) => { m.version = 2; }, /version is 2; this driver reads version 1/);
  refuses((m) => { m.files.train = '../../etc/passwd'; }, /files.train is "..\/..\/etc\/passwd", expected a relative path/);
  refuses((m) => { m.files.state = 'https://x/y'; }, /files.state .* expected a relative path/);
  refuses((m) => { m.inputs[0].shape = ['batch', 'width']; }, /inputs\[0\].shape\[1\] is "width": "width" is neither/);
  refuses((m) => { m.state[0].role = 'weights'; }, /state\[0\].role is "weights"/);
  refuses((m) => { m.state.push({...m.state[0]}); }, /state names "linear.weight" twice/);
  refuses((m) => { m.random[0].kind = 'bernoulli'; }, /random\[0\].kind is "bernoulli"/);
  refuses((m) => { m.train.inputs.push('mask'); }, /train.inputs names "mask": no state tensor/);
  refuses((m) => { m.train.updated.ghost = 'g'; }, /train.updated names "ghost", which is not a state tensor/);
  refuses((m) => { m.train.scalars.lr = 'float64'; }, /train.scalars is .* expected \{"lr": "float32", "step": "int64"\}/);
  refuses((m) => { m.eval.inputs.push('lr'); }, /eval.inputs names "lr"/);
  refuses((m) => { m.step = -1; }, /step is -1/);
});

test('symbolic dims bind from the inputs fed, products included, and disagreements are named', () => {
  const inputs = [{name: 'ids', shape: ['batch', 'seq']}, {name: 'mask', shape: ['batch*seq', 2]}];
  const bound = bindDims(inputs, {ids: [3, 5], mask: [15, 2]});
  assert.deepEqual([...bound], [['batch', 3], ['seq', 5]]);
  assert.equal(evaluateDim('batch*seq*4', bound), 60);
  assert.equal(evaluateDim(7, bound), 7);
  assert.throws(() => evaluateDim('heads', bound), /dim "heads" \(in "heads"\) is set by no input fed/);
  assert.throws(() => bindDims(inputs, {ids: [3], mask: [3, 2]}), /input "ids" has shape \[3\], expected rank 2/);
  assert.throws(() => bindDims(inputs, {ids: [3, 5], mask: [14, 2]}), /input "mask" has 14 at axis 0, expected batch\*seq = 15/);
  assert.throws(() => bindDims(inputs, {ids: [3, 5], mask: [15, 3]}), /input "mask" has 3 at axis 1, expected 2/);
  const two = [{name: 'a', shape: ['batch']}, {name: 'b', shape: ['batch']}];
  assert.throws(() => bindDims(two, {a: [2], b: [3]}), /input "b" has 3 at axis 0 \(dim "batch"\), but another input set "batch" to 2/);
});
