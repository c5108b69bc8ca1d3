// The command line both plan runners take: ARTIFACT PLAN_DIR OUT_DIR [--threads N] [--state FILE] [--seed N].

import {parseArgs} from 'node:util';

/**
 * @param {string} script  the runner's name, for the usage message
 * @returns {{artifact: string, planDir: string, outDir: string, threads: number, state: string|undefined,
 *   seed: number}}
 */
export function planArgs(script) {
  const {values, positionals} = parseArgs({
    allowPositionals: true,
    options: {threads: {type: 'string', default: '1'}, state: {type: 'string'}, seed: {type: 'string', default: '0'}},
  });
  const [artifact, planDir, outDir] = positionals;
  if (!outDir) throw new Error(`usage: ${script} ARTIFACT PLAN_DIR OUT_DIR [--threads N] [--state FILE] [--seed N]`);
  return {artifact, planDir, outDir, threads: Number(values.threads), state: values.state, seed: Number(values.seed)};
}
