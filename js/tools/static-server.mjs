// A static HTTP server for the tests and benchmarks that drive a page in Chromium: it listens on 127.0.0.1 only
// (port chosen by the system), serves a few folders under URL prefixes, and nothing outside them.

import {createReadStream} from 'node:fs';
import {stat} from 'node:fs/promises';
import {createServer} from 'node:http';
import {extname, resolve, sep} from 'node:path';

const TYPES = {
  '.html': 'text/html; charset=utf-8', '.js': 'text/javascript', '.mjs': 'text/javascript',
  '.json': 'application/json', '.wasm': 'application/wasm', '.css': 'text/css', '.png': 'image/png',
  '.md': 'text/plain; charset=utf-8',
};

/**
 * Serve folders under URL prefixes on 127.0.0.1.
 * @param {Object<string, string>} roots  URL prefix ("/ort/") -> folder
 * @returns {Promise<{origin: string, close: () => Promise<void>}>}
 */
export async function serve(roots) {
  // the longest prefix first: a folder can be mounted inside another's URL space
  const mounts = Object.entries(roots).map(([prefix, folder]) => [prefix, resolve(folder)])
    .sort((a, b) => b[0].length - a[0].length);
  const server = createServer(async (request, response) => {
    let path = decodeURIComponent(new URL(request.url, 'http://127.0.0.1').pathname);
    if (path.endsWith('/')) path += 'index.html';
    const mount = mounts.find(([prefix]) => path.startsWith(prefix));
    const file = mount && resolve(mount[1], `.${sep}${path.slice(mount[0].length)}`);
    // cross-origin isolation: lets onnxruntime-web use SharedArrayBuffer (threads) when asked for more than one
    const headers = {'Cross-Origin-Opener-Policy': 'same-origin', 'Cross-Origin-Embedder-Policy': 'require-corp',
      'Cache-Control': 'no-store'};
    if (!file || !(file === mount[1] || file.startsWith(mount[1] + sep)) || !(await stat(file).catch(() => null))?.isFile()) {
      response.writeHead(404, headers).end(`not found: ${path}`);
      return;
    }
    response.writeHead(200, {...headers, 'Content-Type': TYPES[extname(file)] ?? 'application/octet-stream'});
    createReadStream(file).pipe(response);
  });
  await new Promise((done, failed) => server.once('error', failed).listen(0, '127.0.0.1', done));
  const origin = `http://127.0.0.1:${server.address().port}`;
  return {origin, close: () => new Promise((done) => server.close(() => done()))};
}
