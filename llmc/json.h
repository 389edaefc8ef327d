// JSON (RFC 8259) for the few files the project shares with the Hugging Face world: a safetensors header, a
// model's config.json. Reading parses into a JsonDoc, a tree of JsonValue whose accessors fail in one line naming
// the file, the key path and what was expected (`config.json: "num_key_value_heads": expected an integer`);
// writing builds a JsonOut and prints it compact (as serde_json writes safetensors headers) or with a 2-space
// indent (as Python's json.dumps(indent=2) writes config.json), keys in the order they were set.
// It is here rather than from a library because the project takes no dependency for a few hundred lines, and
// because every error must be the project's one-line `fail`, never another exception or a crash: the reader
// refuses trailing garbage, nesting deeper than 64, inputs over 100 MB (safetensors' own header limit), duplicate
// keys, invalid UTF-8 and numbers out of double's range.
#pragma once

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

#include "llmc/utils.h"

constexpr size_t JSON_MAX_BYTES = 100000000;
constexpr int JSON_MAX_DEPTH = 64;

enum class JsonKind { Null, Bool, Number, String, Array, Object };

// one value of a parsed document; it lives inside its JsonDoc, which it points back into for its errors
struct JsonValue {
    JsonKind kind = JsonKind::Null;
    bool boolean = false;
    double number = 0.0;
    bool exact = false;    // the number was written as an integer that fits int64: `integer` holds it exactly
    int64_t integer = 0;
    std::string string;
    std::vector<std::string> keys;  // an object's keys, in the file's order; items[i] is keys[i]'s value
    std::vector<JsonValue> items;   // an array's elements or an object's values
    const JsonValue* parent = nullptr;
    const std::string* where = nullptr;  // the file name (or what else the text came from)

    JsonValue() = default;
    JsonValue(JsonValue&&) = default;
    JsonValue& operator=(JsonValue&&) = default;
    JsonValue(const JsonValue&) = delete;  // a copy would point into the wrong tree
    JsonValue& operator=(const JsonValue&) = delete;

    // `file: "a"."b"[2]`: where this value is, for an error message
    std::string path() const {
        std::string keys_path;
        for (const JsonValue* v = this; v->parent; v = v->parent) {
            size_t i = (size_t)(v - v->parent->items.data());
            keys_path = (v->parent->kind == JsonKind::Object ? "\"" + v->parent->keys[i] + "\"" : strfmt("[%zu]", i)) +
                        (keys_path.empty() || keys_path[0] == '[' ? "" : ".") + keys_path;
        }
        std::string file = where ? *where : "JSON";
        return keys_path.empty() ? file : file + ": " + keys_path;
    }
    [[noreturn]] void expected(const char* what) const { fail("%s: expected %s", path().c_str(), what); }

    bool is_null() const { return kind == JsonKind::Null; }
    bool as_bool() const {
        if (kind != JsonKind::Bool) expected("true or false");
        return boolean;
    }
    double as_double() const {
        if (kind != JsonKind::Number) expected("a number");
        return number;
    }
    // exact: an integer literal that fits int64, or a number with no fraction within +-2^53 (1e3, 2.0)
    int64_t as_int64() const {
        if (kind != JsonKind::Number) expected("an integer");
        if (exact) return integer;
        if (number != std::floor(number)) expected("an integer");
        if (std::fabs(number) > 9007199254740992.0)
            fail("%s: %.17g is beyond the integers a double holds exactly", path().c_str(), number);
        return (int64_t)number;
    }
    const std::string& as_string() const {
        if (kind != JsonKind::String) expected("a string");
        return string;
    }
    // the elements of an array, or the values of an object (with keys)
    const std::vector<JsonValue>& as_array() const {
        if (kind != JsonKind::Array) expected("an array");
        return items;
    }
    const JsonValue& as_object() const {
        if (kind != JsonKind::Object) expected("an object");
        return *this;
    }
    // an object's member, or null when absent (linear: objects here are small, or read in order)
    const JsonValue* find(const std::string& key) const {
        as_object();
        for (size_t i = 0; i < keys.size(); i++)
            if (keys[i] == key) return &items[i];
        return nullptr;
    }
    const JsonValue& at(const std::string& key) const {
        const JsonValue* v = find(key);
        if (!v) fail("%s: missing \"%s\"", path().c_str(), key.c_str());
        return *v;
    }
};

// a parsed document: the tree and the name its errors carry. It stays where it is built (its values point into
// it), which C++17 allows to be a function's return value.
struct JsonDoc {
    std::string where;
    JsonValue root;

