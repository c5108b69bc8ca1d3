// The draws a training step is fed for its "random" inputs (Dropout masks and the like): uniform in [0, 1) or
// standard normal. xoshiro128** seeded through splitmix32: small, fast, the same sequence in node and every
// browser for a given seed (Math.random cannot be seeded).

function splitmix32(seed) {
  let state = seed >>> 0;
  return () => {
    state = (state + 0x9e3779b9) >>> 0;
    let z = state;
    z = Math.imul(z ^ (z >>> 16), 0x85ebca6b) >>> 0;
    z = Math.imul(z ^ (z >>> 13), 0xc2b2ae35) >>> 0;
    return (z ^ (z >>> 16)) >>> 0;
  };
}

/** A seedable source of uniform and normal samples. */
export class RandomSource {
  /**
   * @param {number} [seed]  an integer; when left out, one is drawn from crypto.getRandomValues
   */
  constructor(seed = undefined) {
    if (seed === undefined) {
      seed = globalThis.crypto.getRandomValues(new Uint32Array(1))[0];
    }
    if (!Number.isSafeInteger(seed)) throw new TypeError(`seed is ${seed}, expected an integer`);
    const next = splitmix32(seed);
    this.s = new Uint32Array([next(), next(), next(), next()]);
  }

  /** @returns {number} the next 32 random bits as an unsigned integer */
  nextUint32() {
    const s = this.s;
    const result = Math.imul(rotl(Math.imul(s[1], 5), 7), 9) >>> 0;
    const t = s[1] << 9;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 11);
    return result;
  }

  /**
   * Fill an array with samples.
   * @param {Float32Array|Float64Array} out
   * @param {'uniform'|'normal'} kind  uniform in [0, 1) (24 random bits, exact in float32), or standard normal
   *   (Box-Muller)
   * @returns {Float32Array|Float64Array} out
   */
  fill(out, kind) {
    if (kind === 'uniform') {
      for (let i = 0; i < out.length; i++) out[i] = (this.nextUint32() >>> 8) / 16777216;
    } else if (kind === 'normal') {
      for (let i = 0; i < out.length; i += 2) {
        const u1 = ((this.nextUint32() >>> 8) + 1) / 16777217; // in (0, 1): log is finite
        const u2 = (this.nextUint32() >>> 8) / 16777216;
        const r = Math.sqrt(-2 * Math.log(u1));
        out[i] = r * Math.cos(2 * Math.PI * u2);
        if (i + 1 < out.length) out[i + 1] = r * Math.sin(2 * Math.PI * u2);
      }
    } else {
      throw new TypeError(`random kind ${JSON.stringify(kind)}, expected "uniform" or "normal"`);
    }
    return out;
  }
}

function rotl(x, k) {
  return ((x << k) | (x >>> (32 - k))) >>> 0;
}
