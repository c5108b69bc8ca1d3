// Node.js loader: an artifact folder on disk, onnxruntime-node (or onnxruntime-web under node) passed in, and the
// state saved back to a file.

import {readFile, rename, writeFile} from 'node:fs/promises';
import {join, resolve} from 'node:path';

import {ArtifactError} from './manifest.js';
import {openArtifact} from './trainer.js';

export {ArtifactError} from './manifest.js';
export {ArtifactTrainer, openArtifact} from './trainer.js';
export {SafetensorsError, readSafetensors, writeSafetensors} from './safetensors.js';

async function readPart(path, what) {
  try {
    return await readFile(path);
  } catch (e) {
    throw new ArtifactError(`${what} ${path} cannot be read: ${e.code ?? e.message}`, {cause: e});
  }
}

/**
 * Open the artifact folder written by ort_trainer.export_training.
 * @param {object} ort  the runtime module (import * as ort from 'onnxruntime-node')
 * @param {string} folder  the artifact folder (manifest.json, the two graphs, the state)
 * @param {import('./trainer.js').OpenOptions & {state?: string}} [options]  state: a state file saved since
 *   (saveState) to resume from, instead of the folder's own
 * @returns {Promise<import('./trainer.js').ArtifactTrainer>}
 * @throws {ArtifactError} naming the file that is missing or does not follow the artifact format
 */
export async function loadArtifact(ort, folder, options = {}) {
  const root = resolve(folder);
  const text = (await readPart(join(root, 'manifest.json'), 'manifest')).toString('utf8');
  let manifest;
  try {
    manifest = JSON.parse(text);
  } catch (e) {
    throw new ArtifactError(`${join(root, 'manifest.json')} is not JSON: ${e.message}`, {cause: e});
  }
  const files = manifest?.files ?? {};
  const file = (key) => (typeof files[key] === 'string' ? join(root, files[key]) : `${root}/<files.${key}>`);
  const statePath = options.state ?? file('state');
  const parts = {
    manifest,
    source: root,
    // the graphs are read here (not opened by path) so that a missing file gets our message, and the same
    // bytes-in route serves node and the browser
    train: new Uint8Array(await readPart(file('train'), 'training graph')),
    eval: new Uint8Array(await readPart(file('eval'), 'eval graph')),
    state: new Uint8Array(await readPart(statePath, 'state')),
  };
  return openArtifact(ort, parts, options);
}

/**
 * Save the trainer's state as a safetensors file (written to a temporary name, then renamed: a crash never leaves
 * half a file under `path`). Python reads it back with ort_trainer's loader.
 * @param {import('./trainer.js').ArtifactTrainer} trainer
 * @param {string} path
 * @returns {Promise<void>}
 */
export async function saveState(trainer, path) {
  const temporary = `${path}.tmp-${process.pid}`;
  await writeFile(temporary, trainer.stateBytes());
  await rename(temporary, path);
}
