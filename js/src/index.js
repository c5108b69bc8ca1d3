// The runtime-neutral core: what node.js and browser.js share. Import "./node.js" or "./browser.js" for the
// loaders that read an artifact folder from disk or from a URL.

export {ArtifactError, FORMAT, VERSION, checkManifest} from './manifest.js';
export {RandomSource} from './random.js';
export {SafetensorsError, readSafetensors, writeSafetensors} from './safetensors.js';
export {ArtifactTrainer, openArtifact} from './trainer.js';
