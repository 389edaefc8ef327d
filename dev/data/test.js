#!/usr/bin/env node
// test.js: self-contained checks for prepare.js (no test framework). Writes only to a temporary
// directory. Prints `ok - ...` / `FAIL - ...` per check and, last, `N passed, M failed`; exits 1 on
// any failure.
//   node dev/data/test.js
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const { spawnSync } = require('child_process');

const PREPARE = path.join(__dirname, 'prepare.js');

let passed = 0;
let failed = 0;

function check(name, fn) {
  let problem = null;
  try {
    const res = fn();
    if (res !== true && res !== undefined) problem = String(res);
  } catch (err) {
    problem = err && err.message ? err.message : String(err);
  }
  if (problem === null) {
    passed++;
    console.log(`ok - ${name}`);
  } else {
    failed++;
    console.log(`FAIL - ${name}: ${problem.split('\n')[0]}`);
  }
}

function expectEqual(actual, expected, what) {
  const a = JSON.stringify(actual);
  const e = JSON.stringify(expected);
  if (a !== e) throw new Error(`${what}: got ${a.slice(0, 200)}, expected ${e.slice(0, 200)}`);
}

/** Runs prepare.js as a child process (quiet), returns { status, stdout, stderr }. */
function runPrepare(args) {
  const res = spawnSync(process.execPath, [PREPARE, ...args], { encoding: 'utf8', cwd: os.tmpdir() });
  if (res.error) throw res.error;
  return res;
}

/** Parses a tokenizer file: { header: [uint32 x 256], tokens: [Buffer] }. */
function readTokenizer(file) {
  const buf = fs.readFileSync(file);
  const header = [];
  for (let i = 0; i < 256; i++) header.push(buf.readUInt32LE(4 * i));
  const tokens = [];
  let pos = 1024;
  for (let id = 0; id < header[2]; id++) {
    if (pos >= buf.length) throw new Error(`tokenizer file ends at token ${id}`);
    const len = buf.readUInt8(pos);
    tokens.push(buf.subarray(pos + 1, pos + 1 + len));
    pos += 1 + len;
  }
  if (pos !== buf.length) throw new Error(`tokenizer file has ${buf.length - pos} trailing bytes`);
  return { header, tokens };
}

/** Parses a token shard: { header: [int32 x 256], tokens: [number], size }. */
function readShard(file) {
  const buf = fs.readFileSync(file);
  const header = [];
  for (let i = 0; i < 256; i++) header.push(buf.readInt32LE(4 * i));
  const tokens = [];
  for (let pos = 1024; pos + 1 < buf.length; pos += 2) tokens.push(buf.readUInt16LE(pos));
  return { header, tokens, size: buf.length };
}

/** Concatenates the byte strings of the given token ids. */
function decodeBytes(table, ids) {
  return Buffer.concat(ids.map((id) => table[id]));
}

function checkShardHeader(shard) {
  expectEqual(shard.header.slice(0, 2), [20240520, 1], 'magic, version');
  if (shard.size !== 1024 + 2 * shard.header[2]) {
    throw new Error(`count ${shard.header[2]} does not match file size ${shard.size}`);
  }
  if (shard.header.slice(3).some((x) => x !== 0)) throw new Error('header words 3..255 not zero');
  if (shard.tokens[0] !== 50256) throw new Error(`first token is ${shard.tokens[0]}, not EOT`);
}