    JsonDoc(const std::string& text, const std::string& where_);
    JsonDoc(const JsonDoc&) = delete;
    JsonDoc& operator=(const JsonDoc&) = delete;
    static JsonDoc from_file(const std::string& path) {
        File f(path, "rb");
        long size = f.size();
        if (size > (long)JSON_MAX_BYTES)
            fail("%s: %ld bytes is over the %zu-byte limit for JSON", path.c_str(), size, JSON_MAX_BYTES);
        return JsonDoc(f.read_all(), path);
    }
};

// the recursive-descent parser behind JsonDoc
struct JsonParser {
    const std::string& text;
    const std::string& where;
    size_t at = 0;

    [[noreturn]] void error(const char* what) const {
        size_t line = 1, column = 1;
        for (size_t i = 0; i < at && i < text.size(); i++) {
            if (text[i] == '\n') line++, column = 1;
            else column++;
        }
        fail("%s: invalid JSON at line %zu, column %zu: %s", where.c_str(), line, column, what);
    }
    bool done() const { return at >= text.size(); }
    char peek() const { return done() ? '\0' : text[at]; }
    void skip_space() {
        while (!done() && (text[at] == ' ' || text[at] == '\t' || text[at] == '\n' || text[at] == '\r')) at++;
    }
    void expect_word(const char* word) {
        size_t n = strlen(word);
        if (text.compare(at, n, word) != 0) error("unexpected character");
        at += n;
    }

    void parse_value(JsonValue& v, int depth) {
        if (depth > JSON_MAX_DEPTH) error("nested deeper than 64");
        skip_space();
        switch (peek()) {
            case '{': return parse_object(v, depth);
            case '[': return parse_array(v, depth);
            case '"': v.kind = JsonKind::String, v.string = parse_string(); return;
            case 't': v.kind = JsonKind::Bool, v.boolean = true; return expect_word("true");
            case 'f': v.kind = JsonKind::Bool, v.boolean = false; return expect_word("false");
            case 'n': v.kind = JsonKind::Null; return expect_word("null");
            case '\0': error(done() ? "unexpected end" : "unexpected character");
            default:
                if (peek() == '-' || (peek() >= '0' && peek() <= '9')) return parse_number(v);
                error("unexpected character");
        }
    }

    void parse_object(JsonValue& v, int depth) {
        v.kind = JsonKind::Object;
        std::unordered_set<std::string> seen;
        at++;  // '{'
        skip_space();
        if (peek() == '}') return (void)at++;
        for (;;) {
            skip_space();
            if (peek() != '"') error(done() ? "unexpected end" : "expected a string key");
            size_t key_at = at;
            std::string key = parse_string();
            if (!seen.insert(key).second) {
                at = key_at;
                error(("duplicate key \"" + key + "\"").c_str());
            }
            skip_space();
            if (peek() != ':') error(done() ? "unexpected end" : "expected ':'");
            at++;
            v.keys.push_back(std::move(key));
            v.items.emplace_back();
            parse_value(v.items.back(), depth + 1);
            skip_space();
            if (peek() == ',') {
                at++;
                continue;
            }
            if (peek() == '}') return (void)at++;
            error(done() ? "unexpected end" : "expected ',' or '}'");
        }
    }

    void parse_array(JsonValue& v, int depth) {
        v.kind = JsonKind::Array;
        at++;  // '['
        skip_space();
        if (peek() == ']') return (void)at++;
        for (;;) {
            v.items.emplace_back();
            parse_value(v.items.back(), depth + 1);
            skip_space();
            if (peek() == ',') {
                at++;
                continue;
            }
            if (peek() == ']') return (void)at++;
            error(done() ? "unexpected end" : "expected ',' or ']'");
        }
    }

    unsigned hex4() {
        if (at + 4 > text.size()) error("unexpected end in a \\u escape");
        unsigned u = 0;
        for (int i = 0; i < 4; i++) {
            char c = text[at++];
            int d = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : c >= 'A' && c <= 'F' ? c - 'A' + 10 : -1;
            if (d < 0) error("a \\u escape needs 4 hex digits");
            u = u * 16 + (unsigned)d;
        }
        return u;
    }
    static void append_utf8(std::string& s, unsigned cp) {
        if (cp < 0x80) {
            s += (char)cp;
        } else if (cp < 0x800) {
            s += (char)(0xC0 | (cp >> 6)), s += (char)(0x80 | (cp & 0x3F));
        } else if (cp < 0x10000) {
            s += (char)(0xE0 | (cp >> 12)), s += (char)(0x80 | ((cp >> 6) & 0x3F)), s += (char)(0x80 | (cp & 0x3F));
        } else {
            s += (char)(0xF0 | (cp >> 18)), s += (char)(0x80 | ((cp >> 12) & 0x3F));
            s += (char)(0x80 | ((cp >> 6) & 0x3F)), s += (char)(0x80 | (cp & 0x3F));
        }
    }
    // the length of the well-formed UTF-8 sequence at `at` (no overlongs, surrogates or code points past
    // U+10FFFF), or 0
    size_t utf8_length() const {
        const unsigned char* p = (const unsigned char*)text.data() + at;
        size_t left = text.size() - at;
        auto cont = [&](size_t i) { return i < left && (p[i] & 0xC0) == 0x80; };
        if (p[0] >= 0xC2 && p[0] <= 0xDF) return cont(1) ? 2 : 0;
        if (p[0] >= 0xE0 && p[0] <= 0xEF) {
            if (!cont(1) || !cont(2)) return 0;
            if (p[0] == 0xE0 && p[1] < 0xA0) return 0;   // overlong
            if (p[0] == 0xED && p[1] >= 0xA0) return 0;  // a surrogate
            return 3;
        }
        if (p[0] >= 0xF0 && p[0] <= 0xF4) {
            if (!cont(1) || !cont(2) || !cont(3)) return 0;
            if (p[0] == 0xF0 && p[1] < 0x90) return 0;  // overlong
            if (p[0] == 0xF4 && p[1] >= 0x90) return 0;  // past U+10FFFF
            return 4;
        }
        return 0;
    }

