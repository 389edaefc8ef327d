// Decodes token ids back to bytes, which is how the trainer prints samples. Two files describe a vocab:
// - llm.c's tokenizer file (256 x uint32 header: magic 20240328, version 2, vocab size, EOT id; then per token a
//   uint8 length and that many raw bytes), as prepare.js writes it for GPT-2's or any byte-level tokenizer;
// - a Hugging Face tokenizer.json of a byte-level BPE (GPT-2, Llama 3, Qwen), or the model directory holding one.
//   Its vocab's strings are bytes spelled in GPT-2's bytes_to_unicode alphabet (each byte one printable code
//   point: ' ' is 'Ġ', '\n' is 'Ċ'), mapped back here to the raw bytes; its added tokens (<|begin_of_text|>, ...)
//   are their text. HF's decode does the same, except that it drops special tokens when asked to.
// The EOT id (the token samples start from) of a tokenizer.json is its directory's end-of-text id, read with
// Hugging Face's precedence (hf_eos_id), else its own <|endoftext|> or <|end_of_text|> (a bare tokenizer.json).
// Tokens are byte strings, not necessarily valid UTF-8 on their own: a multi-byte character may be split across
// tokens, so callers concatenate before printing.
#pragma once

#include <sys/stat.h>

#include <cstdint>
#include <string>
#include <vector>

#include "llmc/json.h"
#include "llmc/utils.h"

constexpr uint32_t TOKENIZER_MAGIC = 20240328;
constexpr uint32_t TOKENIZER_VERSION = 2;
constexpr int TOKENIZER_HEADER_INTS = 256;

// GPT-2's bytes_to_unicode, reversed: the byte each code point of its alphabet stands for, -1 for none. The
// printable bytes ('!'..'~', '¡'..'¬', '®'..'ÿ') stand for themselves; the other 68, in byte order, are U+0100 on.
struct ByteLevelAlphabet {
    int byte_of[256 + 68];
    ByteLevelAlphabet() {
        int next = 256;
        for (int b = 0; b < 256; b++) byte_of[b] = -1;
        for (int b = 0; b < 256; b++) {
            bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
            byte_of[printable ? b : next++] = b;
        }
    }
};

// the code points of valid UTF-8 (the JSON reader has checked it)
inline std::vector<uint32_t> utf8_code_points(const std::string& s) {
    std::vector<uint32_t> out;
    for (size_t i = 0; i < s.size();) {
        unsigned char c = (unsigned char)s[i];
        int n = c < 0x80 ? 1 : c < 0xE0 ? 2 : c < 0xF0 ? 3 : 4;
        uint32_t cp = n == 1 ? c : n == 2 ? c & 0x1F : n == 3 ? c & 0x0F : c & 0x07;
        for (int k = 1; k < n; k++) cp = cp << 6 | ((unsigned char)s[i + k] & 0x3F);
        out.push_back(cp);
        i += n;
    }
    return out;
}

