// Browser loader: an artifact folder served over HTTP(S), onnxruntime-web passed in, and the state handed back as
// bytes or a Blob (to download, upload or keep in IndexedDB).

import {ArtifactError} from './manifest.js';
import {openArtifact} from './trainer.js';

export {ArtifactError} from './manifest.js';
export {ArtifactTrainer, openArtifact} from './trainer.js';
export {SafetensorsError, readSafetensors, writeSafetensors} from './safetensors.js';

async function fetchBytes(url, what) {
  let response;
  try {
    response = await fetch(url);
  } catch (e) {
    throw new ArtifactError(`${what} ${url} cannot be fetched: ${e.message}`, {cause: e});
  }
  if (!response.ok) throw new ArtifactError(`${what} ${url}: HTTP ${response.status} ${response.statusText}`);
  return new Uint8Array(await response.arrayBuffer());
}

/**
 * Open an artifact folder served at a base URL.
 * @param {object} ort  the runtime module (import * as ort from 'onnxruntime-web')
 * @param {string|URL} baseUrl  the folder's URL (a missing trailing "/" is added); relative URLs resolve against
 *   the page
 * @param {import('./trainer.js').OpenOptions & {state?: Uint8Array|Blob|string|URL}} [options]  state: a state
 *   saved since (its bytes, a Blob, or a URL) to resume from, instead of the folder's own
 * @returns {Promise<import('./trainer.js').ArtifactTrainer>}
 * @throws {ArtifactError} naming the URL that failed or the part that does not follow the artifact format
 */
export async function loadArtifact(ort, baseUrl, options = {}) {
  let base = new URL(baseUrl, globalThis.location?.href);
  if (!base.pathname.endsWith('/')) base = new URL(`${base.pathname}/${base.search}`, base);
  const manifestUrl = new URL('manifest.json', base);
  const text = new TextDecoder().decode(await fetchBytes(manifestUrl, 'manifest'));
  let manifest;
  try {
    manifest = JSON.parse(text);
  } catch (e) {
    throw new ArtifactError(`${manifestUrl} is not JSON: ${e.message}`, {cause: e});
  }
  const files = manifest?.files ?? {};
  const url = (key) => new URL(typeof files[key] === 'string' ? files[key] : `files.${key}`, base);
  let state = options.state ?? url('state');
  if (typeof Blob !== 'undefined' && state instanceof Blob) state = new Uint8Array(await state.arrayBuffer());
  else if (!(state instanceof Uint8Array)) state = await fetchBytes(new URL(state, base), 'state');
  const parts = {
    manifest,
    source: base.href.replace(/\/$/, ''),
    train: await fetchBytes(url('train'), 'training graph'),
    eval: await fetchBytes(url('eval'), 'eval graph'),
    state,
  };
  return openArtifact(ort, parts, options);
}

/**
 * The trainer's state as a safetensors Blob (e.g. for a download link: URL.createObjectURL(stateBlob(trainer))).
 * @param {import('./trainer.js').ArtifactTrainer} trainer
 * @returns {Blob}
 */
export function stateBlob(trainer) {
  return new Blob([trainer.stateBytes()], {type: 'application/octet-stream'});
}
