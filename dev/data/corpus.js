// corpus.js: a corpus of .jsonl/.parquet files (documents.js) encoded on every core into llm.c's
// numbered shards, as llm.c's dev/data/fineweb.py writes them: shards of exactly --shard-tokens tokens
// (the last holds the rest), documents in order and cut across a shard boundary where they meet one,
// shard 0 the validation shard: NAME_val_000000.bin, NAME_train_000001.bin, ...
//
// Work: the main thread reads documents and sends batches of about a megabyte of text to worker threads
// (encode_worker.js), at most two batches a worker in flight, and takes the answers back in batch order,
// so the shards do not depend on the number of workers.
//
// Resume: a shard whose file already holds exactly the bytes this run would write is left as it is; any
// other is written to a temporary name and renamed once complete (prepare.js's writeFileAtomic), so a
// killed run leaves whole shards or none. A rerun still encodes everything before the last missing shard,
// since where a shard starts depends on the token counts of all documents before it.
'use strict';

const fs = require('fs');
const os = require('os');
const path = require('path');
const { Worker } = require('worker_threads');
const prep = require('./prepare');
const { corpusFiles, readDocuments } = require('./documents');

const DEFAULT_SHARD_TOKENS = 100000000; // llm.c's fineweb.py --shard_size
const DEFAULT_BATCH_CHARS = 1 << 20;
const BATCHES_PER_WORKER = 2;

/** The number of cores Node may run on. */
function defaultWorkers() {
  return typeof os.availableParallelism === 'function' ? os.availableParallelism() : os.cpus().length;
}

/** llm.c's shard name: NAME_val_000000.bin for shard 0, NAME_train_00000K.bin after it. */
function shardName(name, index) {
  return `${name}_${index === 0 ? 'val' : 'train'}_${String(index).padStart(6, '0')}.bin`;
}

/** Writes `buf` to `file` unless the file holds exactly these bytes; returns whether it wrote. */
function writeIfChanged(file, buf) {
  let same = false;
  try {
    same = fs.statSync(file).size === buf.length && fs.readFileSync(file).equals(buf);
  } catch (_) {
    same = false; // no file yet
  }
  if (!same) prep.writeFileAtomic(file, buf);
  return !same;
}

/** Worker threads that encode batches of documents: encode(texts) -> Promise<Uint32Array>. */
class EncoderPool {
  constructor(count, tokenizerPath, eotText) {
    this.pending = new Map();
    this.nextId = 0;
    this.closing = false;
    this.workers = Array.from({ length: count }, () => {
      const w = new Worker(path.join(__dirname, 'encode_worker.js'), { workerData: { tokenizerPath, eotText } });
      w.on('message', ({ id, tokens }) => {
        this.pending.get(id).resolve(tokens);
        this.pending.delete(id);
      });
      const fail = (err) => {
        for (const p of this.pending.values()) p.reject(err);
        this.pending.clear();
      };
      w.on('error', fail);
      // a worker killed from outside (out of memory) ends without an error event
      w.on('exit', (code) => { if (code !== 0 && !this.closing) fail(new Error(`an encoder worker exited with code ${code}`)); });
      return w;
    });
  }
  encode(texts) {
    const id = this.nextId++;
    return new Promise((resolve, reject) => {
      this.pending.set(id, { resolve, reject });
      this.workers[id % this.workers.length].postMessage({ id, texts });
    });
  }
  close() {
    this.closing = true;
    return Promise.all(this.workers.map((w) => w.terminate()));
  }
}

