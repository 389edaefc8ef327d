// Tests of the tokenizer file reader: decoding from a small hand-written file, a clear error for each kind of
// bad file, and a byte-exact round trip through the real GPT-2 tokenizer written by dev/data/prepare.js.
#include <algorithm>

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

}  // namespace test_tokenizer
