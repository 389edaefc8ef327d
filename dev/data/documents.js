// documents.js: the documents of a corpus, in a fixed order, from .jsonl and .parquet files and
// directories of them (FineWeb-Edu's layout: parquet files with a "text" column, in nested directories).
//
// Order: the inputs as given; a directory's .jsonl and .parquet files recursively, sorted by path (so
// a rerun sees the same order); a jsonl file's lines; a parquet file's rows. Each document is yielded
// with `done`, the input bytes behind it (a jsonl's bytes read, a parquet's size times the rows read over
// its rows), for progress and ETA.
'use strict';

const fs = require('fs');
const path = require('path');
const { StringDecoder } = require('string_decoder');

const CORPUS_EXTENSIONS = ['.jsonl', '.parquet'];
const READ_CHUNK_BYTES = 1 << 22;

class DocumentError extends Error {}

/** Whether a path names corpus input: a directory, a .jsonl or a .parquet file. */
function isCorpusInput(p) {
  if (CORPUS_EXTENSIONS.includes(path.extname(p).toLowerCase())) return true;
  try {
    return fs.statSync(p).isDirectory();
  } catch (_) {
    return false;
  }
}

/** The .jsonl and .parquet files of the inputs, in order, with their sizes: [{ file, size }]. */
function corpusFiles(inputs) {
  const files = [];
  const walk = (dir) => {
    const found = [];
    const visit = (d) => {
      for (const e of fs.readdirSync(d, { withFileTypes: true })) {
        const p = path.join(d, e.name);
        if (e.isDirectory()) visit(p);
        else if (e.isFile() && CORPUS_EXTENSIONS.includes(path.extname(e.name).toLowerCase())) found.push(p);
      }
    };
    visit(dir);
    return found.sort();
  };
  for (const input of inputs) {
    let st;
    try {
      st = fs.statSync(input);
    } catch (_) {
      throw new DocumentError(`input not found: ${input}`);
    }
    const list = st.isDirectory() ? walk(input) : [input];
    if (st.isDirectory() && list.length === 0) throw new DocumentError(`no .jsonl or .parquet files in ${input}`);
    for (const f of list) files.push({ file: f, size: fs.statSync(f).size });
  }
  return files;
}

/** A jsonl file's documents: the "text" string of each non-blank line. */
async function* jsonlDocuments(file, before) {
  const decoder = new StringDecoder('utf8');
  let rest = '';
  let lineNo = 0;
  let read = 0;
  const parse = (line) => {
    lineNo++;
    if (line.trim() === '') return null;
    let obj;
    try {
      obj = JSON.parse(line);
    } catch (err) {
      throw new DocumentError(`${file}:${lineNo}: not valid JSON (${String(err.message).split('\n')[0]})`);
    }
    if (obj === null || typeof obj !== 'object' || typeof obj.text !== 'string') {
      throw new DocumentError(`${file}:${lineNo}: no "text" string`);
    }
    return obj.text;
  };
  for await (const chunk of fs.createReadStream(file, { highWaterMark: READ_CHUNK_BYTES })) {
    read += chunk.length;
    const lines = (rest + decoder.write(chunk)).split('\n');
    rest = lines.pop();
    for (const line of lines) {
      const text = parse(line);
      if (text !== null) yield { text, done: before + read };
    }
  }
  rest += decoder.end();
  const text = parse(rest);
  if (text !== null) yield { text, done: before + read };
}

/** A parquet file's documents: its "text" column, one row group at a time. */
async function* parquetDocuments(file, size, before) {
  const { asyncBufferFromFile, parquetMetadataAsync, parquetReadObjects } = await import('hyparquet');
  const { compressors } = await import('hyparquet-compressors');
  const buffer = await asyncBufferFromFile(file);
  let metadata;
  try {
    metadata = await parquetMetadataAsync(buffer);
  } catch (err) {
    throw new DocumentError(`${file}: not a parquet file (${err.message})`);
  }
  const columns = metadata.schema.slice(1).map((s) => s.name);
  if (!columns.includes('text')) throw new DocumentError(`${file}: no "text" column (columns: ${columns.join(', ')})`);
  const rows = Number(metadata.num_rows);
  let rowStart = 0;
  for (const group of metadata.row_groups) {
    const rowEnd = rowStart + Number(group.num_rows);
    const objects = await parquetReadObjects({ file: buffer, metadata, columns: ['text'], rowStart, rowEnd, compressors });
    for (let i = 0; i < objects.length; i++) {
      const text = objects[i].text;
      if (typeof text !== 'string') throw new DocumentError(`${file}: row ${rowStart + i}: "text" is not a string`);
      yield { text, done: before + Math.round(size * (rowStart + i + 1) / Math.max(1, rows)) };
    }
    rowStart = rowEnd;
  }
}

/** Every document of `files` (from corpusFiles), in order: { text, done }. */
async function* readDocuments(files) {
  let before = 0;
  for (const { file, size } of files) {
    if (path.extname(file).toLowerCase() === '.parquet') yield* parquetDocuments(file, size, before);
    else yield* jsonlDocuments(file, before);
    before += size;
  }
}

module.exports = { CORPUS_EXTENSIONS, DocumentError, isCorpusInput, corpusFiles, readDocuments };
