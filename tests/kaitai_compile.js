// Compile a .ksy with kaitai-struct-compiler (npm, >= 0.11), like `kaitai-struct-compiler -t TARGET`.
// usage: node kaitai_compile.js KSC_DIR KSY_FILE OUT_DIR [TARGET]   (TARGET: python (default), javascript, java, ...)
// KSC_DIR is the npm prefix holding node_modules/{kaitai-struct-compiler,js-yaml}.
// Prints the written file names; exits 1 with the compiler's message on error.
'use strict';
const fs = require('fs');
const path = require('path');

async function main() {
  const [kscDir, ksyFile, outDir, target = 'python'] = process.argv.slice(2);
  if (!outDir) {
    console.error('usage: node kaitai_compile.js KSC_DIR KSY_FILE OUT_DIR [TARGET]');
    process.exit(2);
  }
  const modules = path.join(path.resolve(kscDir), 'node_modules');
  const compiler = require(path.join(modules, 'kaitai-struct-compiler'));
  const yaml = require(path.join(modules, 'js-yaml'));
  const spec = yaml.load(fs.readFileSync(ksyFile, 'utf8'));
  const files = await compiler.compile(target, spec, null, false);
  for (const [name, source] of Object.entries(files)) {
    const relative = name.replace(/^\/+/, '');   // the Java target names its file "/Leanimg.java"
    fs.mkdirSync(path.dirname(path.join(outDir, relative)), { recursive: true });
    fs.writeFileSync(path.join(outDir, relative), source);
    console.log(relative);
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
