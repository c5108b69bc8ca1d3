// The core of the driver: one training artifact held in two ONNX Runtime sessions, the state between steps, and
// the train and eval steps that follow manifest.json. It imports no runtime and touches no file: the runtime
// module (onnxruntime-node or onnxruntime-web) is passed in, and the loaders (node.js, browser.js) read the files.

import {ArtifactError, FORMAT, bindDims, checkManifest, evaluateDim} from './manifest.js';
import {RandomSource} from './random.js';
import {elementCount, readSafetensors, writeSafetensors} from './safetensors.js';

const TYPED = {
  float32: Float32Array, float64: Float64Array, int64: BigInt64Array, int32: Int32Array, int16: Int16Array,
  int8: Int8Array, uint8: Uint8Array, uint16: Uint16Array, uint32: Uint32Array, uint64: BigUint64Array,
  bool: Uint8Array, float16: Uint16Array,
};

function sameDims(a, b) {
  return a.length === b.length && a.every((d, i) => Number(d) === Number(b[i]));
}

/**
 * @typedef {object} TensorLike
 * @property {string} [type]  ONNX Runtime type ("float32", "int64", ...); when given, it must be the manifest's
 * @property {ArrayBufferView|number[]|bigint[]} data  row-major values (a plain array is converted)
 * @property {readonly number[]} dims  shape
 */

/**
 * @typedef {object} OpenOptions
 * @property {object} [sessionOptions]  passed to InferenceSession.create (e.g. {intraOpNumThreads: 1})
 * @property {number} [seed]  seed of the random inputs' draws (default: from crypto.getRandomValues)
 */

/**
 * Open an artifact whose parts are already at hand (the loaders of node.js and browser.js call this).
 * @param {object} ort  the runtime module: onnxruntime-node or onnxruntime-web
 * @param {object} parts
 * @param {object} parts.manifest  the parsed manifest.json
 * @param {string|Uint8Array} parts.train  the training graph: bytes, or a path/URL the runtime opens itself
 * @param {string|Uint8Array} parts.eval  the eval graph, likewise
 * @param {Uint8Array} parts.state  the bytes of a state safetensors file (the artifact's, or one saved since)
 * @param {string} [parts.source]  how to name the artifact in errors (its folder or URL)
 * @param {OpenOptions} [options]
 * @returns {Promise<ArtifactTrainer>}
 * @throws {ArtifactError} for a manifest, state or graph that does not follow the artifact format
 */
export async function openArtifact(ort, parts, options = {}) {
  const source = parts.source ?? 'artifact';
  let manifest;
  try {
    manifest = checkManifest(parts.manifest);
  } catch (e) {
    throw new ArtifactError(`${source}/${e.message}`, {cause: e});
  }
  const {state, step} = readState(ort, manifest, parts.state, `${source}: state`);
  const sessionOptions = options.sessionOptions ?? {};
  const trainSession = await createSession(ort, parts.train, sessionOptions, `${source}: ${manifest.files.train}`);
  const evalSession = await createSession(ort, parts.eval, sessionOptions, `${source}: ${manifest.files.eval}`);
  checkSession(trainSession, manifest.train.inputs,
    [manifest.train.loss, ...Object.values(manifest.train.updated), ...(manifest.train.extra_outputs ?? [])],
    `${source}: ${manifest.files.train}`);
  checkSession(evalSession, manifest.eval.inputs, manifest.eval.outputs, `${source}: ${manifest.files.eval}`);
  return new ArtifactTrainer(ort, manifest, trainSession, evalSession, state, step, new RandomSource(options.seed));
}

async function createSession(ort, model, sessionOptions, where) {
  try {
    return await ort.InferenceSession.create(model, sessionOptions);
  } catch (e) {
    throw new ArtifactError(`${where}: ONNX Runtime could not load the graph: ${e?.message ?? e}`, {cause: e});
  }
}

