// encode_worker.js: a worker thread of corpus.js. It builds the encoding once (GPT-2's, or the
// tokenizer.json named in workerData.tokenizerPath, with workerData.eotText, --eot's token) and answers each batch of documents with their
// framed tokens, concatenated in order, as a transferred Uint32Array.
'use strict';

const { parentPort, workerData } = require('worker_threads');
const prep = require('./prepare');

const encoding = workerData.tokenizerPath === null ? prep.gpt2Encoding() : prep.hfEncoding(workerData.tokenizerPath, workerData.eotText);

parentPort.on('message', ({ id, texts }) => {
  const sink = new prep.TokenBuffer(encoding.vocabSize);
  for (const text of texts) prep.encodeInto(sink, text, null, encoding);
  const tokens = sink.tokens().slice();
  parentPort.postMessage({ id, tokens }, [tokens.buffer]);
});
