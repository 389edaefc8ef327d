// Tests of the JSON reader and writer (llmc/json.h) and of safetensors files (llmc/safetensors.h): the 16-bit
// conversions against CUDA's host conversions (the reference, bit for bit), round trips of every dtype, files
// byte for byte as HF's writer lays them out (its own test vectors, from huggingface/safetensors' tensor.rs),
// JSON edge cases, and a one-line error naming the file and the tensor for every kind of bad file.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <initializer_list>

#include "llmc/json.h"
#include "llmc/safetensors.h"
#include "test_helpers.h"

namespace test_safetensors {

std::string bytes(std::initializer_list<int> values) {
    std::string s;
    for (int v : values) s += (char)(unsigned char)v;
    return s;
}

std::string read_bytes(const std::string& path) {
    File f(path, "rb");
    std::string s((size_t)f.size(), '\0');
    if (!s.empty()) f.read(&s[0], s.size());
    return s;
}

void write_bytes(const std::string& path, const std::string& b) {
    File f(path, "wb");
    f.write(b.data(), b.size());
    f.close();
}

// a safetensors file from its header text (not padded) and its data section's bytes
void write_raw(const std::string& path, const std::string& header, const std::string& data) {
    std::string len;
    for (int i = 0; i < 8; i++) len += (char)(unsigned char)((uint64_t)header.size() >> (8 * i));
    write_bytes(path, len + header + data);
}

// the error of fn(), which must fail with Error in one line
template <typename Fn>
std::string error_of(Fn fn) {
    try {
        fn();
    } catch (const Error& e) {
        std::string what = e.what();
        INFO(what);
        CHECK(what.find('\n') == std::string::npos);
        return what;
    }
    FAIL("no error");
    return "";
}

uint16_t cuda_bf16(float x) {
    __nv_bfloat16_raw h = __float2bfloat16(x);
    return h.x;
}
uint16_t cuda_f16(float x) {
    __half_raw h = __float2half_rn(x);
    return h.x;
}

// values that test the rounding: ties to even both ways in bf16 and f16, subnormals of both, the edges of f16's
// range, infinities and NaN
std::vector<float> hard_values() {
    std::vector<float> v = {0.0f, -0.0f, 1.0f, -2.5f, 3.14159265f, 65504.0f, 65519.0f, 65520.0f, -65520.0f, 1e10f,
                            2049.0f, 2051.0f, 6.103515625e-05f, 5.9604644775390625e-08f, 2.98023223876953125e-08f,
                            4.4703483581542969e-08f, 8.9406967163085938e-08f, 1e-8f, 1e-40f,
                            INFINITY, -INFINITY, NAN, 3.4028234663852886e38f};
    for (uint32_t bits : {0x387FE000u, 0x3F808000u, 0x3F818000u, 0x3F808001u, 0x3F807FFFu, 0x7F7F8000u, 0x00018000u, 0x80008000u})
        v.push_back(f32_from_bits(bits));
    return v;
}

TEST_CASE("safetensors: 16-bit conversions match CUDA's, bit for bit", "[safetensors]") {
    // widening: every 16-bit pattern
    for (uint32_t h = 0; h < 65536; h++) {
        const uint16_t bits = (uint16_t)h;
        __half_raw hf;
        __nv_bfloat16_raw hb;
        hf.x = hb.x = bits;
        float f16 = __half2float(hf), b16 = __bfloat162float(hb);
        INFO("bits 0x" << std::hex << h);
        if (std::isnan(f16)) REQUIRE(std::isnan(float_from_f16(bits)));
        else REQUIRE(f32_bits(float_from_f16(bits)) == f32_bits(f16));
        if (std::isnan(b16)) REQUIRE(std::isnan(bf16_bits_to_float(bits)));
        else REQUIRE(f32_bits(bf16_bits_to_float(bits)) == f32_bits(b16));
        // a NaN comes back a NaN, with its payload and a quiet bit; anything else comes back exactly
        if (!std::isnan(f16)) REQUIRE(f16_from_float(float_from_f16(bits)) == bits);
        if (!std::isnan(b16)) REQUIRE(float_to_bf16_bits(bf16_bits_to_float(bits)) == bits);
    }
    // narrowing: every exponent and sign with the low mantissa bits at, around and far from both ties
    std::vector<uint32_t> lows = {0x0000, 0x0001, 0x0FFF, 0x1000, 0x1001, 0x1FFF, 0x2000, 0x3000, 0x7FFF, 0x8000,
                                  0x8001, 0xFFFF, 0x18000, 0x1F000};
    size_t checked = 0;
    for (uint32_t high = 0; high < (1u << 16); high++)
        for (uint32_t low : lows) {
            uint32_t bits = (high << 16) ^ low;
            float x = f32_from_bits(bits);
            uint16_t ours_b = float_to_bf16_bits(x), ours_f = f16_from_float(x);
            INFO("fp32 bits 0x" << std::hex << bits);
            if (std::isnan(x)) {
                REQUIRE(std::isnan(bf16_bits_to_float(ours_b)));
                REQUIRE(std::isnan(float_from_f16(ours_f)));
                continue;
            }
            REQUIRE(ours_b == cuda_bf16(x));
            REQUIRE(ours_f == cuda_f16(x));
            checked++;
        }
    Rng rng(7);
    for (int i = 0; i < 1000000; i++) {
        float x = f32_from_bits((uint32_t)rng.next_u64());
        if (std::isnan(x)) continue;
        REQUIRE(float_to_bf16_bits(x) == cuda_bf16(x));
        REQUIRE(f16_from_float(x) == cuda_f16(x));
    }
    REQUIRE(checked > 900000);
    // the cases by name
    REQUIRE(float_to_bf16_bits(f32_from_bits(0x3F808000u)) == 0x3F80);  // a tie goes to the even neighbor, down
    REQUIRE(float_to_bf16_bits(f32_from_bits(0x3F818000u)) == 0x3F82);  // and up
    REQUIRE(float_to_bf16_bits(3.4028234663852886e38f) == 0x7F80);      // fp32's largest rounds to inf
    REQUIRE(f16_from_float(2049.0f) == 0x6800);                      // 2048
    REQUIRE(f16_from_float(2051.0f) == 0x6802);                      // 2052
    REQUIRE(f16_from_float(65519.0f) == 0x7BFF);                     // 65504, f16's largest
    REQUIRE(f16_from_float(65520.0f) == 0x7C00);                     // inf
    REQUIRE(f16_from_float(5.9604644775390625e-08f) == 0x0001);      // 2^-24, the smallest subnormal
    REQUIRE(f16_from_float(2.98023223876953125e-08f) == 0x0000);     // 2^-25: a tie with zero
    REQUIRE(f16_from_float(8.9406967163085938e-08f) == 0x0002);      // 1.5 * 2^-24: a tie, to 2 units
    REQUIRE(f16_from_float(f32_from_bits(0x387FE000u)) == 0x0400);  // 1023.5 * 2^-24: a tie, up into the normals
    REQUIRE(f16_from_float(-0.0f) == 0x8000);
    REQUIRE(float_from_f16(0x0001) == 5.9604644775390625e-08f);
    REQUIRE(float_from_f16(0x83FF) == -6.0975551605224609e-05f);
}

TEST_CASE("safetensors: every dtype round-trips, odd sizes, scalars and empty tensors included", "[safetensors]") {
    TempDir dir;
    const std::string path = dir / "model.safetensors";
    Rng rng(42);
    std::vector<float> hard = hard_values();
    std::vector<float> odd = random_vector(3 * 5 * 7, rng, 100.0f);  // 105 values: the next tensor starts unaligned
    std::copy(hard.begin(), hard.end(), odd.begin());
    const float scalar = 0.1f;
    SafetensorsWriter w;
    w.add("odd.f16", SafetensorsDtype::F16, {3, 5, 7}, odd.data());
    w.add("odd.bf16", SafetensorsDtype::BF16, {3, 5, 7}, odd.data());
    w.add("odd.f32", SafetensorsDtype::F32, {105}, odd.data());
    w.add("scalar", SafetensorsDtype::BF16, {}, &scalar);
    w.add("empty", SafetensorsDtype::F32, {0, 4}, nullptr);
    w.metadata("format", "pt");
    w.metadata("note", "quotes \" and \\ and \xc3\xa9");
    const uint64_t checksum = w.write(path);
    REQUIRE(!file_exists(path + ".tmp"));
    const std::string written = read_bytes(path);
    Fnv1a64 fnv;
    fnv.update(written.data(), written.size());
    REQUIRE(checksum == fnv.value);

    SafetensorsFile st = read_safetensors(path);
    REQUIRE(st.data_start % 8 == 0);
    REQUIRE(st.tensors.size() == 5);
    const char* names[] = {"odd.f16", "odd.bf16", "odd.f32", "scalar", "empty"};
    for (int i = 0; i < 5; i++) REQUIRE(st.tensors[i].name == names[i]);
    REQUIRE(st.metadata.size() == 2);
    REQUIRE(st.metadata.at("note") == "quotes \" and \\ and \xc3\xa9");
    REQUIRE(st.find("nothing") == nullptr);
    REQUIRE(st.find("odd.bf16") == &st.tensors[1]);
    REQUIRE(st.tensors[0].shape == std::vector<int64_t>{3, 5, 7});
    REQUIRE(st.tensors[1].begin == 210);  // after 105 halves

    std::vector<float> back(105);
    st.read_floats(*st.find("odd.f32"), back.data());
    for (size_t i = 0; i < odd.size(); i++) {
        INFO(i << ": " << odd[i]);
        REQUIRE(memcmp(&back[i], &odd[i], 4) == 0);  // NaN and -0 included
    }
    for (const char* name : {"odd.bf16", "odd.f16"}) {
        const SafetensorsTensor* t = st.find(name);
        REQUIRE(t->numel() == 105);
        st.read_floats(*t, back.data());
        for (size_t i = 0; i < odd.size(); i++) {
            INFO(name << " " << i << ": " << odd[i]);
            if (std::isnan(odd[i])) {
                REQUIRE(std::isnan(back[i]));
                continue;
            }
            float want = t->dtype == SafetensorsDtype::BF16 ? __bfloat162float(__float2bfloat16(odd[i]))
                                                            : __half2float(__float2half_rn(odd[i]));
            REQUIRE(f32_bits(back[i]) == f32_bits(want));
        }
    }
    float s = 0.0f;
    REQUIRE(st.find("scalar")->shape.empty());
    st.read_floats(*st.find("scalar"), &s);
    REQUIRE(s == __bfloat162float(__float2bfloat16(0.1f)));
    const SafetensorsTensor* empty = st.find("empty");
    REQUIRE(empty->numel() == 0);
    REQUIRE(empty->begin == empty->end);
    REQUIRE(empty->end == (int64_t)written.size() - st.data_start);
}

TEST_CASE("safetensors: files byte for byte as HF's writer lays them out", "[safetensors]") {
    TempDir dir;
    const std::string path = dir / "hf.safetensors";
    SECTION("HF's test vector: one F32 tensor, the header padded with 7 spaces to 72 bytes") {
        const std::string expected =
            bytes({72, 0, 0, 0, 0, 0, 0, 0}) + R"({"attn0":{"dtype":"F32","shape":[1,1,2,3],"data_offsets":[0,24]}})" +
            "       " + bytes({0, 0, 0, 0, 0, 0, 128, 63, 0, 0, 0, 64, 0, 0, 64, 64, 0, 0, 128, 64, 0, 0, 160, 64});
        const float values[] = {0, 1, 2, 3, 4, 5};
        SafetensorsWriter w;
        w.add("attn0", SafetensorsDtype::F32, {1, 1, 2, 3}, values);
        w.write(path);
        REQUIRE(read_bytes(path) == expected);
        SafetensorsFile st = read_safetensors(path);
        REQUIRE(st.data_start == 80);
        float back[6];
        st.read_floats(st.tensors[0], back);
        for (int i = 0; i < 6; i++) REQUIRE(back[i] == values[i]);
    }
    SECTION("HF's test vectors: no tensors, with and without metadata") {
        SafetensorsWriter w;
        w.write(path);
        REQUIRE(read_bytes(path) == bytes({8, 0, 0, 0, 0, 0, 0, 0}) + "{}      ");
        REQUIRE(read_safetensors(path).tensors.empty());
        w.metadata("framework", "pt");
        w.write(path);
        REQUIRE(read_bytes(path) == bytes({40, 0, 0, 0, 0, 0, 0, 0}) + R"({"__metadata__":{"framework":"pt"}})" + "     ");
        REQUIRE(read_safetensors(path).metadata.at("framework") == "pt");
    }
    SECTION("three dtypes in HF's order (widest dtype first, then by name), metadata first") {
        // 195 bytes of JSON and 5 spaces; the BF16 tie 1.00390625 rounds to 1.0, F16 65520 to inf
        const std::string expected =
            bytes({200, 0, 0, 0, 0, 0, 0, 0}) +
            R"({"__metadata__":{"format":"pt"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
            R"("b":{"dtype":"BF16","shape":[3],"data_offsets":[8,14]},"c":{"dtype":"F16","shape":[1],"data_offsets":[14,16]}})" +
            "     " + bytes({0, 0, 128, 63, 0, 0, 0, 192, 128, 63, 128, 63, 64, 64, 0, 124});
        const float a[] = {1.0f, -2.0f}, b[] = {1.0f, 1.00390625f, 3.0f}, c[] = {65520.0f};
        SafetensorsWriter w;
        w.metadata("format", "pt");
        w.add("a", SafetensorsDtype::F32, {2}, a);
        w.add("b", SafetensorsDtype::BF16, {3}, b);
        w.add("c", SafetensorsDtype::F16, {1}, c);
        w.write(path);
        REQUIRE(read_bytes(path) == expected);
    }
    SECTION("a header whose order differs from the data's, pretty-printed, with padding") {
        write_raw(path,
                  "{\n  \"second\": {\"dtype\": \"F16\", \"shape\": [1], \"data_offsets\": [4, 6]},\n"
                  "  \"first\": {\"dtype\": \"BF16\", \"shape\": [2], \"data_offsets\": [0, 4]}\n}   ",
                  bytes({128, 63, 0, 64, 0, 60}));
        SafetensorsFile st = read_safetensors(path);
        REQUIRE(st.tensors[0].name == "second");  // the header's order
        float v[2];
        st.read_floats(*st.find("first"), v);
        REQUIRE((v[0] == 1.0f && v[1] == 2.0f));
        st.read_floats(*st.find("second"), v);
        REQUIRE(v[0] == 1.0f);
    }
}

TEST_CASE("safetensors: a file is published whole or not at all", "[safetensors]") {
    TempDir dir;
    const float x = 1.0f;
    SafetensorsWriter w;
    w.add("x", SafetensorsDtype::F32, {1}, &x);
    SECTION("into a missing directory: an error and nothing written") {
        const std::string path = dir / "missing/model.safetensors";
        REQUIRE_THAT(error_of([&] { w.write(path); }), Catch::Contains(path + ".tmp") && Catch::Contains("cannot open"));
        REQUIRE(!file_exists(path));
    }
    SECTION("over an old file: replaced, with no .tmp left") {
        const std::string path = dir / "model.safetensors";
        write_bytes(path, "old");
        w.write(path);
        REQUIRE(read_safetensors(path).tensors.size() == 1);
        REQUIRE(!file_exists(path + ".tmp"));
    }
    SECTION("the writer refuses what it could not write") {
        REQUIRE_THAT(error_of([&] { w.add("x", SafetensorsDtype::F16, {1}, &x); }), Catch::Contains("\"x\" added twice"));
        REQUIRE_THAT(error_of([&] { w.add("y", SafetensorsDtype::F16, {2, -1}, &x); }),
                     Catch::Contains("\"y\"") && Catch::Contains("-1"));
        REQUIRE_THAT(error_of([&] { w.add("__metadata__", SafetensorsDtype::F32, {1}, &x); }),
                     Catch::Contains("__metadata__"));
        REQUIRE_THAT(error_of([&] { w.add("z", SafetensorsDtype::F32, {1}, nullptr); }), Catch::Contains("no values"));
        w.metadata("k", "v");
        REQUIRE_THAT(error_of([&] { w.metadata("k", "w"); }), Catch::Contains("\"k\" set twice"));
    }
}

TEST_CASE("safetensors: bad files give one-line errors naming the file and the tensor", "[safetensors]") {
    TempDir dir;
    const std::string path = dir / "bad.safetensors";
    const std::string t_a = R"("a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
    const std::string data8(8, '\0');
    // reading fails with one line holding the file's name and each of `parts`
    auto refused = [&](std::initializer_list<std::string> parts) {
        const std::string e = error_of([&] { read_safetensors(path); });
        CHECK_THAT(e, Catch::Contains(path));
        for (const std::string& part : parts) CHECK_THAT(e, Catch::Contains(part));
    };

    SECTION("the control: a good file") {
        write_raw(path, "{" + t_a + "}", data8);
        REQUIRE(read_safetensors(path).tensors.size() == 1);
    }
    SECTION("missing") { refused({"cannot open"}); }
    SECTION("truncated: shorter than the header length") {
        write_bytes(path, bytes({8, 0, 0}));
        refused({"truncated: 3 bytes"});
    }
    SECTION("truncated: within the header") {
        write_raw(path, "{" + t_a + "}", data8);
        std::string b = read_bytes(path);
        write_bytes(path, b.substr(0, 30));
        refused({"header length 54 runs past the end of the file (30 bytes)"});
    }
    SECTION("truncated: within the data") {
        write_raw(path, "{" + t_a + "}", data8.substr(0, 5));
        refused({"tensor \"a\"", "past the end of the 5-byte data section"});
    }
    SECTION("a header length over the limit") {
        write_bytes(path, bytes({0, 0, 0, 0, 1, 0, 0, 0}) + "{}");
        refused({"header length 4294967296 is over the 100000000-byte limit"});
    }
    SECTION("offsets past the end") {
        write_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})", data8);
        refused({"tensor \"a\": data_offsets [8, 16] run past the end of the 8-byte data section"});
    }
    SECTION("overlapping tensors") {
        write_raw(path, "{" + t_a + R"(,"b":{"dtype":"BF16","shape":[2],"data_offsets":[6,10]}})", std::string(10, '\0'));
        refused({"tensors \"a\" [0, 8] and \"b\" [6, 10] overlap"});
    }
    SECTION("the same bytes twice") {
        write_raw(path, "{" + t_a + R"(,"b":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})", data8);
        refused({"overlap", "\"a\"", "\"b\""});
    }
    SECTION("a gap between tensors") {
        write_raw(path, "{" + t_a + R"(,"b":{"dtype":"F16","shape":[1],"data_offsets":[10,12]}})", std::string(12, '\0'));
        refused({"a gap in the data section: bytes [8, 10) before tensor \"b\""});
    }
    SECTION("a gap before the first tensor") {
        write_raw(path, R"({"a":{"dtype":"F16","shape":[1],"data_offsets":[2,4]}})", std::string(4, '\0'));
        refused({"bytes [0, 2) before tensor \"a\""});
    }
    SECTION("bytes after the last tensor") {
        write_raw(path, "{" + t_a + "}", std::string(12, '\0'));
        refused({"a gap in the data section: bytes [8, 12) at its end"});
    }
    SECTION("size and shape disagree") {
        write_raw(path, R"({"a":{"dtype":"BF16","shape":[2,3],"data_offsets":[0,8]}})", data8);
        refused({"tensor \"a\": data_offsets [0, 8] hold 8 bytes, but shape [2, 3] of BF16 needs 12"});
    }
    SECTION("an unsupported dtype") {
        write_raw(path, R"({"a":{"dtype":"I64","shape":[1],"data_offsets":[0,8]}})", data8);
        refused({"tensor \"a\": dtype \"I64\" is not supported (F32, BF16 and F16 are)"});
    }
    SECTION("an unknown dtype") {
        write_raw(path, R"({"a":{"dtype":"Q4","shape":[1],"data_offsets":[0,8]}})", data8);
        refused({"tensor \"a\": dtype \"Q4\" is not supported"});
    }
    SECTION("a negative dimension") {
        write_raw(path, R"({"a":{"dtype":"F32","shape":[-2],"data_offsets":[0,8]}})", data8);
        refused({"tensor \"a\": shape has a negative dimension -2"});
    }
    SECTION("a shape whose size overflows") {
        write_raw(path, R"({"a":{"dtype":"F32","shape":[4294967296,4294967296],"data_offsets":[0,8]}})", data8);
        refused({"tensor \"a\": shape is too large"});
    }
    SECTION("a dimension that is not an integer") {
        write_raw(path, R"({"a":{"dtype":"F32","shape":[2.5],"data_offsets":[0,8]}})", data8);
        refused({"\"a\".\"shape\"[0]: expected an integer"});
    }
    SECTION("data_offsets not a pair") {
        write_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", data8);
        refused({"tensor \"a\": data_offsets must be [begin, end]"});
    }
    SECTION("a missing field") {
        write_raw(path, R"({"a":{"dtype":"F32","data_offsets":[0,8]}})", data8);
        refused({"\"a\": missing \"shape\""});
    }
    SECTION("invalid JSON") {
        write_raw(path, R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})", data8);
        refused({"invalid JSON at line 1, column 54: unexpected end"});
    }
    SECTION("trailing bytes after the JSON inside the header") {
        write_raw(path, "{" + t_a + std::string("}\0\0\0", 4), data8);
        refused({"trailing characters"});
    }
    SECTION("duplicate tensor names") {
        write_raw(path, "{" + t_a + "," + t_a + "}", data8);
        refused({"duplicate key \"a\""});
    }
    SECTION("a header that is not an object") {
        write_raw(path, "[]", "");
        refused({"expected an object"});
    }
    SECTION("metadata that is not strings") {
        write_raw(path, R"({"__metadata__":{"step":5}})", "");
        refused({"\"__metadata__\".\"step\": expected a string"});
    }
    SECTION("a file that shrinks after its header was read") {
        write_raw(path, "{" + t_a + "}", data8);
        SafetensorsFile st = read_safetensors(path);
        write_raw(path, "{" + t_a + "}", data8.substr(0, 4));
        std::vector<float> v(2);
        REQUIRE_THAT(error_of([&] { st.read_floats(st.tensors[0], v.data()); }),
                     Catch::Contains(path) && Catch::Contains("shorter than its header says"));
    }
}

