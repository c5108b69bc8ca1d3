import assert from 'node:assert/strict';
import {test} from 'node:test';

import {RandomSource} from '../src/random.js';

const N = 200_000;

function moments(values) {
  const mean = values.reduce((a, b) => a + b, 0) / values.length;
  const variance = values.reduce((a, b) => a + (b - mean) ** 2, 0) / values.length;
  return {mean, std: Math.sqrt(variance), min: values.reduce((a, b) => Math.min(a, b)), max: values.reduce((a, b) => Math.max(a, b))};
}

test('uniform draws lie in [0, 1) with the moments of U(0, 1)', () => {
  const m = moments(new RandomSource(3).fill(new Float32Array(N), 'uniform'));
  assert.ok(m.min >= 0 && m.max < 1, JSON.stringify(m));
  assert.ok(Math.abs(m.mean - 0.5) < 0.005, JSON.stringify(m));
  assert.ok(Math.abs(m.std - Math.sqrt(1 / 12)) < 0.005, JSON.stringify(m));
});

test('normal draws have mean 0 and standard deviation 1, odd lengths included', () => {
  const m = moments(new RandomSource(4).fill(new Float64Array(N + 1), 'normal'));
  assert.ok(Math.abs(m.mean) < 0.01 && Math.abs(m.std - 1) < 0.01, JSON.stringify(m));
  assert.ok(Number.isFinite(m.min) && Number.isFinite(m.max));
});

test('a seed gives the same draws; another seed others; no seed draws one', () => {
  const draw = (seed) => Array.from(new RandomSource(seed).fill(new Float32Array(16), 'uniform'));
  assert.deepEqual(draw(7), draw(7));
  assert.notDeepEqual(draw(7), draw(8));
  assert.notDeepEqual(draw(undefined), draw(undefined));
  assert.throws(() => new RandomSource(1.5), /seed is 1.5/);
  assert.throws(() => new RandomSource(1).fill(new Float32Array(1), 'gamma'), /random kind "gamma"/);
});
