import assert from 'node:assert/strict';
import {test} from 'node:test';

import {SafetensorsError, readSafetensors, writeSafetensors} from '../src/safetensors.js';

function file(header, dataBytes = 0, {size} = {}) {
  const json = new TextEncoder().encode(typeof header === 'string' ? header : JSON.stringify(header));
  const out = new Uint8Array(8 + json.length + dataBytes);
  new DataView(out.buffer).setBigUint64(0, BigInt(size ?? json.length), true);
  out.set(json, 8);
  return out;
}

function refuses(bytes, pattern) {
  assert.throws(() => readSafetensors(bytes, 'f.safetensors'), (e) => {
    assert.ok(e instanceof SafetensorsError, `${e}`);
    assert.match(e.message, pattern);
    return true;
  });
}

test('every type round-trips with its shape, in order, with metadata', () => {
  const tensors = new Map([
    ['a', {type: 'float32', dims: [2, 3], data: new Float32Array([1, 2, 3, 4, 5, 6.5])}],
    ['b.step', {type: 'int64', dims: [], data: new BigInt64Array([2n ** 40n])}],
    ['c', {type: 'float64', dims: [1], data: new Float64Array([Math.PI])}],
    ['d', {type: 'int32', dims: [2], data: new Int32Array([-1, 7])}],
    ['e', {type: 'uint8', dims: [3], data: new Uint8Array([0, 1, 255])}],
    ['f', {type: 'bool', dims: [2], data: new Uint8Array([1, 0])}],
    ['g', {type: 'float16', dims: [1], data: new Uint16Array([0x3c00])}],
    ['h', {type: 'int8', dims: [0, 4], data: new Int8Array(0)}],
  ]);
  const bytes = writeSafetensors(tensors, {step: '3'});
  const headerSize = Number(new DataView(bytes.buffer).getBigUint64(0, true));
  assert.equal(headerSize % 8, 0);
  const {tensors: back, metadata} = readSafetensors(bytes);
  assert.deepEqual(metadata, {step: '3'});
  assert.deepEqual([...back.keys()], [...tensors.keys()]);
  for (const [name, t] of tensors) {
    assert.equal(back.get(name).type, t.type, name);
    assert.deepEqual(back.get(name).dims, t.dims, name);
    assert.deepEqual(back.get(name).data, t.data, name);
  }
});

test('a node Buffer from a shared pool reads as its own bytes only', () => {
  const bytes = writeSafetensors([['x', {type: 'float32', dims: [2], data: new Float32Array([1.5, -2])}]]);
  const pooled = Buffer.concat([Buffer.alloc(13, 7), Buffer.from(bytes)]).subarray(13);
  const {tensors} = readSafetensors(pooled);
  assert.deepEqual(tensors.get('x').data, new Float32Array([1.5, -2]));
  assert.equal(tensors.get('x').data.buffer.byteLength, 8);
});

test('a short file, a header past the end, and a header that is not a JSON object are refused', () => {
  refuses(new Uint8Array(5), /5 bytes, expected at least 8/);
  refuses(file({}, 0, {size: 999}), /header size 999 needs 1007 bytes but the file has 10/);
  refuses(file({}, 0, {size: 2 ** 40}), /exceeds the limit/);
  refuses(file('{"a": '), /not UTF-8 JSON/);
  refuses(file('[1, 2]'), /expected an object/);
});

test('each bad entry is refused naming the tensor and what was expected', () => {
  const entry = (e) => file({w: e}, 8);
  refuses(entry({dtype: 'F33', shape: [2], data_offsets: [0, 8]}), /tensor "w": dtype "F33" is not one of/);
  refuses(entry({dtype: 'F32', shape: [-2], data_offsets: [0, 8]}), /tensor "w": shape \[-2\]/);
  refuses(entry({dtype: 'F32', shape: [2], data_offsets: [8, 0]}), /tensor "w": data_offsets \[8,0\]/);
  refuses(entry({dtype: 'F32', shape: [2], data_offsets: [0, 16]}), /tensor "w": .* end past the 8 bytes of data/);
  refuses(entry({dtype: 'F32', shape: [3], data_offsets: [0, 8]}), /tensor "w": 8 bytes, expected 12 for F32 of shape \[3\]/);
  refuses(entry('x'), /tensor "w": entry is "x"/);
  refuses(file({__metadata__: {step: 3}}), /__metadata__\["step"\] is 3, expected a string/);
});

test('overlapping tensors, gaps and trailing bytes are refused', () => {
  const f32 = (a, b) => ({dtype: 'F32', shape: [(b - a) / 4], data_offsets: [a, b]});
  refuses(file({a: f32(0, 8), b: f32(4, 12)}, 12), /tensor "b" starts at byte 4 and overlaps/);
  refuses(file({a: f32(0, 4), b: f32(8, 12)}, 12), /tensor "b" starts at byte 8 and leaves bytes 4..8 unused/);
  refuses(file({a: f32(0, 4)}, 12), /cover 4 of the 12 bytes/);
});

test('the writer refuses what it cannot write, naming the tensor', () => {
  const bad = (tensor, pattern) => assert.throws(() => writeSafetensors([['t', tensor]]), pattern);
  bad({type: 'string', dims: [1], data: ['a']}, /tensor "t": type "string" is not one of/);
  bad({type: 'float32', dims: [3], data: new Float32Array(2)}, /tensor "t": 8 bytes of data, expected 12 for float32 of shape \[3\]/);
  bad({type: 'float32', dims: [1.5], data: new Float32Array(2)}, /tensor "t": dims \[1.5\]/);
  bad({type: 'float32', dims: [2], data: [1, 2]}, /tensor "t": data is not a typed array/);
  const x = {type: 'int32', dims: [], data: new Int32Array(1)};
  assert.throws(() => writeSafetensors([['x', x], ['x', x]]), /tensor "x": the name is reserved or given twice/);
  assert.throws(() => writeSafetensors([], {step: 3}), /__metadata__\["step"\] is 3/);
});