// damaged files are refused with Error or read; never another exception, a crash or a hang
TEST_CASE("safetensors: random damage gives errors, never a crash", "[safetensors]") {
    TempDir dir;
    const std::string path = dir / "model.safetensors";
    std::vector<float> values = {1, 2, 3, 4, 5, 6};
    SafetensorsWriter w;
    w.metadata("format", "pt");
    w.add("w", SafetensorsDtype::BF16, {2, 3}, values.data());
    w.add("b", SafetensorsDtype::F32, {2}, values.data());
    w.write(path);
    const std::string good = read_bytes(path);
    Rng rng(3);
    int refused = 0, read = 0;
    for (int trial = 0; trial < 3000; trial++) {
        std::string b = good;
        if (trial < (int)good.size()) {
            b.resize((size_t)trial);  // every truncation
        } else {
            for (int k = 0, n = 1 + (int)rng.below(4); k < n; k++) {
                size_t at = rng.below(b.size());
                b[at] = rng.below(2) ? (char)rng.below(256) : "{}[]\":,0-9e\\"[rng.below(12)];
            }
        }
        write_bytes(path, b);
        try {
            SafetensorsFile st = read_safetensors(path);
            std::vector<float> v;
            for (const SafetensorsTensor& t : st.tensors) {
                v.resize((size_t)t.numel());
                st.read_floats(t, v.data());
            }
            read++;
        } catch (const Error& e) {
            REQUIRE(std::string(e.what()).find(path) != std::string::npos);
            refused++;
        }
    }
    REQUIRE(refused > 2000);
    REQUIRE(read > 0);  // damage to the data bytes only
}

