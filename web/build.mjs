// Bundles web/src/main.js into web/dist/app.js (ESM, not minified). Preact,
// its hooks and htm are taken from their published *sources* in
// node_modules (not their minified dist files), so what the browser runs is
// readable. `make setup` runs it after `npm ci`.
import { build } from 'esbuild';
import { fileURLToPath } from 'node:url';
import path from 'node:path';

const here = path.dirname(fileURLToPath(import.meta.url));
const nm = (p) => path.join(here, 'node_modules', p);

await build({
  entryPoints: [path.join(here, 'src', 'main.js')],
  outfile: path.join(here, 'dist', 'app.js'),
  bundle: true,
  format: 'esm',
  target: 'es2022',
  minify: false,
  legalComments: 'inline',
  alias: {
    'preact/hooks': nm('preact/hooks/src/index.js'),
    preact: nm('preact/src/index.js'),
    htm: nm('htm/src/index.mjs'),
  },
  logLevel: 'warning',
});
