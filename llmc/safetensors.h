// Hugging Face's safetensors files, read and written: how models move between this project and the HF world.
// The format: an 8-byte little-endian header length N; N bytes of JSON mapping each tensor's name to
// {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]} (bytes from the end of the header), with an
// optional "__metadata__" object of strings; then the tensors' raw little-endian bytes.
// Reading validates everything before a byte of data is trusted (the header's length and JSON, each tensor's dtype,
// shape and size, offsets within the data section, no overlaps and no gaps), each refusal one line naming the file
// and the tensor; values come back as fp32 whatever the file holds (F32, BF16 or F16). Writing converts fp32 to
// the dtype asked for, rounding to nearest even, lays the header out as HF's writer does (compact JSON,
// "__metadata__" first, padded with spaces to a multiple of 8 bytes so that the data starts aligned), and publishes
// the file by renaming it into place once complete.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <unordered_map>
#include <vector>

#include "llmc/json.h"
#include "llmc/utils.h"

constexpr size_t SAFETENSORS_MAX_HEADER = 100000000;  // HF's own limit

enum class SafetensorsDtype { F32, BF16, F16 };

inline const char* dtype_name(SafetensorsDtype d) {
    return d == SafetensorsDtype::F32 ? "F32" : d == SafetensorsDtype::BF16 ? "BF16" : "F16";
}
inline int64_t dtype_bytes(SafetensorsDtype d) { return d == SafetensorsDtype::F32 ? 4 : 2; }

// ----------------------------------------------------------------------------------------------------------
// 16-bit floats as their bits: widening to fp32 is exact; narrowing rounds to nearest even, overflows to inf,
// and keeps a NaN a (quiet) NaN

inline float f32_from_bits(uint32_t bits) {
    float f;
    memcpy(&f, &bits, 4);
    return f;
}
inline uint32_t f32_bits(float f) {
    uint32_t bits;
    memcpy(&bits, &f, 4);
    return bits;
}

// f16: 1 sign, 5 exponent (bias 15), 10 mantissa bits; exponent 0 holds the subnormals, multiples of 2^-24
inline float float_from_f16(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1Fu, mantissa = h & 0x3FFu;
    if (exponent == 0x1F) return f32_from_bits(sign | 0x7F800000u | (mantissa << 13));  // inf, NaN
    if (exponent != 0) return f32_from_bits(sign | ((exponent + 127 - 15) << 23) | (mantissa << 13));
    float magnitude = (float)mantissa * 5.9604644775390625e-8f;  // exact: mantissa * 2^-24
    return sign ? -magnitude : magnitude;
}

inline uint16_t f16_from_float(float f) {
    uint32_t bits = f32_bits(f);
    uint16_t sign = (uint16_t)((bits >> 16) & 0x8000u);
    uint32_t a = bits & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (uint16_t)(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN, quieted
    if (a >= 0x477FF000u) return (uint16_t)(sign | 0x7C00u);  // 65520 and up (inf too) round to inf
    if (a >= 0x38800000u) {                                      // 2^-14 and up: a normal f16
        uint32_t h = (a >> 13) - ((127u - 15u) << 10), rest = a & 0x1FFFu;
        if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) h++;  // a carry into the exponent is right
        return (uint16_t)(sign | h);
    }
    if (a <= 0x33000000u) return sign;  // 2^-25 and below: a tie with zero at most, which goes to zero
    // a subnormal: the mantissa with its implicit bit, in units of 2^-24
    uint32_t m = (a & 0x7FFFFFu) | 0x800000u, shift = 126u - (a >> 23);  // 14..24
    uint32_t h = m >> shift, rest = m & ((1u << shift) - 1u), half = 1u << (shift - 1u);
    if (rest > half || (rest == half && (h & 1u))) h++;
    return (uint16_t)(sign | h);
}

// ----------------------------------------------------------------------------------------------------------
// reading

struct SafetensorsTensor {
    std::string name;
    SafetensorsDtype dtype = SafetensorsDtype::F32;
    std::vector<int64_t> shape;
    int64_t begin = 0, end = 0;  // data_offsets: bytes from the start of the data section
    int64_t numel() const { return (end - begin) / dtype_bytes(dtype); }
};

struct SafetensorsFile {
    std::string path;
    int64_t data_start = 0;                     // 8 + the header's length
    std::vector<SafetensorsTensor> tensors;     // in the header's order
    std::map<std::string, std::string> metadata;  // "__metadata__"
    std::unordered_map<std::string, size_t> index;  // name -> position in tensors

    const SafetensorsTensor* find(const std::string& name) const {
        auto it = index.find(name);
        return it == index.end() ? nullptr : &tensors[it->second];
    }