// ----------------------------------------------------------------------------------------------------------
// JSON

TEST_CASE("json: strings, escapes and UTF-8", "[safetensors][json]") {
    JsonDoc doc(R"({"s": "q\" b\\ s\/ \b\f\n\r\t \u00e9 \u20AC \ud83d\ude00 raw é €", "empty": ""})", "t.json");
    REQUIRE(doc.root.at("s").as_string() ==
            "q\" b\\ s/ \b\f\n\r\t \xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80 raw \xc3\xa9 \xe2\x82\xac");
    REQUIRE(doc.root.at("empty").as_string().empty());
    JsonDoc nul(R"(["a\u0000b"])", "t.json");
    REQUIRE(nul.root.as_array()[0].as_string() == std::string("a\0b", 3));
}

TEST_CASE("json: numbers", "[safetensors][json]") {
    JsonDoc doc(R"([1e-5, -0, -0.0, 0, 1E+2, 2.5e3, 1e3, 9223372036854775807, -9223372036854775808,
                    9223372036854775808, 12345678901234567890123, 0.1, 1e-400, 7])",
                "n.json");
    const std::vector<JsonValue>& n = doc.root.as_array();
    REQUIRE(n[0].as_double() == 1e-5);
    REQUIRE(n[1].as_int64() == 0);
    REQUIRE(std::signbit(n[2].as_double()));
    REQUIRE(n[2].as_int64() == 0);
    REQUIRE(n[3].as_int64() == 0);
    REQUIRE(n[4].as_int64() == 100);
    REQUIRE(n[5].as_int64() == 2500);
    REQUIRE(n[6].as_int64() == 1000);
    REQUIRE(n[7].as_int64() == INT64_MAX);
    REQUIRE(n[8].as_int64() == INT64_MIN);
    REQUIRE(n[9].as_double() == 9223372036854775808.0);
    REQUIRE_THAT(error_of([&] { n[9].as_int64(); }), Catch::Contains("n.json: [9]: 9.2233720368547758e+18 is beyond"));
    REQUIRE_THAT(error_of([&] { n[10].as_int64(); }), Catch::Contains("[10]") && Catch::Contains("beyond"));
    REQUIRE(n[11].as_double() == 0.1);
    REQUIRE(n[12].as_double() == 0.0);  // underflows to zero, as strtod and Python read it
    REQUIRE_THAT(error_of([&] { n[0].as_int64(); }), Catch::Equals("n.json: [0]: expected an integer"));
    REQUIRE(n[13].as_double() == 7.0);
}