    std::string parse_string() {
        std::string s;
        at++;  // '"'
        for (;;) {
            if (done()) error("unterminated string");
            unsigned char c = (unsigned char)text[at];
            if (c == '"') {
                at++;
                return s;
            }
            if (c < 0x20) error("a control character in a string must be escaped");
            if (c >= 0x80) {
                size_t n = utf8_length();
                if (n == 0) error("invalid UTF-8");
                s.append(text, at, n);
                at += n;
                continue;
            }
            at++;
            if (c != '\\') {
                s += (char)c;
                continue;
            }
            if (done()) error("unterminated string");
            char e = text[at++];
            switch (e) {
                case '"': s += '"'; break;
                case '\\': s += '\\'; break;
                case '/': s += '/'; break;
                case 'b': s += '\b'; break;
                case 'f': s += '\f'; break;
                case 'n': s += '\n'; break;
                case 'r': s += '\r'; break;
                case 't': s += '\t'; break;
                case 'u': {
                    unsigned cp = hex4();
                    if (cp >= 0xDC00 && cp <= 0xDFFF) error("a lone low surrogate in a \\u escape");
                    if (cp >= 0xD800 && cp <= 0xDBFF) {
                        if (text.compare(at, 2, "\\u") != 0) error("a high surrogate without its low surrogate");
                        at += 2;
                        unsigned low = hex4();
                        if (low < 0xDC00 || low > 0xDFFF) error("a high surrogate without its low surrogate");
                        cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                    }
                    append_utf8(s, cp);
                    break;
                }
                default: at--, error("unknown escape");
            }
        }
    }

    void parse_number(JsonValue& v) {
        size_t start = at;
        auto digits = [&]() {
            size_t from = at;
            while (!done() && text[at] >= '0' && text[at] <= '9') at++;
            return at - from;
        };
        if (peek() == '-') at++;
        if (peek() == '0') {
            at++;
            if (peek() >= '0' && peek() <= '9') error("a number cannot have a leading zero");
        } else if (digits() == 0) {
            error("expected a digit");
        }
        bool integral = true;
        if (peek() == '.') {
            at++, integral = false;
            if (digits() == 0) error("expected a digit after '.'");
        }
        if (peek() == 'e' || peek() == 'E') {
            at++, integral = false;
            if (peek() == '+' || peek() == '-') at++;
            if (digits() == 0) error("expected a digit in the exponent");
        }
        std::string literal = text.substr(start, at - start);
        v.kind = JsonKind::Number;
        v.number = strtod(literal.c_str(), nullptr);
        if (std::isinf(v.number)) at = start, error("number out of range");
        if (integral) {
            bool negative = literal[0] == '-';
            uint64_t magnitude = 0;
            bool fits = true;
            for (size_t i = negative ? 1 : 0; i < literal.size() && fits; i++) {
                uint64_t d = (uint64_t)(literal[i] - '0');
                fits = magnitude <= (UINT64_MAX - d) / 10;
                magnitude = magnitude * 10 + d;
            }
            const uint64_t limit = negative ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX;
            if (fits && magnitude <= limit) {
                v.exact = true;
                v.integer = negative ? (int64_t)(0 - magnitude) : (int64_t)magnitude;
            }
        }
    }
};

inline void json_link(JsonValue& v, const JsonValue* parent, const std::string* where) {
    v.parent = parent;
    v.where = where;
    for (JsonValue& item : v.items) json_link(item, &v, where);
}