    // the tensor's values as fp32 (numel of them) into dst, converted exactly from BF16 or F16
    void read_floats(const SafetensorsTensor& t, float* dst) const {
        File f(path, "rb");
        const long at = (long)(data_start + t.begin);
        if (t.dtype == SafetensorsDtype::F32) return f.read_at(dst, (size_t)(t.end - t.begin), at);
        std::vector<uint16_t> halves((size_t)std::min<int64_t>(t.numel(), 1 << 20));
        for (int64_t done = 0, n = t.numel(); done < n;) {
            size_t k = (size_t)std::min<int64_t>(n - done, (int64_t)halves.size());
            f.read_at(halves.data(), k * 2, at + (long)done * 2);
            for (size_t i = 0; i < k; i++)
                dst[done + i] = t.dtype == SafetensorsDtype::BF16 ? bf16_bits_to_float(halves[i]) : float_from_f16(halves[i]);
            done += (int64_t)k;
        }
    }
};

// one tensor's entry in the header, checked against the data section's size
inline SafetensorsTensor safetensors_entry(const std::string& path, const std::string& name, const JsonValue& v,
                                           int64_t data_bytes) {
    const char* p = path.c_str();
    const char* n = name.c_str();
    SafetensorsTensor t;
    t.name = name;
    v.as_object();
    const std::string& dtype = v.at("dtype").as_string();
    if (dtype == "F32") t.dtype = SafetensorsDtype::F32;
    else if (dtype == "BF16") t.dtype = SafetensorsDtype::BF16;
    else if (dtype == "F16") t.dtype = SafetensorsDtype::F16;
    else fail("%s: tensor \"%s\": dtype \"%s\" is not supported (F32, BF16 and F16 are)", p, n, dtype.c_str());
    int64_t numel = 1;
    std::string shape_text;
    for (const JsonValue& d : v.at("shape").as_array()) {
        int64_t dim = d.as_int64();
        if (dim < 0) fail("%s: tensor \"%s\": shape has a negative dimension %lld", p, n, (long long)dim);
        if (__builtin_mul_overflow(numel, dim, &numel)) fail("%s: tensor \"%s\": shape is too large", p, n);
        t.shape.push_back(dim);
        shape_text += (shape_text.empty() ? "" : ", ") + std::to_string(dim);
    }
    int64_t bytes;
    if (__builtin_mul_overflow(numel, dtype_bytes(t.dtype), &bytes)) fail("%s: tensor \"%s\": shape is too large", p, n);
    const std::vector<JsonValue>& offsets = v.at("data_offsets").as_array();
    if (offsets.size() != 2) fail("%s: tensor \"%s\": data_offsets must be [begin, end]", p, n);
    t.begin = offsets[0].as_int64(), t.end = offsets[1].as_int64();
    if (t.begin < 0 || t.end < t.begin)
        fail("%s: tensor \"%s\": data_offsets [%lld, %lld] are not 0 <= begin <= end", p, n, (long long)t.begin,
             (long long)t.end);
    if (t.end - t.begin != bytes)
        fail("%s: tensor \"%s\": data_offsets [%lld, %lld] hold %lld bytes, but shape [%s] of %s needs %lld", p, n,
             (long long)t.begin, (long long)t.end, (long long)(t.end - t.begin), shape_text.c_str(), dtype.c_str(),
             (long long)bytes);
    if (t.end > data_bytes)
        fail("%s: tensor \"%s\": data_offsets [%lld, %lld] run past the end of the %lld-byte data section", p, n,
             (long long)t.begin, (long long)t.end, (long long)data_bytes);
    return t;
}