TEST_CASE("json: accessors fail naming the file, the key path and what was expected", "[safetensors][json]") {
    JsonDoc doc(R"({"num_key_value_heads": 8.5, "rope_scaling": {"factor": "x", "list": [1, {"deep": null}]},
                    "flag": true, "nothing": null})",
                "config.json");
    const JsonValue& r = doc.root;
    REQUIRE_THAT(error_of([&] { r.at("num_key_value_heads").as_int64(); }),
                 Catch::Equals("config.json: \"num_key_value_heads\": expected an integer"));
    REQUIRE_THAT(error_of([&] { r.at("rope_scaling").at("factor").as_double(); }),
                 Catch::Equals("config.json: \"rope_scaling\".\"factor\": expected a number"));
    REQUIRE_THAT(error_of([&] { r.at("rope_scaling").at("list").as_array()[1].at("deep").as_string(); }),
                 Catch::Equals("config.json: \"rope_scaling\".\"list\"[1].\"deep\": expected a string"));
    REQUIRE_THAT(error_of([&] { r.at("rope_scaling").at("missing"); }),
                 Catch::Equals("config.json: \"rope_scaling\": missing \"missing\""));
    REQUIRE_THAT(error_of([&] { r.at("flag").at("x"); }), Catch::Equals("config.json: \"flag\": expected an object"));
    REQUIRE_THAT(error_of([&] { r.as_array(); }), Catch::Equals("config.json: expected an array"));
    REQUIRE_THAT(error_of([&] { r.at("nothing").as_bool(); }), Catch::Contains("expected true or false"));
    REQUIRE(r.at("flag").as_bool());
    REQUIRE(r.at("nothing").is_null());
    REQUIRE(r.find("absent") == nullptr);
    REQUIRE(r.keys == std::vector<std::string>{"num_key_value_heads", "rope_scaling", "flag", "nothing"});
}