inline JsonDoc::JsonDoc(const std::string& text, const std::string& where_) : where(where_) {
    if (text.size() > JSON_MAX_BYTES)
        fail("%s: %zu bytes is over the %zu-byte limit for JSON", where.c_str(), text.size(), JSON_MAX_BYTES);
    JsonParser p{text, where};
    p.parse_value(root, 1);
    p.skip_space();
    if (!p.done()) p.error("trailing characters after the value");
    json_link(root, nullptr, &where);
}

// ----------------------------------------------------------------------------------------------------------
// writing

// a value to write: a scalar held as its JSON text, or an array, or an object whose keys keep the order they
// were set in
struct JsonOut {
    enum Kind { Scalar, Array, Object } kind = Scalar;
    std::string text = "null";
    std::vector<std::string> keys;
    std::vector<JsonOut> items;

    JsonOut() = default;
    JsonOut(std::nullptr_t) {}
    JsonOut(bool b) : text(b ? "true" : "false") {}
    template <typename T, std::enable_if_t<std::is_integral<T>::value && !std::is_same<T, bool>::value, int> = 0>
    JsonOut(T n) : text(std::to_string(n)) {}
    // as Python's repr writes a float: the fewest digits that read back as the same double, in positional
    // notation with at least one decimal (500000.0, 0.02) unless the exponent is below -4 or above 15 (1e-05)
    JsonOut(double x) {
        if (!std::isfinite(x)) fail("JSON: cannot write %g (JSON numbers are finite)", x);
        char buf[48];
        int digits = 1;
        for (; digits < 17; digits++) {
            snprintf(buf, sizeof(buf), "%.*e", digits - 1, x);
            if (strtod(buf, nullptr) == x) break;
        }
        snprintf(buf, sizeof(buf), "%.*e", digits - 1, x);
        const int exponent = atoi(strchr(buf, 'e') + 1);
        if (exponent >= -4 && exponent < 16) {
            snprintf(buf, sizeof(buf), "%.*f", std::max(digits - 1 - exponent, 0), x);
            if (!strchr(buf, '.')) strcat(buf, ".0");
        }
        text = buf;
    }
    JsonOut(const char* s) : text(quote(s)) {}
    JsonOut(const std::string& s) : text(quote(s)) {}
    static JsonOut array() {
        JsonOut v;
        v.kind = Array;
        return v;
    }
    static JsonOut object() {
        JsonOut v;
        v.kind = Object;
        return v;
    }
    template <typename T>
    static JsonOut array_of(const std::vector<T>& values) {
        JsonOut v = array();
        for (const T& x : values) v.push(JsonOut(x));
        return v;
    }

    JsonOut& set(const std::string& key, JsonOut value) {
        if (kind != Object) fail("JSON: set(\"%s\") on a value that is not an object", key.c_str());
        for (const std::string& k : keys)
            if (k == key) fail("JSON: key \"%s\" set twice", key.c_str());
        keys.push_back(key);
        items.push_back(std::move(value));
        return *this;
    }
    JsonOut& push(JsonOut value) {
        if (kind != Array) fail("JSON: push() on a value that is not an array");
        items.push_back(std::move(value));
        return *this;
    }

    // a string as JSON: quotes, backslashes and control characters escaped (lowercase hex, as serde_json and
    // Python write them), everything else as it is, UTF-8 included
    static std::string quote(const std::string& s) {
        std::string q = "\"";
        for (char ch : s) {
            unsigned char c = (unsigned char)ch;
            switch (c) {
                case '"': q += "\\\""; break;
                case '\\': q += "\\\\"; break;
                case '\b': q += "\\b"; break;
                case '\f': q += "\\f"; break;
                case '\n': q += "\\n"; break;
                case '\r': q += "\\r"; break;
                case '\t': q += "\\t"; break;
                default:
                    if (c < 0x20) q += strfmt("\\u%04x", c);
                    else q += (char)c;
            }
        }
        return q + "\"";
    }

    // indent 0: compact, `{"a":[1,2]}`; otherwise one member per line, `"a": [`, as Python's json.dumps(indent=n)
    std::string dump(int indent = 2) const {
        std::string out;
        dump_into(out, indent, 0);
        return out;
    }
    void dump_into(std::string& out, int indent, int level) const {
        if (kind == Scalar) return (void)(out += text);
        out += kind == Object ? '{' : '[';
        for (size_t i = 0; i < items.size(); i++) {
            if (i > 0) out += ',';
            if (indent > 0) out += '\n' + std::string((size_t)(indent * (level + 1)), ' ');
            if (kind == Object) out += quote(keys[i]) + (indent > 0 ? ": " : ":");
            items[i].dump_into(out, indent, level + 1);
        }
        if (indent > 0 && !items.empty()) out += '\n' + std::string((size_t)(indent * level), ' ');
        out += kind == Object ? '}' : ']';
    }
};
