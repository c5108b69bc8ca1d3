// safetensors reader and writer (https://github.com/huggingface/safetensors, format of the Python package):
// an 8-byte little-endian header size N, N bytes of JSON header, then the tensors' raw little-endian bytes.
// The header maps each tensor name to {dtype, shape, data_offsets: [begin, end]} (offsets into the data that
// follows the header) and may hold "__metadata__", a map of strings to strings.
//
// The reader checks everything it is given before it trusts it: the header size against the file size, the JSON,
// every entry's dtype, shape and offsets, the byte length against dtype x shape, and that the tensors cover the
// data exactly without overlapping (as the Rust reader does). Every failure is a SafetensorsError that names the
// tensor and says what was expected. Nothing in a file is ever executed.

/** Raised for a malformed safetensors buffer or a tensor that cannot be written. */
export class SafetensorsError extends Error {
  /** @param {string} message */
  constructor(message) {
    super(message);
    this.name = 'SafetensorsError';
  }
}

// safetensors dtype -> [ONNX Runtime tensor type, typed array, bytes per element]
const DTYPES = {
  F64: ['float64', Float64Array, 8],
  F32: ['float32', Float32Array, 4],
  F16: ['float16', Uint16Array, 2],
  I64: ['int64', BigInt64Array, 8],
  U64: ['uint64', BigUint64Array, 8],
  I32: ['int32', Int32Array, 4],
  U32: ['uint32', Uint32Array, 4],
  I16: ['int16', Int16Array, 2],
  U16: ['uint16', Uint16Array, 2],
  I8: ['int8', Int8Array, 1],
  U8: ['uint8', Uint8Array, 1],
  BOOL: ['bool', Uint8Array, 1],
};
const CODE_OF_TYPE = Object.fromEntries(Object.entries(DTYPES).map(([code, [type]]) => [type, code]));

/** The ONNX Runtime tensor types this module reads and writes ("float32", "int64", ...). */
export const SUPPORTED_TYPES = Object.freeze(Object.keys(CODE_OF_TYPE));

// the Python reader's own limit on the header (safetensors' MAX_HEADER_SIZE)
const MAX_HEADER_SIZE = 100_000_000;

if (new Uint8Array(new Uint16Array([1]).buffer)[0] !== 1) {
  throw new SafetensorsError('safetensors data is little-endian and this machine is big-endian: not supported');
}

/**
 * The number of elements of a shape (1 for a scalar's []).
 * @param {number[]} shape
 * @returns {number}
 */
export function elementCount(shape) {
  return shape.reduce((a, b) => a * b, 1);
}

function isDimension(d) {
  return Number.isSafeInteger(d) && d >= 0;
}

/**
 * @typedef {object} TensorRecord
 * @property {string} type    ONNX Runtime tensor type: "float32", "int64", "bool", ...
 * @property {number[]} dims  shape ([] for a scalar)
 * @property {ArrayBufferView} data  a typed array of exactly elementCount(dims) elements (a copy: aligned, owned)
 */

/**
 * Parse a safetensors file held in memory.
 * @param {Uint8Array|ArrayBuffer} input  the whole file
 * @param {string} [source]  how to name the file in errors (a path or URL)
 * @returns {{tensors: Map<string, TensorRecord>, metadata: Object<string, string>}}
 *   tensors in the order of their data offsets; metadata is {} when the file has none
 * @throws {SafetensorsError} when anything in the file is out of bounds or inconsistent
 */