TEST_CASE("json: nesting to 64 levels, and not past it", "[safetensors][json]") {
    std::string ok = std::string(64, '[') + std::string(64, ']');
    JsonDoc doc(ok, "deep.json");
    const JsonValue* v = &doc.root;
    for (int i = 1; i < 64; i++) v = &v->as_array()[0];
    REQUIRE(v->as_array().empty());
    REQUIRE_THAT(error_of([&] { JsonDoc("[" + ok + "]", "deep.json"); }),
                 Catch::Contains("deep.json: invalid JSON") && Catch::Contains("nested deeper than 64"));
    std::string objects;
    for (int i = 0; i < 65; i++) objects += "{\"k\":";
    objects += "1" + std::string(65, '}');
    REQUIRE_THAT(error_of([&] { JsonDoc(objects, "deep.json"); }), Catch::Contains("nested deeper than 64"));
}

TEST_CASE("json: invalid documents are refused with where and why", "[safetensors][json]") {
    struct Bad {
        std::string text, why;
    };
    const std::vector<Bad> bad = {
        {"", "line 1, column 1: unexpected end"},
        {"   ", "unexpected end"},
        {"{} x", "line 1, column 4: trailing characters"},
        {"{}{}", "trailing characters"},
        {"[1,]", "unexpected character"},
        {"[1 2]", "expected ',' or ']'"},
        {"{\"a\" 1}", "expected ':'"},
        {"{\"a\":1,}", "expected a string key"},
        {"{a:1}", "expected a string key"},
        {"{\"a\":1,\n\"a\":2}", "line 2, column 1: duplicate key \"a\""},
        {"01", "leading zero"},
        {"1.", "expected a digit after '.'"},
        {".5", "unexpected character"},
        {"+1", "unexpected character"},
        {"-", "expected a digit"},
        {"1e", "expected a digit in the exponent"},
        {"1e400", "number out of range"},
        {"-1e400", "number out of range"},
        {"tru", "unexpected character"},
        {"nul", "unexpected character"},
        {"NaN", "unexpected character"},
        {"\"abc", "unterminated string"},
        {"\"a\\x\"", "unknown escape"},
        {"\"\\u12g4\"", "4 hex digits"},
        {"\"\\u12\"", "\\u escape"},
        {"\"\\ud800\"", "high surrogate without its low surrogate"},
        {"\"\\ud800\\u0041\"", "high surrogate without its low surrogate"},
        {"\"\\udc00\"", "lone low surrogate"},
        {"\"a\tb\"", "control character"},
        {"\"\xc0\x80\"", "invalid UTF-8"},
        {"\"\xed\xa0\x80\"", "invalid UTF-8"},
        {"\"\xf4\x90\x80\x80\"", "invalid UTF-8"},
        {"\"\xe2\x82\"", "invalid UTF-8"},
        {"\"\xff\"", "invalid UTF-8"},
        {std::string("[1]\0", 4), "trailing characters"},
    };
    for (const Bad& b : bad) {
        INFO("input: " << b.text);
        REQUIRE_THAT(error_of([&] { JsonDoc(b.text, "bad.json"); }),
                     Catch::StartsWith("bad.json: invalid JSON at line ") && Catch::Contains(b.why));
    }
    REQUIRE_THAT(error_of([&] { JsonDoc(std::string(JSON_MAX_BYTES + 1, ' '), "big.json"); }),
                 Catch::Equals("big.json: 100000001 bytes is over the 100000000-byte limit for JSON"));
}