function main() {
  let prep;
  check('prepare.js loads as a module', () => {
    prep = require(PREPARE);
    if (typeof prep.prepare !== 'function' || typeof prep.encode !== 'function') return 'missing exports';
  });
  if (!prep) {
    console.log(`${passed} passed, ${failed} failed`);
    process.exit(1);
  }

  const tmp = fs.mkdtempSync(path.join(os.tmpdir(), 'llm5d-data-test-'));
  try {
    const samples = [
      'Hello world',
      'naïve café — 東京',
      'The quick brown fox\n\n  jumps over 12,345 lazy dogs; it\'s "fine" 🙂.\t\r\nEnd',
    ];

    check('"Hello world" encodes to [15496, 995]', () => expectEqual(prep.encode('Hello world'), [15496, 995], 'tokens'));

    check('"<|endoftext|>" inside text is encoded as ordinary text', () => {
      const toks = prep.encode('a<|endoftext|>b');
      if (toks.includes(50256)) return `got EOT in ${JSON.stringify(toks)}`;
    });

    check('chunked encoding equals whole-text encoding', () => {
      const parts = [];
      for (let i = 0; parts.join('').length < 300000; i++) {
        parts.push(`Line ${i}: ${samples[i % samples.length]}${i % 7 === 0 ? '  \n\n' : '\n'}`);
      }
      const text = parts.join('');
      const sink = new prep.TokenBuffer();
      let chunks = 0;
      prep.encodeInto(sink, text, () => chunks++);
      if (chunks < 2) return `text was not split (chunks=${chunks})`;
      expectEqual(Array.from(sink.tokens()), prep.encode(text), 'tokens');
    });

    const tokPath = path.join(tmp, 'tok', 'gpt2_tokenizer.bin');
    const singleFile = path.join(tmp, 'single.txt');
    const singleText = `${Array.from({ length: 60 }, (_, i) => `${i}: ${samples[i % samples.length]}`).join('\n')}\n`;
    fs.writeFileSync(singleFile, singleText);
    const outSingle = path.join(tmp, 'single');

    check('CLI on one text file exits 0 (writes shards and tokenizer)', () => {
      const res = runPrepare(['--quiet', '--tokenizer', tokPath, '--out', outSingle, singleFile]);
      if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
      for (const f of [tokPath, path.join(outSingle, 'train.bin'), path.join(outSingle, 'val.bin')]) {
        if (!fs.existsSync(f)) return `missing ${f}`;
      }
      const left = fs.readdirSync(outSingle).filter((f) => f.includes('.tmp'));
      if (left.length) return `temporary files left: ${left}`;
    });

    let table = null;
    check('tokenizer file header is [20240328, 2, 50257, 50256, 0...]', () => {
      const tok = readTokenizer(tokPath);
      table = tok.tokens; // later checks use the table even if the header is wrong
      expectEqual(tok.header.slice(0, 4), [20240328, 2, 50257, 50256], 'header');
      if (tok.header.slice(4).some((x) => x !== 0)) return 'header words 4..255 not zero';
    });

    check('tokenizer file: every token has 1..255 bytes, EOT is "<|endoftext|>"', () => {
      if (!table) return 'no tokenizer';
      const bad = table.findIndex((b) => b.length < 1 || b.length > 255);
      if (bad >= 0) return `token ${bad} has ${table[bad].length} bytes`;
      expectEqual(table[50256].toString('latin1'), '<|endoftext|>', 'EOT');
      expectEqual([table[0], table[198], table[220], table[15496], table[995]].map((b) => b.toString('latin1')),
        ['!', '\n', ' ', 'Hello', ' world'], 'tokens 0, 198, 220, 15496, 995');
    });

    check('tokenizer file equals the in-memory build', () => {
      if (!fs.readFileSync(tokPath).equals(prep.tokenizerFileBuffer())) return 'differs';
    });

    for (const text of samples) {
      check(`tokenizer decodes the tokens of ${JSON.stringify(text)} to its UTF-8 bytes`, () => {
        if (!table) return 'no tokenizer';
        const ids = prep.encode(text);
        const got = decodeBytes(table, ids);
        if (!got.equals(Buffer.from(text, 'utf8'))) return `decoded ${JSON.stringify(got.toString('utf8'))}`;
      });
    }

    check('tokenizer holds raw bytes, not the printable BPE form: the 1-byte tokens are the 256 byte values', () => {
      if (!table) return 'no tokenizer';
      const single = table.filter((b) => b.length === 1).map((b) => b[0]).sort((a, b) => a - b);
      if (single.length !== 256 || single.some((v, i) => v !== i)) return 'single-byte tokens are not the 256 bytes';
    });

    let train = null;
    let val = null;
    check('train shard: header (magic, version, count = file size), EOT first', () => {
      train = readShard(path.join(outSingle, 'train.bin'));
      checkShardHeader(train);
    });

    check('val shard: header (magic, version, count = file size), EOT first, not just EOT', () => {
      val = readShard(path.join(outSingle, 'val.bin'));
      checkShardHeader(val);
      if (val.tokens.length < 2) return `val has ${val.tokens.length} tokens`;
    });

    check('single file: train + val decode back to the file, val is the tail at a line start', () => {
      if (!table || !train || !val) return 'missing inputs';
      const head = decodeBytes(table, train.tokens.slice(1));
      const tail = decodeBytes(table, val.tokens.slice(1));
      if (!Buffer.concat([head, tail]).equals(Buffer.from(singleText, 'utf8'))) return 'text differs';
      if (!head.toString('utf8').endsWith('\n')) return 'train part does not end at a line break';
      const frac = tail.length / (head.length + tail.length);
      if (frac <= 0 || frac > 0.1) return `val is ${(100 * frac).toFixed(1)}% of the text`;
      if (train.tokens.indexOf(50256, 1) >= 0 || val.tokens.indexOf(50256, 1) >= 0) return 'extra EOT';
    });

    check('several files: every Nth file to val, EOT before each document', () => {
      const files = [];
      for (let i = 0; i < 5; i++) {
        const f = path.join(tmp, `doc${i}.txt`);
        fs.writeFileSync(f, `Document number ${i}.\n`);
        files.push(f);
      }
      const out = path.join(tmp, 'multi');
      const res = runPrepare(['-q', '--val-every', '2', `--tokenizer=${tokPath}`, '--out', out, ...files]);
      if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
      const tr = readShard(path.join(out, 'train.bin'));
      const va = readShard(path.join(out, 'val.bin'));
      checkShardHeader(tr);
      checkShardHeader(va);
      const docsOf = (shard) => decodeBytes(table, shard.tokens).toString('utf8').split('<|endoftext|>').slice(1);
      expectEqual(docsOf(tr), [0, 2, 4].map((i) => `Document number ${i}.\n`), 'train documents');
      expectEqual(docsOf(va), [1, 3].map((i) => `Document number ${i}.\n`), 'val documents');
    });

    check('fewer files than --val-every: the last file is held out', () => {
      const files = [0, 1, 2].map((i) => path.join(tmp, `doc${i}.txt`));
      const out = path.join(tmp, 'few');
      const res = runPrepare(['-q', '--tokenizer', tokPath, '--out', out, ...files]);
      if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
      const va = readShard(path.join(out, 'val.bin'));
      expectEqual(decodeBytes(table, va.tokens).toString('utf8'), '<|endoftext|>Document number 2.\n', 'val');
    });

    check('SOTU split rule: every 20th speech held out (11 of 233)', () => {
      const docs = prep.sotuDocuments();
      const split = prep.splitDocuments(docs);
      expectEqual([docs.length, split.train.length, split.val.length], [233, 222, 11], 'counts');
      expectEqual(split.val[0].name, docs[19].name, 'first val document');
    });

    check('missing input file: one-line error, non-zero exit', () => {
      const res = runPrepare(['--tokenizer', tokPath, '--out', path.join(tmp, 'x'), path.join(tmp, 'nope.txt')]);
      if (res.status === 0) return 'exit 0';
      const lines = res.stderr.trim().split('\n');
      if (lines.length !== 1 || !/not found/.test(lines[0])) return `stderr: ${JSON.stringify(res.stderr)}`;
      if (fs.existsSync(path.join(tmp, 'x'))) return 'output directory created anyway';
    });

    check('unknown option: one-line error, non-zero exit', () => {
      const res = runPrepare(['--bogus']);
      if (res.status === 0) return 'exit 0';
      const lines = res.stderr.trim().split('\n');
      if (lines.length !== 1 || !/unknown option/.test(lines[0])) return `stderr: ${JSON.stringify(res.stderr)}`;
    });

    check('--help prints usage and exits 0', () => {
      const res = runPrepare(['--help']);
      if (res.status !== 0) return `exit ${res.status}`;
      if (!/^usage: /.test(res.stdout) || !/--out DIR/.test(res.stdout)) return 'no usage text';
    });
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }

  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed > 0 ? 1 : 0);
}

main();
