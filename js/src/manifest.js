// manifest.json of a training artifact (format "ort_trainer.training_artifact", version 1): its checks, and the
// evaluation of symbolic shapes ("batch", "seq", "batch*seq*4") against the dims of the batch a step is fed.
// The contract is docs/anywhere.md's "Artifact format" section.

export const FORMAT = 'ort_trainer.training_artifact';
export const VERSION = 1;

/** Raised for a manifest that does not follow the artifact format, or for a batch that does not fit it. */
export class ArtifactError extends Error {
  /** @param {string} message @param {{cause?: unknown}} [options] */
  constructor(message, options = undefined) {
    super(message, options);
    this.name = 'ArtifactError';
  }
}

const KINDS = ['uniform', 'normal'];
const ROLES = ['parameter', 'buffer', 'optimizer'];

function fail(where, what) {
  throw new ArtifactError(`manifest.json: ${where} ${what}`);
}

function isObject(x) {
  return x !== null && typeof x === 'object' && !Array.isArray(x);
}

function checkString(value, where) {
  if (typeof value !== 'string' || value === '') fail(where, `is ${JSON.stringify(value)}, expected a non-empty string`);
  return value;
}

function checkList(value, where) {
  if (!Array.isArray(value)) fail(where, `is ${JSON.stringify(value)}, expected a list`);
  return value;
}

// a file named by the manifest stays inside the artifact folder: a plain relative name, no "..", no scheme
function checkFileName(value, where) {
  checkString(value, where);
  const parts = value.split('/');
  if (value.startsWith('/') || value.includes('\\') || value.includes(':') || parts.some((p) => p === '..' || p === '')) {
    fail(where, `is ${JSON.stringify(value)}, expected a relative path inside the artifact folder`);
  }
  return value;
}

function checkShape(shape, dims, where) {
  checkList(shape, where);
  shape.forEach((entry, i) => {
    if (Number.isSafeInteger(entry) && entry >= 0) return;
    if (typeof entry === 'string') {
      for (const factor of entry.split('*')) {
        if (!dims.includes(factor) && !/^[0-9]+$/.test(factor)) {
          fail(`${where}[${i}]`, `is ${JSON.stringify(entry)}: ${JSON.stringify(factor)} is neither an integer nor ` +
            `one of the dims ${JSON.stringify(dims)}`);
        }
      }
      return;
    }
    fail(`${where}[${i}]`, `is ${JSON.stringify(entry)}, expected an integer >= 0, a dim name or a product "a*b*4"`);
  });
  return shape;
}

function checkNames(list, where) {
  const seen = new Set();
  for (const [i, entry] of checkList(list, where).entries()) {
    if (!isObject(entry)) fail(`${where}[${i}]`, `is ${JSON.stringify(entry)}, expected an object`);
    checkString(entry.name, `${where}[${i}].name`);
    if (seen.has(entry.name)) fail(where, `names ${JSON.stringify(entry.name)} twice`);
    seen.add(entry.name);
    checkString(entry.dtype, `${where}[${i}].dtype`);
  }
  return list;
}

/**
 * Check a parsed manifest.json against format 1 and return it (unchanged). Every name the graphs read must be
 * a state tensor, a batch input, a scalar or a random input; every "updated" key must be a state tensor.
 * @param {object} manifest  the parsed JSON
 * @returns {object} the same manifest
 * @throws {ArtifactError} naming the first field that does not follow the format
 */
