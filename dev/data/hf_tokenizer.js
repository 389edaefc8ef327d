// hf_tokenizer.js: a Hugging Face tokenizer.json (byte-level BPE: Llama 3, Qwen, GPT-2) read for
// prepare.js: its encoder, the tokens it puts around each document, its end-of-text id and every
// token's raw bytes for llm.c's tokenizer file.
//
// Encoding is Hugging Face's own JavaScript port of its tokenizers library (@huggingface/tokenizers),
// so the pre-tokenizer's regex, the merges, the normalizer and the added/special tokens behave as in
// the Rust library (test.js compares the ids with the Rust library's Node binding). A special token's
// text inside a document ("<|begin_of_text|>") is encoded as that special token, as Hugging Face's
// encode does by default.
//
// Which tokens frame a document, in this order of precedence:
//   1. the tokenizer's post-processor: a TemplateProcessing (alone or inside a Sequence) whose single
//      template puts special tokens before and/or after $A (Meta's Llama 3.x tokenizer.json:
//      <|begin_of_text|> before);
//   2. tokenizer_config.json: bos_token before each document unless add_bos_token is false; eos_token
//      after it when add_eos_token is true (the bundled Llama 3 tokenizer: <|begin_of_text|> before);
//   3. when neither puts a token before or after, the end-of-text token after each document, so
//      documents stay delimited (Qwen3 has no BOS: each document is followed by its eos token).
// The end-of-text id (the tokenizer file's header[3]): the token prepare.js's --eot names, else
// generation_config.json's eos_token_id (the first of a list), else tokenizer_config.json's eos_token,
// else the token "<|endoftext|>" (GPT-2's, Qwen's), else "<|end_of_text|>" (Llama 3's: Meta's
// tokenizer.json alone, with no config beside it); a tokenizer with none of these is refused in one
// line that asks for --eot.
'use strict';

const fs = require('fs');
const path = require('path');

class TokenizerError extends Error {}