inline bool is_directory(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// the directory a file is in ("." for a bare name)
inline std::string directory_of(const std::string& path) {
    size_t slash = path.rfind('/');
    return slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
}

struct Tokenizer {
    int vocab_size = 0;
    int eot = 0;
    std::string path;
    std::string eot_from;  // where the EOT id was read: the file's header, or the HF file and field
    // the token a document follows in the training data, which a sample starts from (document_start)
    int start = 0;
    std::string start_from;
    std::vector<std::string> tokens;

    // path: llm.c's tokenizer file, a tokenizer.json, or a directory holding tokenizer.json
    explicit Tokenizer(const std::string& path_) : path(path_) {
        if (is_directory(path)) path += "/tokenizer.json";
        File f(path, "rb");
        std::string bytes = f.read_all();
        size_t first = bytes.find_first_not_of(" \t\r\n");
        if (first != std::string::npos && bytes[first] == '{') read_hf(bytes);
        else read_llmc(bytes);
    }

    const std::string& decode(int id) const {
        if (id < 0 || id >= vocab_size)
            fail("%s: cannot decode token id %d: out of range for vocab size %d", path.c_str(), id, vocab_size);
        return tokens[id];
    }

    std::string decode(const std::vector<int>& ids) const {
        std::string out;
        for (int id : ids) out += decode(id);
        return out;
    }

    // the id of the token whose bytes are `text`, or -1
    int id_of(const std::string& text) const {
        for (int id = 0; id < vocab_size; id++)
            if (tokens[id] == text) return id;
        return -1;
    }

private:
    void read_llmc(const std::string& bytes) {
        const long size = (long)bytes.size();
        const long header_bytes = TOKENIZER_HEADER_INTS * sizeof(uint32_t);
        if (size < header_bytes)
            fail("%s: truncated: %ld bytes, too short for the %ld-byte tokenizer header", path.c_str(), size,
                 header_bytes);
        uint32_t header[TOKENIZER_HEADER_INTS];
        memcpy(header, bytes.data(), sizeof(header));
        if (header[0] != TOKENIZER_MAGIC)
            fail("%s: bad magic number %u (expected %u): not a tokenizer file (nor a tokenizer.json)", path.c_str(),
                 header[0], TOKENIZER_MAGIC);
        if (header[1] != TOKENIZER_VERSION)
            fail("%s: unsupported version %u (expected %u)", path.c_str(), header[1], TOKENIZER_VERSION);
        if (header[2] == 0 || header[2] > (uint32_t)INT32_MAX)
            fail("%s: invalid vocab size %u", path.c_str(), header[2]);
        vocab_size = (int)header[2];
        if (header[3] >= header[2])
            fail("%s: EOT id %u is out of range for vocab size %d", path.c_str(), header[3], vocab_size);
        eot = (int)header[3];
        eot_from = path + "'s header";
        start = eot, start_from = eot_from;  // llm.c's data puts the end-of-text token before each document

        const unsigned char* body = (const unsigned char*)bytes.data() + header_bytes;
        const size_t body_size = (size_t)(size - header_bytes);
        tokens.resize(vocab_size);
        size_t at = 0;
        for (int id = 0; id < vocab_size; id++) {
            if (at >= body_size) fail("%s: truncated: ends after %d of %d tokens", path.c_str(), id, vocab_size);
            const size_t len = body[at++];
            if (len == 0) fail("%s: token %d has zero length", path.c_str(), id);
            if (at + len > body_size)
                fail("%s: truncated: token %d needs %zu bytes, %zu are left", path.c_str(), id, len, body_size - at);
            tokens[id].assign(reinterpret_cast<const char*>(body + at), len);
            at += len;
        }
        // leftover bytes mean the header's vocab size does not describe this file
        if (at != body_size)
            fail("%s: %zu bytes after the last of %d tokens (vocab size wrong?)", path.c_str(), body_size - at,
                 vocab_size);
    }

    void read_hf(const std::string& bytes) {
        JsonDoc doc(bytes, path);
        const JsonValue& model = doc.root.at("model");
        const JsonValue* type = model.find("type");
        if (!type || type->as_string() != "BPE")
            fail("%s: \"model\".\"type\" is %s: only a byte-level BPE (GPT-2, Llama 3, Qwen) is read", path.c_str(),
                 type ? type->as_string().c_str() : "absent");
        // a BPE whose decoder is not ByteLevel (Llama 2's SentencePiece with Metaspace and byte fallback) spells
        // its tokens otherwise
        const JsonValue& decoder = doc.root.at("decoder");
        bool byte_level = decoder.at("type").as_string() == "ByteLevel";
        if (decoder.at("type").as_string() == "Sequence")
            for (const JsonValue& d : decoder.at("decoders").as_array()) byte_level |= d.at("type").as_string() == "ByteLevel";
        if (!byte_level) fail("%s: \"decoder\" is not ByteLevel: only a byte-level BPE is read", path.c_str());

        static const ByteLevelAlphabet alphabet;
        std::vector<bool> seen;
        auto place = [&](const JsonValue& id_value, std::string token) {
            int64_t id = id_value.as_int64();
            if (id < 0 || id >= INT32_MAX) fail("%s: token id %lld is out of range", id_value.path().c_str(), (long long)id);
            if ((size_t)id >= tokens.size()) tokens.resize(id + 1), seen.resize(id + 1);
            tokens[id] = std::move(token);
            seen[id] = true;
        };
        const JsonValue& vocab = model.at("vocab").as_object();
        for (size_t i = 0; i < vocab.items.size(); i++) {
            std::string raw;
            for (uint32_t cp : utf8_code_points(vocab.keys[i])) {
                int b = cp < 256 + 68 ? alphabet.byte_of[cp] : -1;
                if (b < 0)
                    fail("%s: token \"%s\" holds U+%04X, no byte of the byte-level alphabet", vocab.items[i].path().c_str(),
                         vocab.keys[i].c_str(), cp);
                raw += (char)b;
            }
            place(vocab.items[i], std::move(raw));
        }
        // the added tokens are their text, and take their id over a vocab entry of the same id (GPT-2's
        // <|endoftext|> is in both, spelled the same)
        for (const JsonValue& added : doc.root.at("added_tokens").as_array())
            place(added.at("id"), added.at("content").as_string());
        for (size_t id = 0; id < tokens.size(); id++)
            if (!seen[id]) fail("%s: no token has id %zu, below the largest id %zu", path.c_str(), id, tokens.size() - 1);
        vocab_size = (int)tokens.size();
        eot = hf_eos_id(directory_of(path));
        document_start(doc.root, directory_of(path));
    }

    // The token before a document, as dev/data/hf_tokenizer.js frames documents in the shards: the last special
    // token the post-processor's template puts before the text (Llama 3's <|begin_of_text|>); with a template
    // that puts none, the last one it puts after (the one that ends the document before); without a template,
    // tokenizer_config.json's bos_token unless add_bos_token is false; else the end-of-text token, which then
    // follows every document (Qwen3's).
    void document_start(const JsonValue& root, const std::string& dir) {
        const JsonValue* pp = root.find("post_processor");
        if (pp && !pp->is_null() && pp->at("type").as_string() == "Sequence") {
            const JsonValue* found = nullptr;
            for (const JsonValue& p : pp->at("processors").as_array())
                if (!found && p.at("type").as_string() == "TemplateProcessing") found = &p;
            pp = found;
        }
        if (pp && !pp->is_null() && pp->at("type").as_string() == "TemplateProcessing") {
            int before = -1, after = -1;
            bool text_seen = false;
            for (const JsonValue& piece : pp->at("single").as_array()) {
                if (piece.find("Sequence")) text_seen = true;
                const JsonValue* special = piece.find("SpecialToken");
                if (!special) continue;
                const std::string& name = special->at("id").as_string();
                const std::vector<JsonValue>& ids = pp->at("special_tokens").at(name).at("ids").as_array();
                if (ids.empty()) fail("%s: the post-processor's %s has no ids", path.c_str(), name.c_str());
                int64_t id = ids.back().as_int64();
                if (id < 0 || id >= vocab_size)
                    fail("%s: the post-processor's %s, id %lld, is out of range for %d tokens", path.c_str(), name.c_str(),
                         (long long)id, vocab_size);
                (text_seen ? after : before) = (int)id;
            }
            if (before >= 0 || after >= 0) {
                start = before >= 0 ? before : after;
                start_from = path + "'s post-processor template";
                return;
            }
        }
        std::string file = dir + "/tokenizer_config.json";
        if (file_exists(file)) {
            JsonDoc config = JsonDoc::from_file(file);
            const JsonValue* bos = config.root.find("bos_token");
            const JsonValue* add = config.root.find("add_bos_token");
            bool added = !add || add->is_null() || add->as_bool();
            if (bos && !bos->is_null() && added) {
                const std::string& text = bos->kind == JsonKind::Object ? bos->at("content").as_string() : bos->as_string();
                start = id_of(text);
                if (start < 0) fail("%s: bos_token \"%s\" is no token of %s", bos->path().c_str(), text.c_str(), path.c_str());
                start_from = file + "'s bos_token";
                return;
            }
        }
        start = eot, start_from = eot_from;
    }

    // Hugging Face's end-of-sequence id, in the precedence of its generation: generation_config.json's
    // eos_token_id, else config.json's (GenerationConfig.from_model_config), else the tokenizer's own
    // (tokenizer_config.json's eos_token, a token's text). A list (Llama 3 Instruct's [128001, 128008, 128009]:
    // any of them ends generation) gives its first. A tokenizer.json with none of these beside it gives its
    // <|endoftext|> (GPT-2's, Qwen's) or <|end_of_text|> (Llama 3's), as dev/data/hf_tokenizer.js does.
    int hf_eos_id(const std::string& dir) {
        for (const char* name : {"generation_config.json", "config.json"}) {
            std::string file = dir + "/" + name;
            if (!file_exists(file)) continue;
            JsonDoc doc = JsonDoc::from_file(file);
            const JsonValue* v = doc.root.as_object().find("eos_token_id");
            if (!v || v->is_null()) continue;
            if (v->kind == JsonKind::Array && v->items.empty()) continue;
            const JsonValue& id = v->kind == JsonKind::Array ? v->items[0] : *v;
            int64_t eos = id.as_int64();
            if (eos < 0 || eos >= vocab_size)
                fail("%s: eos_token_id %lld is out of range for %s's %d tokens", id.path().c_str(), (long long)eos,
                     path.c_str(), vocab_size);
            eot_from = file + "'s eos_token_id";
            return (int)eos;
        }
        std::string file = dir + "/tokenizer_config.json";
        if (file_exists(file)) {
            JsonDoc doc = JsonDoc::from_file(file);
            const JsonValue* v = doc.root.as_object().find("eos_token");
            if (v && !v->is_null()) {
                // a string, or an AddedToken's {"content": ...}
                const std::string& text = v->kind == JsonKind::Object ? v->at("content").as_string() : v->as_string();
                int eos = id_of(text);
                if (eos < 0) fail("%s: eos_token \"%s\" is no token of %s", v->path().c_str(), text.c_str(), path.c_str());
                eot_from = file + "'s eos_token";
                return eos;
            }
        }
        // a tokenizer.json alone, as Meta ships Llama 3's: its end-of-text token by name, as prepare.js finds it
        for (const char* text : {"<|endoftext|>", "<|end_of_text|>"}) {
            int eos = id_of(text);
            if (eos < 0) continue;
            eot_from = path + "'s " + text;
            return eos;
        }
        fail("%s: no end-of-text id: none of generation_config.json, config.json (eos_token_id) or "
             "tokenizer_config.json (eos_token) in %s names one, and it has no <|endoftext|> or <|end_of_text|>",
             path.c_str(), dir.c_str());
    }
};

// A tokenizer decodes a model's samples when each of its ids is a row of the model. A model may have more rows than
// the tokenizer has ids (Qwen3's 151936 for its 151669 tokens; Megatron-LM pads a vocab so): the rest are padding no
// text holds, which the returned line says; "" when the two agree. More ids than the model's rows are refused: a
// tokenizer of another model.
inline std::string tokenizer_padding(const std::string& path, int tokenizer_ids, int model_rows) {
    if (tokenizer_ids > model_rows)
        fail("%s: the tokenizer's %d ids are more than the model's %d rows (a tokenizer of another model?)", path.c_str(),
             tokenizer_ids, model_rows);
    if (tokenizer_ids == model_rows) return "";
    return strfmt("tokenizer: %d ids for the model's %d rows; ids %d..%d are padding no text holds", tokenizer_ids,
                  model_rows, tokenizer_ids, model_rows - 1);
}
