// Compile a .ksy to Python with kaitai-struct-compiler (npm, >= 0.11).
// usage: node kaitai_compile.js KSC_DIR KSY_FILE OUT_DIR
// KSC_DIR is the npm prefix holding node_modules/{kaitai-struct-compiler,js-yaml}.
// Prints the written file names; exits 1 with the compiler's message on error.
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const [kscDir, ksyFile, outDir] = process.argv.slice(2);
  if (!outDir) {
    console.error('usage: node kaitai_compile.js KSC_DIR KSY_FILE OUT_DIR');
    process.exit(2);
  }
  const modules = path.join(path.resolve(kscDir), 'node_modules');
  const compiler = require(path.join(modules, 'kaitai-struct-compiler'));
  const yaml = require(path.join(modules, 'js-yaml'));
  const spec = yaml.load(fs.readFileSync(ksyFile, 'utf8'));
  const files = await compiler.compile('python', spec, null, false);
  fs.mkdirSync(outDir, { recursive: true });
  for (const [name, source] of Object.entries(files)) {
    fs.writeFileSync(path.join(outDir, name), source);
    console.log(name);
  }
}

main().catch((err) => {
  // The compiler throws Scala.js exceptions; their text is in toString().
  console.error(`kaitai-struct-compiler: ${err && (err.stack || err.toString())}`);
  if (err && err.toString && err.stack && !err.stack.includes(err.toString())) {
    console.error(err.toString());
  }
  process.exit(1);
});