// the pre-tokenizer split patterns of Llama 3 and of Qwen2/Qwen3 (digits one by one): a line break
// before a letter always ends a piece under them (see prepare.js's nextSafeCut)
const SPLIT_PATTERNS_CHECKED = [
  String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
  String.raw`(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
];

/** GPT-2's byte-level alphabet inverted: the printable character that stands for each byte -> the byte. */
function byteLevelDecoderTable() {
  const printable = [];
  for (let b = 33; b <= 126; b++) printable.push(b);
  for (let b = 161; b <= 172; b++) printable.push(b);
  for (let b = 174; b <= 255; b++) printable.push(b);
  const table = new Map();
  for (const b of printable) table.set(String.fromCodePoint(b), b);
  let n = 0;
  for (let b = 0; b < 256; b++) {
    if (!printable.includes(b)) table.set(String.fromCodePoint(256 + n++), b);
  }
  return table;
}

/** Reads a JSON file; a missing optional file gives null. Errors name the file. */
function readJson(file, optional) {
  let text;
  try {
    text = fs.readFileSync(file, 'utf8');
  } catch (err) {
    if (optional && err.code === 'ENOENT') return null;
    throw new TokenizerError(`cannot read ${file}: ${err.code || err.message}`);
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new TokenizerError(`${file}: not valid JSON (${String(err.message).split('\n')[0]})`);
  }
}

/** PATH (a tokenizer.json or a directory holding one) -> { json, dir }. */
function locateTokenizer(p) {
  let st;
  try {
    st = fs.statSync(p);
  } catch (_) {
    throw new TokenizerError(`tokenizer not found: ${p}`);
  }
  const file = st.isDirectory() ? path.join(p, 'tokenizer.json') : p;
  if (st.isDirectory() && !fs.existsSync(file)) throw new TokenizerError(`no tokenizer.json in ${p}`);
  return { json: path.resolve(file), dir: path.dirname(path.resolve(file)) };
}

/** A config's token field: a string, or an AddedToken-style object { content }. */
function tokenText(v) {
  if (v === null || v === undefined) return null;
  if (typeof v === 'string') return v;
  if (typeof v === 'object' && typeof v.content === 'string') return v.content;
  return null;
}

/** The special tokens a TemplateProcessing's single template puts before and after $A, or null. */
function templateFrame(pp) {
  if (!pp) return null;
  if (pp.type === 'Sequence') {
    for (const p of pp.processors || []) {
      const f = templateFrame(p);
      if (f) return f;
    }
    return null;
  }
  if (pp.type !== 'TemplateProcessing' || !Array.isArray(pp.single)) return null;
  const before = [];
  const after = [];
  let seen = false;
  for (const piece of pp.single) {
    if (piece.Sequence) {
      seen = true;
    } else if (piece.SpecialToken) {
      const ids = (pp.special_tokens[piece.SpecialToken.id] || {}).ids;
      if (!Array.isArray(ids)) throw new TokenizerError(`post-processor names an unknown special token ${piece.SpecialToken.id}`);
      (seen ? after : before).push(...ids);
    }
  }
  return { before, after };
}

class HfTokenizer {
  /**
   * Loads PATH (tokenizer.json or a model directory) and the configs beside it; eotText, when given,
   * is the end-of-text token's text (prepare.js's --eot) and wins over the configs.
   */
  constructor(p, eotText = null) {
    const where = locateTokenizer(p);
    this.file = where.json;
    const json = readJson(where.json, false);
    const config = readJson(path.join(where.dir, 'tokenizer_config.json'), true) || {};
    const generation = readJson(path.join(where.dir, 'generation_config.json'), true) || {};
    const model = json.model || {};
    const decoder = json.decoder || {};
    const decoders = decoder.type === 'Sequence' ? decoder.decoders || [] : [decoder];
    // the tokenizer file holds raw bytes: only a byte-level vocabulary can be decoded token by token
    if (model.type !== 'BPE' || !decoders.some((d) => d && d.type === 'ByteLevel')) {
      throw new TokenizerError(`${where.json}: only byte-level BPE tokenizers are supported (model ${model.type}, decoder ${decoder.type})`);
    }
    const { Tokenizer } = require('@huggingface/tokenizers');
    this.tokenizer = new Tokenizer(json, config);

    this.name = where.json;
    this.table = HfTokenizer.tokenByteTable(json, where.json);
    this.vocabSize = this.table.length;
    const idOf = (text, what) => {
      const id = this.tokenizer.token_to_id(text);
      if (id === undefined) throw new TokenizerError(`${what} ${JSON.stringify(text)} is not a token of ${where.json}`);
      return id;
    };

    const genEos = Array.isArray(generation.eos_token_id) ? generation.eos_token_id[0] : generation.eos_token_id;
    const named = ['<|endoftext|>', '<|end_of_text|>'].find((t) => this.tokenizer.token_to_id(t) !== undefined);
    if (eotText !== null) this.eot = idOf(eotText, '--eot');
    else if (Number.isInteger(genEos)) this.eot = genEos;
    else if (tokenText(config.eos_token) !== null) this.eot = idOf(tokenText(config.eos_token), 'tokenizer_config.json eos_token');
    else if (named !== undefined) this.eot = this.tokenizer.token_to_id(named);
    else throw new TokenizerError(`${where.json}: cannot tell the end-of-text token (no generation_config.json eos_token_id, no tokenizer_config.json eos_token, no <|endoftext|> or <|end_of_text|>): name it with --eot TOKEN`);
    if (!(this.eot >= 0 && this.eot < this.vocabSize)) throw new TokenizerError(`end-of-text id ${this.eot} is outside the vocabulary`);

    let frame = templateFrame(json.post_processor);
    if (!frame || frame.before.length + frame.after.length === 0) {
      frame = { before: [], after: [] };
      const bos = tokenText(config.bos_token);
      const eos = tokenText(config.eos_token);
      if (bos !== null && config.add_bos_token !== false) frame.before.push(idOf(bos, 'tokenizer_config.json bos_token'));
      if (eos !== null && config.add_eos_token === true) frame.after.push(idOf(eos, 'tokenizer_config.json eos_token'));
    }
    if (frame.before.length + frame.after.length === 0) frame.after.push(this.eot);
    this.before = frame.before;
    this.after = frame.after;

    this.chunkable = HfTokenizer.chunkable(json);
  }

  /**
   * Whether a long document may be encoded in pieces cut by prepare.js's nextSafeCut: only for the
   * pre-tokenizers that rule was checked against (GPT-2's byte-level regex, the Llama 3 and Qwen split
   * patterns), no prefix space added at a piece's start, and a normalizer that works per character.
   * Any other tokenizer encodes each document whole, which is always exact.
   */
  static chunkable(json) {
    const pre = json.pre_tokenizer || {};
    const parts = pre.type === 'Sequence' ? pre.pretokenizers || [] : [pre];
    const norm = json.normalizer ? json.normalizer.type : null;
    if (![null, 'NFC', 'NFKC'].includes(norm)) return false;
    return parts.length > 0 && parts.every((p) => {
      if (p.type === 'ByteLevel') return p.add_prefix_space !== true;
      return p.type === 'Split' && p.behavior === 'Isolated' && p.invert === false
        && p.pattern && SPLIT_PATTERNS_CHECKED.includes(p.pattern.Regex);
    }) && parts.some((p) => p.type === 'Split' || p.use_regex !== false);
  }

  /**
   * Every token's raw bytes, indexed by id (0 .. largest id): vocabulary entries byte-level decoded,
   * added tokens as their UTF-8 text. Refuses a gap in the ids and a token longer than 255 bytes
   * (llm.c's write_tokenizer asserts the same: the length is one byte).
   */
  static tokenByteTable(json, name) {
    const toByte = byteLevelDecoderTable();
    const table = [];
    for (const [text, id] of Object.entries(json.model.vocab)) {
      const bytes = [];
      for (const ch of text) {
        const b = toByte.get(ch);
        if (b === undefined) throw new TokenizerError(`${name}: token ${id} ${JSON.stringify(text)} is not byte-level text`);
        bytes.push(b);
      }
      table[id] = Buffer.from(bytes);
    }
    for (const t of json.added_tokens || []) table[t.id] = Buffer.from(t.content, 'utf8');
    for (let id = 0; id < table.length; id++) {
      if (table[id] === undefined) throw new TokenizerError(`${name}: no token has id ${id} (the ids must run 0..${table.length - 1})`);
      if (table[id].length < 1 || table[id].length > 255) {
        throw new TokenizerError(`${name}: token ${id} has ${table[id].length} bytes; llm.c's tokenizer file allows 1..255`);
      }
    }
    return table;
  }

  /** Every token's raw bytes, indexed by id. */
  tokenBytes() {
    return this.table;
  }

  /** The ids of a text, no tokens added around it. */
  encode(text) {
    return this.tokenizer.encode(text, { add_special_tokens: false }).ids;
  }

  /** Text of ids (special tokens kept), as Hugging Face decodes. */
  decode(ids) {
    return this.tokenizer.decode(ids, { skip_special_tokens: false, clean_up_tokenization_spaces: false });
  }
}

module.exports = { HfTokenizer, TokenizerError, byteLevelDecoderTable, locateTokenizer };