export function readSafetensors(input, source = 'safetensors data') {
  const bytes = input instanceof Uint8Array ? input : new Uint8Array(input);
  if (bytes.byteLength < 8) {
    throw new SafetensorsError(`${source}: ${bytes.byteLength} bytes, expected at least 8 (the header size)`);
  }
  const view = new DataView(bytes.buffer, bytes.byteOffset, bytes.byteLength);
  const headerSize = view.getBigUint64(0, true);
  if (headerSize > BigInt(MAX_HEADER_SIZE)) {
    throw new SafetensorsError(`${source}: header size ${headerSize} exceeds the limit of ${MAX_HEADER_SIZE} bytes`);
  }
  const n = Number(headerSize);
  if (8 + n > bytes.byteLength) {
    throw new SafetensorsError(
      `${source}: header size ${n} needs ${8 + n} bytes but the file has ${bytes.byteLength}`);
  }
  let header;
  try {
    header = JSON.parse(new TextDecoder('utf-8', {fatal: true}).decode(bytes.subarray(8, 8 + n)));
  } catch (e) {
    throw new SafetensorsError(`${source}: the header is not UTF-8 JSON (${e.message})`);
  }
  if (header === null || typeof header !== 'object' || Array.isArray(header)) {
    throw new SafetensorsError(`${source}: the header is ${JSON.stringify(header)?.slice(0, 40)}, expected an object`);
  }
  const dataStart = 8 + n;
  const dataLength = bytes.byteLength - dataStart;
  let metadata = {};
  const entries = [];
  for (const [name, entry] of Object.entries(header)) {
    if (name === '__metadata__') {
      metadata = checkMetadata(entry, source);
      continue;
    }
    const where = `${source}: tensor ${JSON.stringify(name)}`;
    if (entry === null || typeof entry !== 'object' || Array.isArray(entry)) {
      throw new SafetensorsError(`${where}: entry is ${JSON.stringify(entry)}, expected {dtype, shape, data_offsets}`);
    }
    const spec = DTYPES[entry.dtype];
    if (!spec) {
      throw new SafetensorsError(
        `${where}: dtype ${JSON.stringify(entry.dtype)} is not one of ${Object.keys(DTYPES).join(', ')}`);
    }
    if (!Array.isArray(entry.shape) || !entry.shape.every(isDimension)) {
      throw new SafetensorsError(`${where}: shape ${JSON.stringify(entry.shape)} is not a list of integers >= 0`);
    }
    const offsets = entry.data_offsets;
    if (!Array.isArray(offsets) || offsets.length !== 2 || !offsets.every(isDimension) || offsets[0] > offsets[1]) {
      throw new SafetensorsError(`${where}: data_offsets ${JSON.stringify(offsets)} is not [begin, end] with begin <= end`);
    }
    if (offsets[1] > dataLength) {
      throw new SafetensorsError(
        `${where}: data_offsets ${JSON.stringify(offsets)} end past the ${dataLength} bytes of data`);
    }
    const [type, Array_, itemSize] = spec;
    const expected = elementCount(entry.shape) * itemSize;
    if (offsets[1] - offsets[0] !== expected) {
      throw new SafetensorsError(
        `${where}: ${offsets[1] - offsets[0]} bytes, expected ${expected} for ${entry.dtype} of shape ` +
        `${JSON.stringify(entry.shape)}`);
    }
    entries.push({name, type, Array_, dims: entry.shape, begin: offsets[0], end: offsets[1]});
  }
  entries.sort((a, b) => a.begin - b.begin || a.end - b.end);
  let covered = 0;
  for (const e of entries) {
    if (e.begin !== covered) {
      const what = e.begin < covered ? 'overlaps the tensor before it' : `leaves bytes ${covered}..${e.begin} unused`;
      throw new SafetensorsError(
        `${source}: tensor ${JSON.stringify(e.name)} starts at byte ${e.begin} and ${what} (expected ${covered})`);
    }
    covered = e.end;
  }
  if (covered !== dataLength) {
    throw new SafetensorsError(`${source}: the tensors cover ${covered} of the ${dataLength} bytes of data`);
  }
  const tensors = new Map();
  for (const e of entries) {
    // a copy: the data need not be aligned for the typed array, and the caller owns what it gets (through
    // Uint8Array's slice: a node Buffer's own slice is a view into a shared pool)
    const copy = Uint8Array.prototype.slice.call(bytes, dataStart + e.begin, dataStart + e.end);
    tensors.set(e.name, {type: e.type, dims: e.dims.slice(), data: new e.Array_(copy.buffer)});
  }
  return {tensors, metadata};
}

function checkMetadata(entry, source) {
  if (entry === null || typeof entry !== 'object' || Array.isArray(entry)) {
    throw new SafetensorsError(`${source}: __metadata__ is ${JSON.stringify(entry)}, expected a map of strings`);
  }
  for (const [key, value] of Object.entries(entry)) {
    if (typeof value !== 'string') {
      throw new SafetensorsError(`${source}: __metadata__[${JSON.stringify(key)}] is ${JSON.stringify(value)}, expected a string`);
    }
  }
  return {...entry};
}

/**
 * Serialize tensors to safetensors bytes, in the order given (the header is padded with spaces to a multiple of 8
 * bytes, as the Python writer does, so that every tensor's data starts 8-byte aligned).
 * @param {Iterable<[string, {type: string, dims: readonly number[], data: ArrayBufferView}]>|Map} tensors
 *   name -> tensor; ONNX Runtime Tensor objects qualify (they have type, dims and data)
 * @param {Object<string, string>} [metadata]  written as "__metadata__" (values must be strings)
 * @returns {Uint8Array}
 * @throws {SafetensorsError} for an unsupported type, a bad shape, or data whose length does not match its shape
 */
export function writeSafetensors(tensors, metadata = undefined) {
  const header = {};
  if (metadata !== undefined) {
    header.__metadata__ = checkMetadata(metadata, 'metadata to write');
  }
  const parts = [];
  let offset = 0;
  for (const [name, tensor] of tensors) {
    const where = `tensor ${JSON.stringify(name)}`;
    if (name === '__metadata__' || Object.hasOwn(header, name)) {
      throw new SafetensorsError(`${where}: the name is reserved or given twice`);
    }
    const code = CODE_OF_TYPE[tensor?.type];
    if (!code) {
      throw new SafetensorsError(`${where}: type ${JSON.stringify(tensor?.type)} is not one of ${SUPPORTED_TYPES.join(', ')}`);
    }
    const dims = Array.from(tensor.dims ?? [], Number);
    if (!dims.every(isDimension)) {
      throw new SafetensorsError(`${where}: dims ${JSON.stringify(tensor.dims)} is not a list of integers >= 0`);
    }
    const data = tensor.data;
    if (!ArrayBuffer.isView(data)) {
      throw new SafetensorsError(`${where}: data is not a typed array (a GPU tensor must be downloaded first)`);
    }
    const [, , itemSize] = DTYPES[code];
    const expected = elementCount(dims) * itemSize;
    if (data.byteLength !== expected) {
      throw new SafetensorsError(
        `${where}: ${data.byteLength} bytes of data, expected ${expected} for ${tensor.type} of shape ${JSON.stringify(dims)}`);
    }
    header[name] = {dtype: code, shape: dims, data_offsets: [offset, offset + expected]};
    parts.push(new Uint8Array(data.buffer, data.byteOffset, data.byteLength));
    offset += expected;
  }
  const json = new TextEncoder().encode(JSON.stringify(header));
  const padded = Math.ceil(json.byteLength / 8) * 8;
  const out = new Uint8Array(8 + padded + offset);
  new DataView(out.buffer).setBigUint64(0, BigInt(padded), true);
  out.fill(0x20, 8, 8 + padded);
  out.set(json, 8);
  let at = 8 + padded;
  for (const part of parts) {
    out.set(part, at);
    at += part.byteLength;
  }
  return out;
}