function checkSession(session, inputs, outputs, where) {
  const have = new Set(session.inputNames);
  const want = new Set(inputs);
  const missing = inputs.filter((n) => !have.has(n));
  const extra = session.inputNames.filter((n) => !want.has(n));
  if (missing.length || extra.length) {
    throw new ArtifactError(
      `${where}: the graph's inputs differ from manifest.json's list: not in the graph ${JSON.stringify(missing)}, ` +
      `not in the manifest ${JSON.stringify(extra)}`);
  }
  const outs = new Set(session.outputNames);
  const absent = outputs.filter((n) => !outs.has(n));
  if (absent.length) {
    throw new ArtifactError(`${where}: manifest.json names outputs the graph does not have: ${JSON.stringify(absent)}`);
  }
}

function readState(ort, manifest, bytes, where) {
  const {tensors, metadata} = readSafetensors(bytes, where);
  if (metadata.format !== undefined && metadata.format !== FORMAT) {
    throw new ArtifactError(`${where}: __metadata__.format is ${JSON.stringify(metadata.format)}, expected ${JSON.stringify(FORMAT)}`);
  }
  let step = manifest.step;
  if (metadata.step !== undefined) {
    if (!/^[0-9]+$/.test(metadata.step) || !Number.isSafeInteger(Number(metadata.step))) {
      throw new ArtifactError(`${where}: __metadata__.step is ${JSON.stringify(metadata.step)}, expected an integer >= 0`);
    }
    step = Number(metadata.step);
  }
  const state = new Map();
  for (const entry of manifest.state) {
    const tensor = tensors.get(entry.name);
    if (!tensor) throw new ArtifactError(`${where}: no tensor ${JSON.stringify(entry.name)}, which manifest.json lists`);
    if (tensor.type !== entry.dtype || !sameDims(tensor.dims, entry.shape)) {
      throw new ArtifactError(
        `${where}: tensor ${JSON.stringify(entry.name)} is ${tensor.type} [${tensor.dims}], manifest.json says ` +
        `${entry.dtype} [${entry.shape}]`);
    }
    state.set(entry.name, new ort.Tensor(tensor.type, tensor.data, tensor.dims));
  }
  const unknown = [...tensors.keys()].filter((name) => !state.has(name));
  if (unknown.length) {
    throw new ArtifactError(`${where}: tensors that manifest.json does not list: ${JSON.stringify(unknown)}`);
  }
  return {state, step};
}

/**
 * A training artifact ready to train: the train and eval sessions and the current state. Made by openArtifact
 * (or the loaders loadArtifact of node.js and browser.js).
 */
export class ArtifactTrainer {
  /** @hideconstructor */
  constructor(ort, manifest, trainSession, evalSession, state, step, random) {
    this.ort = ort;
    /** The checked manifest.json. */
    this.manifest = manifest;
    this.trainSession = trainSession;
    this.evalSession = evalSession;
    this.state = state;
    this.random = random;
    this.stepCount = step;
    this.busy = false;
    this.inputs = new Map(manifest.inputs.map((e) => [e.name, e]));
    this.randoms = new Map((manifest.random ?? []).map((e) => [e.name, e]));
  }

  /** @returns {number} the number of updates applied to the state so far */
  get step() {
    return this.stepCount;
  }

  /**
   * The current value of one state tensor (parameter, buffer or optimizer state).
   * @param {string} name  a name of manifest.json's "state"
   * @returns {object} an ONNX Runtime Tensor (do not modify it: it is fed to the next step)
   * @throws {ArtifactError} for a name that is not a state tensor
   */
  stateTensor(name) {
    const tensor = this.state.get(name);
    if (!tensor) throw new ArtifactError(`no state tensor ${JSON.stringify(name)}`);
    return tensor;
  }