TEST_CASE("json: written compact or as Python's json.dumps(indent=2), keys in the order set", "[safetensors][json]") {
    JsonOut config = JsonOut::object();
    config.set("architectures", JsonOut::array().push("LlamaForCausalLM"));
    config.set("hidden_size", 2048);
    config.set("rms_norm_eps", 1e-5);
    config.set("rope_theta", 500000.0);
    config.set("initializer_range", 0.02);
    config.set("tie_word_embeddings", true);
    config.set("rope_scaling", JsonOut::object().set("factor", 32.0).set("rope_type", "llama3"));
    config.set("pad_token_id", nullptr);
    config.set("empty", JsonOut::object());
    config.set("none", JsonOut::array());
    config.set("text", "tab\there \"q\" \x01 \xc3\xa9");
    config.set("big", (int64_t)INT64_MIN);
    config.set("size", (size_t)3);
    const std::string pretty = R"({
  "architectures": [
    "LlamaForCausalLM"
  ],
  "hidden_size": 2048,
  "rms_norm_eps": 1e-05,
  "rope_theta": 500000.0,
  "initializer_range": 0.02,
  "tie_word_embeddings": true,
  "rope_scaling": {
    "factor": 32.0,
    "rope_type": "llama3"
  },
  "pad_token_id": null,
  "empty": {},
  "none": [],
  "text": "tab\there \"q\" \u0001 é",
  "big": -9223372036854775808,
  "size": 3
})";
    REQUIRE(config.dump(2) == pretty);
    REQUIRE(config.dump(0) ==
            R"({"architectures":["LlamaForCausalLM"],"hidden_size":2048,"rms_norm_eps":1e-05,"rope_theta":500000.0,)"
            R"("initializer_range":0.02,"tie_word_embeddings":true,"rope_scaling":{"factor":32.0,"rope_type":"llama3"},)"
            R"("pad_token_id":null,"empty":{},"none":[],"text":"tab\there \"q\" \u0001 é","big":-9223372036854775808,"size":3})");
    // and it reads back
    TempDir dir;
    write_bytes(dir / "config.json", config.dump(2) + "\n");
    JsonDoc back = JsonDoc::from_file(dir / "config.json");
    REQUIRE(back.root.at("rms_norm_eps").as_double() == 1e-5);
    REQUIRE(back.root.at("big").as_int64() == INT64_MIN);
    REQUIRE(back.root.at("text").as_string() == "tab\there \"q\" \x01 \xc3\xa9");
    REQUIRE(back.root.at("rope_scaling").at("factor").as_int64() == 32);
    // every double comes back exactly from the shortest text
    Rng rng(5);
    for (int i = 0; i < 10000; i++) {
        double x = (double)rng.normal(0.0f, 1.0f) * std::pow(10.0, (double)rng.below(40) - 20.0);
        std::string t = JsonOut(x).text;
        REQUIRE(JsonDoc(t, "x").root.as_double() == x);
    }
    REQUIRE_THAT(error_of([&] { JsonOut(NAN); }), Catch::Contains("cannot write nan"));
    REQUIRE_THAT(error_of([&] { JsonOut::object().set("a", 1).set("a", 2); }), Catch::Contains("\"a\" set twice"));
    REQUIRE_THAT(error_of([&] { JsonOut::array().set("a", 1); }), Catch::Contains("not an object"));
}

}  // namespace test_safetensors