export function checkManifest(manifest) {
  if (!isObject(manifest)) throw new ArtifactError(`manifest.json is ${typeof manifest}, expected an object`);
  if (manifest.format !== FORMAT) fail('format', `is ${JSON.stringify(manifest.format)}, expected ${JSON.stringify(FORMAT)}`);
  if (manifest.version !== VERSION) {
    fail('version', `is ${JSON.stringify(manifest.version)}; this driver reads version ${VERSION}`);
  }
  if (!isObject(manifest.files)) fail('files', 'is missing or not an object');
  for (const key of ['train', 'eval', 'state']) checkFileName(manifest.files[key], `files.${key}`);
  const dims = checkList(manifest.dims ?? [], 'dims');
  dims.forEach((d, i) => {
    if (typeof d !== 'string' || !/^[A-Za-z_][A-Za-z0-9_]*$/.test(d)) fail(`dims[${i}]`, `is ${JSON.stringify(d)}, expected an identifier`);
  });
  checkNames(manifest.inputs, 'inputs').forEach((e, i) => checkShape(e.shape, dims, `inputs[${i}].shape`));
  checkNames(manifest.state, 'state').forEach((e, i) => {
    checkShape(e.shape, [], `state[${i}].shape`);
    if (!ROLES.includes(e.role)) fail(`state[${i}].role`, `is ${JSON.stringify(e.role)}, expected one of ${ROLES.join(', ')}`);
  });
  checkNames(manifest.random ?? [], 'random').forEach((e, i) => {
    checkShape(e.shape, dims, `random[${i}].shape`);
    if (!KINDS.includes(e.kind)) fail(`random[${i}].kind`, `is ${JSON.stringify(e.kind)}, expected one of ${KINDS.join(', ')}`);
    if (!['float32', 'float64'].includes(e.dtype)) fail(`random[${i}].dtype`, `is ${JSON.stringify(e.dtype)}, expected float32 or float64`);
  });
  if (!Number.isSafeInteger(manifest.step) || manifest.step < 0) fail('step', `is ${JSON.stringify(manifest.step)}, expected an integer >= 0`);

  const train = manifest.train;
  if (!isObject(train)) fail('train', 'is missing or not an object');
  const scalars = train.scalars;
  if (!isObject(scalars) || scalars.lr !== 'float32' || scalars.step !== 'int64') {
    fail('train.scalars', `is ${JSON.stringify(scalars)}, expected {"lr": "float32", "step": "int64"}`);
  }
  const known = new Set([
    ...manifest.state.map((e) => e.name), ...manifest.inputs.map((e) => e.name),
    ...(manifest.random ?? []).map((e) => e.name), 'lr', 'step']);
  for (const name of checkList(train.inputs, 'train.inputs')) {
    if (!known.has(name)) fail('train.inputs', `names ${JSON.stringify(name)}: no state tensor, input, scalar or random input has that name`);
  }
  checkString(train.loss, 'train.loss');
  if (!isObject(train.updated)) fail('train.updated', 'is missing or not an object');
  const stateNames = new Set(manifest.state.map((e) => e.name));
  for (const [name, output] of Object.entries(train.updated)) {
    if (!stateNames.has(name)) fail('train.updated', `names ${JSON.stringify(name)}, which is not a state tensor`);
    checkString(output, `train.updated[${JSON.stringify(name)}]`);
  }
  for (const name of checkList(train.extra_outputs ?? [], 'train.extra_outputs')) checkString(name, 'train.extra_outputs[]');

  const evalPart = manifest.eval;
  if (!isObject(evalPart)) fail('eval', 'is missing or not an object');
  for (const name of checkList(evalPart.inputs, 'eval.inputs')) {
    if (!known.has(name) || name === 'lr' || name === 'step') {
      fail('eval.inputs', `names ${JSON.stringify(name)}: no state tensor, input or random input has that name`);
    }
  }
  checkList(evalPart.outputs, 'eval.outputs').forEach((name) => checkString(name, 'eval.outputs[]'));
  return manifest;
}

/**
 * Bind the manifest's symbolic dims to the dims of the tensors fed for the batch inputs.
 * @param {object[]} inputs  the manifest's "inputs" entries that are fed ({name, shape})
 * @param {Object<string, readonly number[]>} fed  input name -> dims of the tensor given
 * @returns {Map<string, number>} dim name -> size
 * @throws {ArtifactError} naming the input whose rank or size disagrees with the manifest or another input
 */
export function bindDims(inputs, fed) {
  const bound = new Map();
  const products = [];
  for (const entry of inputs) {
    const dims = fed[entry.name];
    if (dims.length !== entry.shape.length) {
      throw new ArtifactError(
        `input ${JSON.stringify(entry.name)} has shape [${dims}], expected rank ${entry.shape.length} ` +
        `(${JSON.stringify(entry.shape)})`);
    }
    entry.shape.forEach((want, axis) => {
      const got = dims[axis];
      if (typeof want === 'number') {
        if (got !== want) {
          throw new ArtifactError(`input ${JSON.stringify(entry.name)} has ${got} at axis ${axis}, expected ${want}`);
        }
      } else if (want.includes('*')) {
        products.push([entry.name, axis, want, got]);
      } else if (!bound.has(want)) {
        bound.set(want, got);
      } else if (bound.get(want) !== got) {
        throw new ArtifactError(
          `input ${JSON.stringify(entry.name)} has ${got} at axis ${axis} (dim ${JSON.stringify(want)}), but another ` +
          `input set ${JSON.stringify(want)} to ${bound.get(want)}`);
      }
    });
  }
  for (const [name, axis, expression, got] of products) {
    const want = evaluateDim(expression, bound);
    if (want !== got) {
      throw new ArtifactError(`input ${JSON.stringify(name)} has ${got} at axis ${axis}, expected ${expression} = ${want}`);
    }
  }
  return bound;
}

/**
 * The size of one shape entry: an integer, a dim name, or a product of dim names and integers joined by "*".
 * @param {number|string} entry
 * @param {Map<string, number>} bound  from bindDims
 * @returns {number}
 * @throws {ArtifactError} when a dim it needs is bound by no input fed
 */
export function evaluateDim(entry, bound) {
  if (typeof entry === 'number') return entry;
  return entry.split('*').reduce((product, factor) => {
    if (/^[0-9]+$/.test(factor)) return product * Number(factor);
    if (!bound.has(factor)) {
      throw new ArtifactError(`dim ${JSON.stringify(factor)} (in ${JSON.stringify(entry)}) is set by no input fed`);
    }
    return product * bound.get(factor);
  }, 1);
}