  /**
   * One training update: forward, backward, (clipping,) optimizer update. The step number fed is this.step + 1,
   * and every state tensor named in manifest.json's "train.updated" is replaced by its output. When the run
   * fails, the state and the step are left as they were.
   * @param {Object<string, TensorLike>} batch  every batch input of manifest.json's "inputs" the graph reads;
   *   a "random" input may be given too (then it is fed as given instead of drawn)
   * @param {{lr: number}} options  this update's learning rate
   * @returns {Promise<{loss: number, step: number, outputs: Object<string, object>}>} the loss, the step number
   *   of this update and the extra outputs (e.g. grad_norm) as Tensors
   * @throws {ArtifactError|TypeError} for a batch that does not fit the manifest (named), or a failed run
   */
  async trainStep(batch, {lr} = {}) {
    if (typeof lr !== 'number' || !Number.isFinite(lr)) throw new TypeError(`lr is ${lr}, expected a finite number`);
    const train = this.manifest.train;
    const step = this.stepCount + 1;
    const scalars = {
      lr: new this.ort.Tensor('float32', new Float32Array([lr]), []),
      step: new this.ort.Tensor('int64', new BigInt64Array([BigInt(step)]), []),
    };
    const feeds = this._feeds(train.inputs, batch, scalars, 'train');
    const outputs = await this._run(this.trainSession, feeds, `train step ${step}`);
    const updated = new Map();
    for (const [name, output] of Object.entries(train.updated)) {
      const value = outputs[output];
      const before = this.state.get(name);
      if (value.type !== before.type || !sameDims(value.dims, before.dims)) {
        throw new ArtifactError(
          `train step ${step}: output ${JSON.stringify(output)} for ${JSON.stringify(name)} is ${value.type} ` +
          `[${value.dims}], expected ${before.type} [${before.dims}]`);
      }
      updated.set(name, value);
    }
    for (const [name, value] of updated) this.state.set(name, value);
    this.stepCount = step;
    const extra = Object.fromEntries((train.extra_outputs ?? []).map((n) => [n, outputs[n]]));
    return {loss: Number(outputs[train.loss].data[0]), step, outputs: extra};
  }

  /**
   * One forward pass of the eval graph on the current state (no update).
   * @param {Object<string, TensorLike>} batch  the batch inputs manifest.json's "eval.inputs" lists
   * @returns {Promise<{loss: number|undefined, outputs: Object<string, object>}>} the loss when the graph has a
   *   "loss" output, and every output of "eval.outputs" as Tensors
   * @throws {ArtifactError|TypeError} for a batch that does not fit the manifest (named), or a failed run
   */
  async evalStep(batch) {
    const names = this.manifest.eval.inputs;
    const outputs = await this._run(this.evalSession, this._feeds(names, batch, {}, 'eval'), 'eval step');
    const wanted = Object.fromEntries(this.manifest.eval.outputs.map((n) => [n, outputs[n]]));
    const loss = wanted.loss === undefined ? undefined : Number(wanted.loss.data[0]);
    return {loss, outputs: wanted};
  }

  /**
   * The current state as a safetensors file: the tensors of manifest.json's "state" in its order, and
   * __metadata__ {"format": "ort_trainer.training_artifact", "step": "<updates applied>"}.
   * @returns {Uint8Array}
   */
  stateBytes() {
    const tensors = this.manifest.state.map((e) => [e.name, this.state.get(e.name)]);
    return writeSafetensors(tensors, {format: FORMAT, step: String(this.stepCount)});
  }

  /** Release both sessions (the trainer cannot be used afterwards). */
  async release() {
    await this.trainSession.release();
    await this.evalSession.release();
  }