// the tensors of a file, after checking that its header describes exactly its data section
inline SafetensorsFile read_safetensors(const std::string& path) {
    const char* p = path.c_str();
    SafetensorsFile st;
    st.path = path;
    File f(path, "rb");
    const long size = f.size();
    if (size < 8) fail("%s: truncated: %ld bytes, too short for the 8-byte header length", p, size);
    unsigned char len[8];
    f.read(len, 8);
    uint64_t n = 0;
    for (int i = 7; i >= 0; i--) n = n << 8 | len[i];
    if (n > SAFETENSORS_MAX_HEADER)
        fail("%s: header length %llu is over the %zu-byte limit", p, (unsigned long long)n, SAFETENSORS_MAX_HEADER);
    if (n > (uint64_t)size - 8)
        fail("%s: header length %llu runs past the end of the file (%ld bytes)", p, (unsigned long long)n, size);
    std::string header(n, '\0');
    f.read(&header[0], n);
    st.data_start = 8 + (int64_t)n;
    const int64_t data_bytes = size - st.data_start;

    JsonDoc doc(header, path);
    const JsonValue& root = doc.root.as_object();
    for (size_t i = 0; i < root.keys.size(); i++) {
        const std::string& name = root.keys[i];
        if (name == "__metadata__") {
            const JsonValue& m = root.items[i].as_object();
            for (size_t j = 0; j < m.keys.size(); j++) st.metadata[m.keys[j]] = m.items[j].as_string();
            continue;
        }
        st.index[name] = st.tensors.size();  // the JSON reader has refused duplicate names
        st.tensors.push_back(safetensors_entry(path, name, root.items[i], data_bytes));
    }

    // in the order of their data, each tensor must start where the one before ended, and the last end the file
    std::vector<const SafetensorsTensor*> order;
    for (const SafetensorsTensor& t : st.tensors) order.push_back(&t);
    std::sort(order.begin(), order.end(), [](const SafetensorsTensor* a, const SafetensorsTensor* b) {
        return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    const SafetensorsTensor* before = nullptr;
    int64_t covered = 0;  // bytes of the data section accounted for so far
    for (const SafetensorsTensor* t : order) {
        if (t->begin < covered)
            fail("%s: tensors \"%s\" [%lld, %lld] and \"%s\" [%lld, %lld] overlap", p, before->name.c_str(),
                 (long long)before->begin, (long long)before->end, t->name.c_str(), (long long)t->begin,
                 (long long)t->end);
        if (t->begin > covered)
            fail("%s: a gap in the data section: bytes [%lld, %lld) before tensor \"%s\" belong to no tensor", p,
                 (long long)covered, (long long)t->begin, t->name.c_str());
        covered = t->end;
        before = t;
    }
    if (covered != data_bytes)
        fail("%s: a gap in the data section: bytes [%lld, %lld) at its end belong to no tensor", p, (long long)covered,
             (long long)data_bytes);
    return st;
}

// ----------------------------------------------------------------------------------------------------------
// writing

// Collects tensors and metadata, then writes them in one go. add() keeps a pointer to the values, not a copy
// (a model's parameters are written straight from their buffer): they must stay valid until write().
struct SafetensorsWriter {
    struct Entry {
        std::string name;
        SafetensorsDtype dtype;
        std::vector<int64_t> shape;
        const float* values;
        int64_t numel;
    };
    std::vector<Entry> entries;  // in the order added, which is the order in the file
    std::vector<std::pair<std::string, std::string>> meta;

    void add(const std::string& name, SafetensorsDtype dtype, const std::vector<int64_t>& shape, const float* values) {
        if (name == "__metadata__") fail("safetensors: \"__metadata__\" cannot name a tensor");
        for (const Entry& e : entries)
            if (e.name == name) fail("safetensors: tensor \"%s\" added twice", name.c_str());
        int64_t numel = 1;
        for (int64_t d : shape)
            if (d < 0 || __builtin_mul_overflow(numel, d, &numel))
                fail("safetensors: tensor \"%s\": bad shape dimension %lld", name.c_str(), (long long)d);
        if (numel > 0 && !values) fail("safetensors: tensor \"%s\": no values", name.c_str());
        entries.push_back(Entry{name, dtype, shape, values, numel});
    }
    void metadata(const std::string& key, const std::string& value) {
        for (const auto& kv : meta)
            if (kv.first == key) fail("safetensors: metadata \"%s\" set twice", key.c_str());
        meta.emplace_back(key, value);
    }

    // the header's JSON, padded with spaces to a multiple of 8 bytes
    std::string header() const {
        JsonOut root = JsonOut::object();
        if (!meta.empty()) {
            JsonOut m = JsonOut::object();
            for (const auto& kv : meta) m.set(kv.first, kv.second);
            root.set("__metadata__", m);
        }
        int64_t offset = 0;
        for (const Entry& e : entries) {
            int64_t end = offset + e.numel * dtype_bytes(e.dtype);
            JsonOut t = JsonOut::object();
            t.set("dtype", dtype_name(e.dtype));
            t.set("shape", JsonOut::array_of(e.shape));
            t.set("data_offsets", JsonOut::array_of(std::vector<int64_t>{offset, end}));
            root.set(e.name, t);
            offset = end;
        }
        std::string text = root.dump(0);
        text.append((8 - text.size() % 8) % 8, ' ');
        return text;
    }

    // writes path.tmp and renames it to path once complete; returns the FNV-1a checksum of the file's bytes
    uint64_t write(const std::string& path) const {
        const std::string tmp = path + ".tmp";
        uint64_t checksum;
        try {
            File f(tmp, "wb");
            std::string h = header();
            unsigned char len[8];
            for (int i = 0; i < 8; i++) len[i] = (unsigned char)((uint64_t)h.size() >> (8 * i));
            f.write(len, 8);
            f.write(h.data(), h.size());
            std::vector<uint16_t> halves(1 << 20);
            for (const Entry& e : entries) {
                if (e.dtype == SafetensorsDtype::F32) {
                    if (e.numel > 0) f.write(e.values, (size_t)e.numel * 4);
                    continue;
                }
                for (int64_t done = 0; done < e.numel;) {
                    size_t k = (size_t)std::min<int64_t>(e.numel - done, (int64_t)halves.size());
                    for (size_t i = 0; i < k; i++)
                        halves[i] = e.dtype == SafetensorsDtype::BF16 ? float_to_bf16_bits(e.values[done + i])
                                                                     : f16_from_float(e.values[done + i]);
                    f.write(halves.data(), k * 2);
                    done += (int64_t)k;
                }
            }
            f.close();
            checksum = f.written.value;
        } catch (...) {
            remove(tmp.c_str());
            throw;
        }
        if (rename(tmp.c_str(), path.c_str()) != 0) fail("%s: cannot rename into place (%s)", tmp.c_str(), strerror(errno));
        return checksum;
    }
};