/** The progress line on stderr: documents, tokens, tokens/s, share of the input read, ETA. */
class Meter {
  constructor(totalBytes, enabled, stream = process.stderr) {
    this.totalBytes = Math.max(1, totalBytes);
    this.enabled = enabled;
    this.stream = stream;
    this.tty = Boolean(stream.isTTY);
    this.started = Date.now();
    this.lastDraw = 0;
  }
  line(docs, tokens, done) {
    const secs = Math.max(1e-3, (Date.now() - this.started) / 1000);
    const frac = Math.min(1, done / this.totalBytes);
    const eta = frac > 0 ? Math.round(secs * (1 - frac) / frac) : NaN;
    const hms = Number.isFinite(eta)
      ? `${Math.floor(eta / 3600)}:${String(Math.floor(eta / 60) % 60).padStart(2, '0')}:${String(eta % 60).padStart(2, '0')}`
      : '?';
    return `documents ${docs}, tokens ${tokens}, ${Math.round(tokens / secs)} tokens/s, `
      + `${(100 * frac).toFixed(1)}% of input, ETA ${hms}`;
  }
  update(docs, tokens, done, final = false) {
    if (!this.enabled) return;
    const now = Date.now();
    if (!final && now - this.lastDraw < (this.tty ? 200 : 10000)) return;
    this.lastDraw = now;
    const text = this.line(docs, tokens, done);
    if (this.tty) this.stream.write(`\r${text}\x1b[K${final ? '\n' : ''}`);
    else this.stream.write(`${text}\n`);
  }
}

/**
 * Encodes the corpus `inputs` into DIR/NAME_{val,train}_NNNNNN.bin and writes the tokenizer file.
 * options: { inputs, outDir, name, shardTokens, encoding, tokenizerPath (null: GPT-2), eotText (--eot or null), tokenizerOut,
 * workers, progress, batchChars (text per batch sent to a worker) }. Returns { shards: [file], written, kept, tokens, docs, seconds }.
 */
async function prepareCorpus(options) {
  const { inputs, outDir, name, encoding, tokenizerPath, eotText, tokenizerOut } = options;
  const shardTokens = options.shardTokens || DEFAULT_SHARD_TOKENS;
  const workers = options.workers || defaultWorkers();
  const batchChars = options.batchChars || DEFAULT_BATCH_CHARS;
  const files = corpusFiles(inputs);
  const meter = new Meter(files.reduce((n, f) => n + f.size, 0), options.progress !== false);
  const result = { shards: [], written: 0, kept: 0, tokens: 0, docs: 0, seconds: 0 };

  const shard = new Uint32Array(shardTokens);
  let fill = 0;
  const flush = () => {
    const file = path.join(outDir, shardName(name, result.shards.length));
    if (writeIfChanged(file, prep.shardFileBuffer(shard.subarray(0, fill), encoding.vocabSize))) result.written++;
    else result.kept++;
    result.shards.push(file);
    fill = 0;
  };
  const take = (tokens) => {
    for (let off = 0; off < tokens.length;) {
      const n = Math.min(shardTokens - fill, tokens.length - off);
      shard.set(tokens.subarray(off, off + n), fill);
      fill += n;
      off += n;
      if (fill === shardTokens) flush();
    }
    result.tokens += tokens.length;
  };

  const pool = new EncoderPool(workers, tokenizerPath, eotText || null);
  try {
    const inFlight = []; // in batch order: Promise<{ tokens, docs, done }>
    const send = (texts, done) => {
      const p = pool.encode(texts).then((tokens) => ({ tokens, docs: texts.length, done }));
      p.catch(() => {}); // handled when its turn comes
      inFlight.push(p);
    };
    const receive = async () => {
      const r = await inFlight.shift();
      take(r.tokens);
      result.docs += r.docs;
      meter.update(result.docs, result.tokens, r.done);
    };
    let batch = [];
    let chars = 0;
    let done = 0;
    for await (const doc of readDocuments(files)) {
      batch.push(doc.text);
      chars += doc.text.length;
      done = doc.done;
      if (chars >= batchChars) {
        send(batch, done);
        batch = [];
        chars = 0;
        while (inFlight.length >= BATCHES_PER_WORKER * workers) await receive();
      }
    }
    if (batch.length > 0) send(batch, done);
    while (inFlight.length > 0) await receive();
    if (fill > 0) flush();
    meter.update(result.docs, result.tokens, done, true);
  } finally {
    await pool.close();
  }
  if (result.docs === 0) throw new Error('the inputs hold no documents');
  writeIfChanged(tokenizerOut, prep.tokenizerFileBuffer(encoding.tokenBytes(), encoding.eot));
  result.seconds = (Date.now() - meter.started) / 1000;
  return result;
}

module.exports = { DEFAULT_SHARD_TOKENS, shardName, writeIfChanged, prepareCorpus, defaultWorkers };