  // the feeds of one run, every batch value checked against the manifest (internal)
  _feeds(names, batch, scalars, phase) {
    if (batch === null || typeof batch !== 'object') throw new TypeError(`${phase} batch is ${batch}, expected an object`);
    const wanted = new Set(names);
    for (const key of Object.keys(batch)) {
      if (!wanted.has(key) || this.state.has(key) || key in scalars) {
        const expected = names.filter((n) => this.inputs.has(n) || this.randoms.has(n));
        throw new ArtifactError(`${phase} batch has ${JSON.stringify(key)}, which the ${phase} graph does not take ` +
          `as a batch or random input (it takes ${JSON.stringify(expected)})`);
      }
    }
    const fed = {};
    const given = {};
    for (const name of names) {
      const entry = this.inputs.get(name);
      if (!entry) continue;
      if (!(name in batch)) throw new ArtifactError(`${phase} batch has no ${JSON.stringify(name)} (${entry.dtype} ${JSON.stringify(entry.shape)})`);
      given[name] = this._toTensor(batch[name], entry.dtype, `${phase} input ${JSON.stringify(name)}`);
      fed[name] = given[name].dims;
    }
    const bound = bindDims(names.filter((n) => this.inputs.has(n)).map((n) => this.inputs.get(n)), fed);
    const feeds = {};
    for (const name of names) {
      if (this.state.has(name)) feeds[name] = this.state.get(name);
      else if (name in scalars) feeds[name] = scalars[name];
      else if (name in given) feeds[name] = given[name];
      else {
        const entry = this.randoms.get(name);
        const dims = entry.shape.map((d) => evaluateDim(d, bound));
        if (name in batch) {
          const tensor = this._toTensor(batch[name], entry.dtype, `${phase} random input ${JSON.stringify(name)}`);
          if (!sameDims(tensor.dims, dims)) {
            throw new ArtifactError(`${phase} random input ${JSON.stringify(name)} has shape [${tensor.dims}], expected [${dims}] (${JSON.stringify(entry.shape)})`);
          }
          feeds[name] = tensor;
        } else {
          const data = this.random.fill(new TYPED[entry.dtype](elementCount(dims)), entry.kind);
          feeds[name] = new this.ort.Tensor(entry.dtype, data, dims);
        }
      }
    }
    return feeds;
  }

  // a batch value as an ort.Tensor of the manifest's dtype, or a TypeError naming it (internal)
  _toTensor(value, dtype, where) {
    if (value === null || typeof value !== 'object' || !('data' in value) || !('dims' in value)) {
      throw new TypeError(`${where} is ${value}, expected a Tensor or {data, dims}`);
    }
    if (value.type !== undefined && value.type !== dtype) {
      throw new TypeError(`${where} is ${value.type}, expected ${dtype}`);
    }
    const dims = Array.from(value.dims, Number);
    if (!dims.every((d) => Number.isSafeInteger(d) && d >= 0)) {
      throw new TypeError(`${where} has dims ${JSON.stringify(value.dims)}, expected integers >= 0`);
    }
    const Typed = TYPED[dtype];
    let data = value.data;
    if (!ArrayBuffer.isView(data)) {
      if (!Array.isArray(data)) throw new TypeError(`${where}: data is neither a typed array nor an array`);
      data = Typed === BigInt64Array || Typed === BigUint64Array ? Typed.from(data, (x) => BigInt(x)) : Typed.from(data);
    } else if (!(data instanceof Typed)) {
      throw new TypeError(`${where}: data is a ${data.constructor.name}, expected a ${Typed.name} for ${dtype}`);
    }
    if (data.length !== elementCount(dims)) {
      throw new ArtifactError(`${where} has ${data.length} values, expected ${elementCount(dims)} for shape [${dims}]`);
    }
    if (value instanceof this.ort.Tensor && data === value.data) return value;
    return new this.ort.Tensor(dtype, data, dims);
  }

  // one session run, one at a time; ORT's errors said with the step they failed in (internal)
  async _run(session, feeds, what) {
    if (this.busy) throw new Error(`${what}: another step of this trainer is still running (await each step)`);
    this.busy = true;
    try {
      return await session.run(feeds);
    } catch (e) {
      throw new ArtifactError(`${what} failed in ONNX Runtime: ${e?.message ?? e}`, {cause: e});
    } finally {
      this.busy = false;
    }
  }
}
