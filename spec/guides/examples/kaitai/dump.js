// Parse lean images with the JavaScript parser generated from ksy/leanimg.ksy and print
// every field as JSON, one line per file (the shape is described in spec/guides/kaitai.md).
//
// usage: node dump.js GENERATED_DIR IMAGE...
//   GENERATED_DIR holds Leanimg.js (kaitai-struct-compiler -t javascript); the runtime,
//   npm package kaitai-struct 0.11, must be resolvable from it (node_modules or NODE_PATH).
// Exit status 1 when an image did not parse (its line then carries "error").
'use strict';
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');

const SHORT_BYTES = 64;   // longer byte strings are printed as their size and SHA-256

function snakeCase(name) {
  return name.replace(/[A-Z]/g, (c) => '_' + c.toLowerCase());
}

function isStruct(value) {
  return value !== null && typeof value === 'object' && '_io' in value && '_root' in value;
}

function bytesJson(bytes) {
  if (bytes.length <= SHORT_BYTES) {
    return `{"hex":"${Buffer.from(bytes).toString('hex')}"}`;
  }
  const sha256 = crypto.createHash('sha256').update(bytes).digest('hex');
  return `{"size":${bytes.length},"sha256":"${sha256}"}`;
}

// Numbers are JavaScript doubles: a u8 above 2^53 has lost its low bits in the runtime;
// it is printed as the exact integer the double holds.
function numberJson(value) {
  return Number.isSafeInteger(value) ? String(value) : BigInt(value).toString();
}

function valueJson(value, atRoot) {
  if (value === null || value === undefined) return 'null';
  if (typeof value === 'number') return numberJson(value);
  if (typeof value === 'boolean') return String(value);
  if (typeof value === 'string') return JSON.stringify(value);
  if (value instanceof Uint8Array) return bytesJson(value);
  if (Array.isArray(value)) return '[' + value.map((item) => valueJson(item, false)).join(',') + ']';
  if (isStruct(value)) return structJson(value, atRoot);
  throw new TypeError(`cannot print a ${value.constructor && value.constructor.name}`);
}

// The instances of a struct: getters on its prototype. Struct-valued instances below the root
// (footer.index, index_entry.record) re-read records already printed in "records": left out.
function instanceNames(struct) {
  const descriptors = Object.getOwnPropertyDescriptors(Object.getPrototypeOf(struct));
  return Object.keys(descriptors).filter((name) => descriptors[name].get);
}

function structJson(struct, atRoot) {
  const parts = [`"_type":${JSON.stringify(struct.constructor.name)}`];
  for (const [name, value] of Object.entries(struct)) {        // seq fields, in read order
    if (value === undefined || (name.startsWith('_') && !name.startsWith('_raw_'))) continue;
    parts.push(`${JSON.stringify(snakeCase(name))}:${valueJson(value, false)}`);
  }
  for (const name of instanceNames(struct)) {
    const value = struct[name];
    if (value === undefined || (isStruct(value) && !atRoot)) continue;
    parts.push(`${JSON.stringify(snakeCase(name))}:${valueJson(value, false)}`);
  }
  return '{' + parts.join(',') + '}';
}

function main() {
  const [generatedDir, ...images] = process.argv.slice(2);
  if (!images.length) {
    console.error('usage: node dump.js GENERATED_DIR IMAGE...');
    process.exit(2);
  }
  const KaitaiStream = require(require.resolve('kaitai-struct/KaitaiStream',
    { paths: [path.resolve(generatedDir), ...(process.env.NODE_PATH || '').split(path.delimiter)] }));
  const Leanimg = require(path.resolve(generatedDir, 'Leanimg.js')).Leanimg;
  let failed = false;
  for (const image of images) {
    let line;
    try {
      const parsed = new Leanimg(new KaitaiStream(fs.readFileSync(image)));
      line = `{"file":${JSON.stringify(image)},"leanimg":${structJson(parsed, true)}}`;
    } catch (err) {
      failed = true;
      line = JSON.stringify({ file: image, error: `${err.name}: ${err.message}` });
    }
    process.stdout.write(line + '\n');
  }
  process.exitCode = failed ? 1 : 0;
}

main();
