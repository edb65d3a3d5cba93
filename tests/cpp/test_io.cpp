// Tests for the checkpoint I/O layer (src/io): safetensors reading/writing and validation,
// weight stores over folders and shards, JSON/config parsing, and hub-cache resolution.
#include <gtest/gtest.h>
#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "io/hub.h"
#include "io/json.h"
#include "io/safetensors.h"
#include "io/weights.h"
#include "mixlens/errors.h"
#include "mixlens/tensor.h"
#include "ops/dtype.h"

namespace fs = std::filesystem;
using namespace mixlens;
using namespace mixlens::io;

namespace {

// Runs `stmt`, requiring it to throw exactly-or-derived `type` whose message contains `substr`.
#define EXPECT_ERROR(stmt, type, substr)                                                         \
  do {                                                                                           \
    try {                                                                                        \
      stmt;                                                                                      \
      ADD_FAILURE() << "expected " #type " containing \"" << (substr) << "\", nothing thrown";   \
    } catch (const type& e_) {                                                                   \
      EXPECT_NE(std::string(e_.what()).find(substr), std::string::npos)                          \
          << "message \"" << e_.what() << "\" lacks \"" << (substr) << "\"";                     \
    } catch (const std::exception& e_) {                                                         \
      ADD_FAILURE() << "expected " #type ", got another exception: " << e_.what();               \
    }                                                                                            \
  } while (0)

class TempDir {
 public:
  TempDir() {
    std::string tmpl = (fs::temp_directory_path() / "mixlens_io_XXXXXX").string();
    if (!mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path_ = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const fs::path& path() const { return path_; }
  fs::path operator/(const std::string& s) const { return path_ / s; }

 private:
  fs::path path_;
};

// Sets (or unsets, with nullopt) an environment variable for the scope, restoring it afterwards.
class EnvGuard {
 public:
  EnvGuard(const char* name, std::optional<std::string> value) : name_(name) {
    if (const char* old = getenv(name)) old_ = old;
    if (value)
      setenv(name, value->c_str(), 1);
    else
      unsetenv(name);
  }
  ~EnvGuard() {
    if (old_)
      setenv(name_, old_->c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::optional<std::string> old_;
};

void write_file(const fs::path& p, const std::string& bytes) {
  fs::create_directories(p.parent_path());
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_file(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// A file image: 8-byte little-endian length (or `len_override`), header text, data.
std::string with_header(const std::string& header, const std::string& data = "",
                        std::optional<uint64_t> len_override = std::nullopt) {
  const uint64_t len = len_override ? *len_override : header.size();
  std::string out(8, '\0');
  std::memcpy(out.data(), &len, 8);
  return out + header + data;
}

struct RawTensor {
  std::string name, dtype;
  Shape shape;
  std::string bytes;
};

// A valid file image holding `ts` contiguously, for dtypes the writer does not produce.
std::string build_file(const std::vector<RawTensor>& ts, const std::string& metadata_json = "") {
  std::string header = "{";
  if (!metadata_json.empty()) header += "\"__metadata__\":" + metadata_json;
  std::string data;
  for (const auto& t : ts) {
    if (header.size() > 1) header += ",";
    std::string shape;
    for (size_t i = 0; i < t.shape.size(); ++i) {
      if (i) shape += ",";  // two appends: GCC 12 -O3 warns (-Wrestrict, falsely) on "," + to_string(...)
      shape += std::to_string(t.shape[i]);
    }
    header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[" + shape +
              "],\"data_offsets\":[" + std::to_string(data.size()) + "," +
              std::to_string(data.size() + t.bytes.size()) + "]}";
    data += t.bytes;
  }
  header += "}";
  return with_header(header, data);
}

template <class T>
std::string bytes_of(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

SafetensorsHeader parse(const std::string& image) {
  return SafetensorsFile::parse_header(reinterpret_cast<const uint8_t*>(image.data()), image.size(),
                                       "mem.safetensors");
}

// Reference half -> double, straight from the IEEE definition.
double f16_reference(uint16_t h) {
  const int sign = (h >> 15) ? -1 : 1;
  const int exp = (h >> 10) & 0x1f;
  const int mant = h & 0x3ff;
  if (exp == 0) return sign * std::ldexp(mant, -24);
  if (exp == 31) return mant ? std::nan("") : sign * std::numeric_limits<double>::infinity();
  return sign * std::ldexp(1024 + mant, exp - 25);
}

// Element i through the const accessor (the non-const one refuses borrowed, read-only tensors).
float elem(const Tensor& t, int64_t i) { return t[i]; }

uint16_t f32_to_bf16_trunc(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>(u >> 16);
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// dtypes and conversions

TEST(IoDType, NamesRoundTrip) {
  for (DType d : {DType::F32, DType::F16, DType::BF16, DType::F64, DType::I64, DType::I32,
                  DType::I16, DType::I8, DType::U8, DType::BOOL}) {
    DType back{};
    ASSERT_TRUE(parse_dtype(dtype_name(d), &back)) << dtype_name(d);
    EXPECT_EQ(back, d);
  }
  DType x{};
  EXPECT_FALSE(parse_dtype("F8_E4M3", &x));
  EXPECT_FALSE(parse_dtype("f32", &x));
  EXPECT_EQ(dtype_size(DType::BF16), 2u);
  EXPECT_EQ(dtype_size(DType::I64), 8u);
  EXPECT_EQ(dtype_size(DType::BOOL), 1u);
}

TEST(IoDType, F16ExhaustiveAgainstDefinition) {
  for (uint32_t h = 0; h < 65536; ++h) {
    const float got = f16_to_f32(static_cast<uint16_t>(h));
    const double want = f16_reference(static_cast<uint16_t>(h));
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got)) << h;
    } else {
      ASSERT_EQ(static_cast<double>(got), want) << "half bits " << h;
      EXPECT_EQ(std::signbit(got), (h & 0x8000u) != 0) << h;
    }
  }
  EXPECT_EQ(f16_to_f32(0x0001), std::ldexp(1.0f, -24));  // smallest subnormal
  EXPECT_EQ(f16_to_f32(0x03ff), 1023 * std::ldexp(1.0f, -24));
  EXPECT_EQ(f16_to_f32(0x3c00), 1.0f);
  EXPECT_EQ(f16_to_f32(0x7bff), 65504.0f);
  EXPECT_EQ(f16_to_f32(0xfc00), -std::numeric_limits<float>::infinity());
}

TEST(IoDType, Bf16AndF64) {
  for (float f : {0.0f, -0.0f, 1.0f, -2.5f, 3.140625f, 1e30f, -1e-30f}) {
    const float back = bf16_to_f32(f32_to_bf16_trunc(f));
    EXPECT_NEAR(back, f, std::fabs(f) / 128) << f;
  }
  EXPECT_EQ(bf16_to_f32(0x3f80), 1.0f);
  EXPECT_TRUE(std::isinf(bf16_to_f32(0x7f80)));
  EXPECT_TRUE(std::isnan(bf16_to_f32(0x7fc0)));

  EXPECT_EQ(f64_to_f32(1.5), 1.5f);
  EXPECT_EQ(f64_to_f32(3.4028234663852886e38), std::numeric_limits<float>::max());
  EXPECT_EQ(f64_to_f32(1e39), std::numeric_limits<float>::infinity());
  EXPECT_EQ(f64_to_f32(-1e300), -std::numeric_limits<float>::infinity());
  EXPECT_EQ(f64_to_f32(1e-50), 0.0f);
  EXPECT_TRUE(std::isnan(f64_to_f32(std::nan(""))));
}

// ---------------------------------------------------------------------------------------------
// Writing and reading

TEST(IoSafetensors, RoundTripF32I64AndMetadata) {
  TempDir dir;
  const fs::path p = dir / "rt.safetensors";
  Tensor a = Tensor::from({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor s = Tensor::from({}, {7.5f});
  Tensor z({0, 4});
  Tensor b = Tensor::from({3}, {-1, 0.25f, std::numeric_limits<float>::infinity()});
  I64Tensor ids{{2, 2}, {1, -2, 3, 1LL << 40}};
  write_safetensors(p, {{"zeta", a}, {"scalar", s}, {"empty", z}, {"alpha", b}},
                    {{"format", "pt"}, {"made_by", "test"}}, {{"ids", ids}});

  // Header: 8-byte aligned, padded with spaces, keys in the given order, metadata first.
  const std::string raw = read_file(p);
  uint64_t len;
  std::memcpy(&len, raw.data(), 8);
  EXPECT_EQ(len % 8, 0u);
  const std::string header = raw.substr(8, len);
  EXPECT_EQ(header.rfind("{\"__metadata__\"", 0), 0u) << header;
  const size_t pz = header.find("\"zeta\""), ps = header.find("\"scalar\""),
               pe = header.find("\"empty\""), pa = header.find("\"alpha\""), pi = header.find("\"ids\"");
  EXPECT_TRUE(pz < ps && ps < pe && pe < pa && pa < pi) << header;
  EXPECT_EQ(header.find_last_not_of(' '), header.find_last_of('}'));

  SafetensorsFile f(p);
  EXPECT_EQ(f.metadata().at("format"), "pt");
  EXPECT_EQ(f.metadata().at("made_by"), "test");
  EXPECT_EQ(f.tensors().size(), 5u);
  EXPECT_EQ(f.path(), p.string());
  EXPECT_EQ(f.info("zeta").file, p.string());
  EXPECT_EQ(f.info("zeta").dtype, DType::F32);
  EXPECT_EQ(f.info("ids").dtype, DType::I64);
  EXPECT_EQ(f.info("ids").offset, 8 + len);  // I64 data comes first (alignment)
  EXPECT_EQ(f.get_f32("zeta").shape(), (Shape{2, 3}));
  EXPECT_EQ(f.get_f32("zeta").to_vector(), a.to_vector());
  EXPECT_EQ(f.get_f32("scalar").shape(), Shape{});
  EXPECT_EQ(elem(f.get_f32("scalar"), 0), 7.5f);
  EXPECT_EQ(f.get_f32("empty").shape(), (Shape{0, 4}));
  EXPECT_EQ(f.get_f32("empty").numel(), 0);
  EXPECT_EQ(f.get_f32("alpha").to_vector(), b.to_vector());
  EXPECT_EQ(f.get_i64("ids"), ids.values);
  EXPECT_EQ(f.bytes("alpha").size(), 12u);
  EXPECT_FALSE(f.has("nope"));
  EXPECT_ERROR(f.info("nope"), CheckpointError, "tensor 'nope' is not in safetensors file");
  EXPECT_ERROR(f.get_f32("ids"), CheckpointError, "has dtype I64, expected a float dtype");
  EXPECT_ERROR(f.get_i64("zeta"), CheckpointError, "has dtype F32, expected an integer dtype");
}

TEST(IoSafetensors, WriterRejectsBadArguments) {
  TempDir dir;
  const fs::path p = dir / "bad.safetensors";
  Tensor a = Tensor::from({1}, {1});
  EXPECT_ERROR(write_safetensors(p, {{"x", a}, {"x", a}}), InputError, "duplicate tensor name 'x'");
  EXPECT_ERROR(write_safetensors(p, {{"__metadata__", a}}), InputError, "reserved");
  EXPECT_ERROR(write_safetensors(p, {{"u", Tensor()}}), InputError, "'u' is undefined");
  EXPECT_ERROR(write_safetensors(p, {}, {}, {{"ids", I64Tensor{{3}, {1, 2}}}}), InputError,
               "2 values for shape [3]");
  EXPECT_ERROR(write_safetensors(p, {{std::string("bad\xff"), a}}), InputError, "UTF-8");
  EXPECT_ERROR(write_safetensors(dir / "no/such/dir/x.safetensors", {{"a", a}}), CheckpointError,
               "cannot write");
}

TEST(IoSafetensors, F32IsZeroCopyAndOutlivesTheFile) {
  TempDir dir;
  const fs::path p = dir / "zc.safetensors";
  write_safetensors(p, {{"w", Tensor::from({2, 2}, {1, 2, 3, 4})}});
  Tensor t;
  {
    SafetensorsFile f(p);
    t = f.get_f32("w");
  }
  // The SafetensorsFile is gone; the borrowed tensor still reads the mapping.
  EXPECT_EQ(t.to_vector(), (std::vector<float>{1, 2, 3, 4}));
}

TEST(IoSafetensors, F32BorrowPointsIntoTheMappingAndIsReadOnly) {
  TempDir dir;
  const fs::path p = dir / "zc.safetensors";
  write_safetensors(p, {{"w", Tensor::from({2, 2}, {1, 2, 3, 4})}});
  SafetensorsFile f(p);
  const Tensor t = f.get_f32("w");
  EXPECT_EQ(reinterpret_cast<const uint8_t*>(t.data()), f.bytes("w").data());
  Tensor mutable_handle = t;
  EXPECT_THROW(mutable_handle.data(), Error);  // borrowed memory is read-only
  Tensor copy = t.clone();
  copy.data()[0] = 9;
  EXPECT_EQ(elem(f.get_f32("w"), 0), 1.0f);
}

// The mapping asks for 2 MiB folios (MADV_HUGEPAGE): decode streams the weights from it, and 4 KiB
// pages cost ~30% of the read bandwidth (bench/bench_big.py). The kernel shows the advice as "hg".
TEST(IoSafetensors, MappingAsksForHugePages) {
  TempDir dir;
  const fs::path p = dir / "hg.safetensors";
  write_safetensors(p, {{"w", Tensor::from({2, 2}, {1, 2, 3, 4})}});
  SafetensorsFile f(p);
  const auto addr = reinterpret_cast<uintptr_t>(f.bytes("w").data());
  std::ifstream smaps("/proc/self/smaps");
  if (!smaps) GTEST_SKIP() << "no /proc/self/smaps";
  // A kernel built without transparent huge pages refuses the advice (EINVAL): nothing to check.
  if (!fs::exists("/sys/kernel/mm/transparent_hugepage")) GTEST_SKIP() << "kernel without transparent huge pages";
  std::string line, flags;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0, hi = 0;
    if (std::sscanf(line.c_str(), "%lx-%lx ", &lo, &hi) == 2 && line.find(':') > line.find(' ')) {
      inside = lo <= addr && addr < hi;
    } else if (inside && line.rfind("VmFlags:", 0) == 0) {
      flags = line;
      break;
    }
  }
  ASSERT_FALSE(flags.empty()) << "the mapping of " << p << " is not in /proc/self/smaps";
  EXPECT_NE((flags + " ").find(" hg "), std::string::npos) << flags;
}

TEST(IoSafetensors, UnalignedF32IsCopied) {
  // Header of 10 bytes puts the data at file offset 18: not 4-byte aligned.
  const std::string header = R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  std::string padded = header;
  while ((8 + padded.size()) % 4 != 2) padded += ' ';
  TempDir dir;
  const fs::path p = dir / "ua.safetensors";
  write_file(p, with_header(padded, bytes_of(std::vector<float>{1.5f, -2.0f})));
  SafetensorsFile f(p);
  Tensor t = f.get_f32("w");
  EXPECT_EQ(t.to_vector(), (std::vector<float>{1.5f, -2.0f}));
  EXPECT_NO_THROW(t.data());  // a private copy, writable
  EXPECT_NE(reinterpret_cast<const uint8_t*>(t.begin()), f.bytes("w").data());
}

TEST(IoSafetensors, WidensBf16F16F64AndReadsIntegers) {
  const std::vector<float> vals = {1.0f, -2.5f, 0.375f, 1024.0f};
  std::vector<uint16_t> bf, hf = {0x3c00, 0xc100, 0x3600, 0x6400};
  for (float v : vals) bf.push_back(f32_to_bf16_trunc(v));
  const std::vector<uint16_t> special = {0x0001, 0x7c00, 0xfc00, 0x7e00, 0x8000};
  const std::vector<double> dv = {0.1, -1e300, 1e-300, 2.0};
  const std::string image = build_file({
      {"bf", "BF16", {2, 2}, bytes_of(bf)},
      {"hf", "F16", {4}, bytes_of(hf)},
      {"hs", "F16", {5}, bytes_of(special)},
      {"d", "F64", {4}, bytes_of(dv)},
      {"i32", "I32", {3}, bytes_of(std::vector<int32_t>{-7, 0, 2147483647})},
      {"i16", "I16", {2}, bytes_of(std::vector<int16_t>{-3, 300})},
      {"i8", "I8", {2}, bytes_of(std::vector<int8_t>{-128, 127})},
      {"u8", "U8", {2}, bytes_of(std::vector<uint8_t>{0, 255})},
      {"bool", "BOOL", {2}, bytes_of(std::vector<uint8_t>{1, 0})},
  });
  TempDir dir;
  write_file(dir / "w.safetensors", image);
  SafetensorsFile f(dir / "w.safetensors");
  EXPECT_EQ(f.get_f32("bf").shape(), (Shape{2, 2}));
  EXPECT_EQ(f.get_f32("bf").to_vector(), vals);
  EXPECT_EQ(f.get_f32("hf").to_vector(), vals);
  const Tensor hs = f.get_f32("hs");
  EXPECT_EQ(hs[0], std::ldexp(1.0f, -24));
  EXPECT_EQ(hs[1], std::numeric_limits<float>::infinity());
  EXPECT_EQ(hs[2], -std::numeric_limits<float>::infinity());
  EXPECT_TRUE(std::isnan(hs[3]));
  EXPECT_TRUE(hs[4] == 0.0f && std::signbit(hs[4]));
  const Tensor d = f.get_f32("d");
  EXPECT_EQ(d[0], 0.1f);
  EXPECT_EQ(d[1], -std::numeric_limits<float>::infinity());
  EXPECT_EQ(d[2], 0.0f);
  EXPECT_EQ(d[3], 2.0f);
  EXPECT_EQ(f.get_i64("i32"), (std::vector<int64_t>{-7, 0, 2147483647}));
  EXPECT_EQ(f.get_i64("i16"), (std::vector<int64_t>{-3, 300}));
  EXPECT_EQ(f.get_i64("i8"), (std::vector<int64_t>{-128, 127}));
  EXPECT_EQ(f.get_i64("u8"), (std::vector<int64_t>{0, 255}));
  EXPECT_EQ(f.get_i64("bool"), (std::vector<int64_t>{1, 0}));
  EXPECT_ERROR(f.get_f32("i32"), CheckpointError, "has dtype I32");
  EXPECT_ERROR(f.get_i64("bf"), CheckpointError, "has dtype BF16");
}

// ---------------------------------------------------------------------------------------------
// Validation of bad input

TEST(IoSafetensors, RejectsEveryKindOfBadHeader) {
  const std::string f8(8, '\0');
  auto one = [](const std::string& entry, const std::string& data) {
    return with_header("{\"a\":" + entry + "}", data);
  };
  struct Case {
    std::string image, needle;
  };
  const std::vector<Case> cases = {
      {"", "only 0 bytes"},
      {"abcde", "only 5 bytes"},
      {with_header("{}", "", 1ULL << 40), "is absurd"},
      {with_header("{}", "", 100), "runs past the end of the file"},
      {with_header("", ""), "header is empty"},
      {with_header("{\"a\": nope}"), "not valid JSON"},
      {with_header("{\"a\":1"), "not valid JSON"},
      {with_header("{\"a\xff\":1}"), "not valid JSON"},  // invalid UTF-8
      {with_header("[1,2]"), "header is an array, expected a JSON object"},
      {with_header("{\"a\":3}"), "tensor 'a' is an integer, expected an object"},
      {one(R"({"shape":[2],"data_offsets":[0,8]})", f8), "tensor 'a' has no 'dtype'"},
      {one(R"({"dtype":"F32","data_offsets":[0,8]})", f8), "tensor 'a' has no 'shape'"},
      {one(R"({"dtype":"F32","shape":[2]})", f8), "tensor 'a' has no 'data_offsets'"},
      {one(R"({"dtype":32,"shape":[2],"data_offsets":[0,8]})", f8), "'dtype' that is an integer"},
      {one(R"({"dtype":"F8_E4M3","shape":[8],"data_offsets":[0,8]})", f8), "unknown dtype 'F8_E4M3'"},
      {one(R"({"dtype":"F32","shape":"2","data_offsets":[0,8]})", f8), "'shape' that is a string"},
      {one(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})", f8), "shape dimension 0 is negative"},
      {one(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})", f8), "shape dimension 0 is a float"},
      {one(R"({"dtype":"F32","shape":[1099511627777],"data_offsets":[0,8]})", f8), "absurd shape"},
      {one(R"({"dtype":"F32","shape":[4294967296,4294967296,4294967296],"data_offsets":[0,8]})", f8),
       "absurd shape"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":[0]})", f8), "'data_offsets' with 1 elements, expected [begin, end]"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":{"a":0}})", f8), "'data_offsets' that is an object"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,16]})", f8), "with 3 elements"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8.0]})", f8), "data_offsets[1] is a float"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":[-1,8]})", f8), "data_offsets[0] is negative"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})", f8), "reversed data_offsets [8, 0]"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8]})", "1234"),
       "past the end of the data section (4 bytes)"},
      {one(R"({"dtype":"F32","shape":[2],"data_offsets":[0,18446744073709551615]})", f8),
       "past the end of the data section"},
      {one(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})", f8),
       "holds 8 bytes but dtype F32 and shape [3] need 12"},
      {one(R"({"dtype":"BF16","shape":[2],"data_offsets":[0,8]})", f8), "need 4"},
      {with_header(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                   R"("b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                   f8),
       "overlaps"},
      {with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})", f8),
       "gap in the data section before tensor 'a'"},
      {with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}})", f8),
       "data section has 8 bytes but the tensors cover 4"},
      {with_header(R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},)"
                   R"("a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
                   f8),
       "names tensor 'a' twice"},
      {with_header(R"({"__metadata__":[1]})"), "__metadata__ is an array"},
      {with_header(R"({"__metadata__":{"k":1}})"), "__metadata__ value for 'k' is an integer"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.needle);
    EXPECT_ERROR(parse(c.image), CheckpointError, c.needle);
    EXPECT_ERROR(parse(c.image), CheckpointError, "safetensors file 'mem.safetensors'");
  }
}

TEST(IoSafetensors, AcceptsEmptyAndZeroSizedTensors) {
  EXPECT_TRUE(parse(with_header("{}")).tensors.empty());
  const auto h = parse(with_header(R"({"__metadata__":{"k":"v"},"z":{"dtype":"F32","shape":[0,5],)"
                                   R"("data_offsets":[0,0]},"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}})",
                                   "x"));
  ASSERT_EQ(h.tensors.size(), 2u);
  EXPECT_EQ(h.tensors[0].name, "z");  // offset order, zero-sized first
  EXPECT_EQ(h.metadata.at("k"), "v");
}

TEST(IoSafetensors, FileLevelErrors) {
  TempDir dir;
  EXPECT_ERROR(SafetensorsFile(dir / "missing.safetensors"), CheckpointError, "does not exist");
  EXPECT_ERROR(SafetensorsFile(dir.path()), CheckpointError, "is not a regular file");
  write_file(dir / "empty.safetensors", "");
  EXPECT_ERROR(SafetensorsFile(dir / "empty.safetensors"), CheckpointError, "only 0 bytes");
  write_file(dir / "past.safetensors", with_header("{}", "", 4096));
  EXPECT_ERROR(SafetensorsFile(dir / "past.safetensors"), CheckpointError, "runs past the end");
  EXPECT_ERROR(SafetensorsFile(dir / "past.safetensors"), CheckpointError,
               (dir / "past.safetensors").string());
}

TEST(IoSafetensors, TruncatedFilesAlwaysFailCleanly) {
  TempDir dir;
  const fs::path p = dir / "full.safetensors";
  write_safetensors(p, {{"a", Tensor::from({3, 2}, {1, 2, 3, 4, 5, 6})}, {"b", Tensor({5}, 0.5f)}},
                    {{"format", "pt"}}, {{"ids", I64Tensor{{2}, {4, 5}}}});
  const std::string full = read_file(p);
  ASSERT_NO_THROW(parse(full));
  // Every proper prefix, in memory; a spread of them from disk through mmap.
  for (size_t n = 0; n < full.size(); ++n) {
    SCOPED_TRACE(n);
    EXPECT_THROW(parse(full.substr(0, n)), CheckpointError);
    if (n % 17 == 0 || n + 1 == full.size()) {
      write_file(dir / "cut.safetensors", full.substr(0, n));
      EXPECT_THROW(SafetensorsFile(dir / "cut.safetensors"), CheckpointError);
    }
  }
}

// Deterministic mutation fuzzing of parse_header: never a crash, only mixlens::Error.
TEST(IoSafetensors, MutatedHeadersOnlyThrowMixlensErrors) {
  TempDir dir;
  const fs::path p = dir / "seed.safetensors";
  write_safetensors(p,
                    {{"backbone.layers.0.mixer.A_log", Tensor::from({4}, {1, 2, 3, 4})},
                     {"backbone.embeddings.weight", Tensor({3, 2}, 0.25f)}},
                    {{"format", "pt"}}, {{"ids", I64Tensor{{1, 3}, {1, 2, 3}}}});
  const std::string seed = read_file(p);
  std::mt19937 rng(1234);
  const std::string interesting = "{}[]\":,-0123456789eE.\\ \x00\xff";
  int accepted = 0, rejected = 0;
  for (int iter = 0; iter < 2000; ++iter) {
    std::string buf = seed;
    const int ops = 1 + static_cast<int>(rng() % 4);
    for (int k = 0; k < ops; ++k) {
      const size_t pos = buf.empty() ? 0 : rng() % buf.size();
      const char byte = (rng() % 2) ? interesting[rng() % interesting.size()] : static_cast<char>(rng());
      switch (rng() % 5) {
        case 0:
          if (!buf.empty()) buf[pos] = static_cast<char>(buf[pos] ^ (1 << (rng() % 8)));
          break;
        case 1:
          if (!buf.empty()) buf[pos] = byte;
          break;
        case 2: buf.insert(buf.begin() + static_cast<std::ptrdiff_t>(pos), byte); break;
        case 3:
          if (!buf.empty()) buf.erase(pos, 1 + rng() % 4);
          break;
        case 4:  // keep the length prefix consistent with a shifted header sometimes
          if (buf.size() >= 8) {
            uint64_t len;
            std::memcpy(&len, buf.data(), 8);
            len += static_cast<uint64_t>(static_cast<int>(rng() % 5) - 2);
            std::memcpy(buf.data(), &len, 8);
          }
          break;
      }
    }
    try {
      const auto h = parse(buf);
      for (const auto& t : h.tensors) ASSERT_LE(t.offset + t.nbytes, buf.size());
      ++accepted;
    } catch (const Error&) {
      ++rejected;
    } catch (const std::exception& e) {
      FAIL() << "iteration " << iter << ": non-mixlens exception " << e.what();
    }
  }
  std::printf("mutation test: %d accepted, %d rejected\n", accepted, rejected);
  EXPECT_EQ(accepted + rejected, 2000);
  EXPECT_GT(rejected, 1000);  // most mutations must be caught
}

// ---------------------------------------------------------------------------------------------
// WeightStore

namespace {
void write_store_shard(const fs::path& p, const std::vector<std::pair<std::string, Tensor>>& ts) {
  fs::create_directories(p.parent_path());
  write_safetensors(p, ts);
}
}  // namespace

TEST(IoWeights, SingleFile) {
  TempDir dir;
  write_store_shard(dir / "model.safetensors",
                    {{"backbone.layers.0.mixer.A_log", Tensor::from({2}, {1, 2})},
                     {"backbone.norm_f.weight", Tensor({3}, 1.0f)}});
  write_safetensors(dir / "other.safetensors", {{"ignored", Tensor({1})}});  // model.safetensors wins
  const WeightStore ws = WeightStore::open(dir.path());
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"backbone.layers.0.mixer.A_log", "backbone.norm_f.weight"}));
  EXPECT_TRUE(ws.has("backbone.norm_f.weight"));
  EXPECT_FALSE(ws.has("ignored"));
  EXPECT_EQ(ws.dtype_name("backbone.norm_f.weight"), "F32");
  EXPECT_EQ(ws.info("backbone.norm_f.weight").shape, (Shape{3}));
  EXPECT_EQ(ws.get("backbone.layers.0.mixer.A_log").to_vector(), (std::vector<float>{1, 2}));
  EXPECT_EQ(ws.get("backbone.norm_f.weight", {3}).numel(), 3);
  EXPECT_ERROR(ws.get("backbone.norm_f.weight", {4}), CheckpointError,
               "tensor 'backbone.norm_f.weight' in " + dir.path().string() +
                   " has shape [3], expected [4] from config.json");
  EXPECT_ERROR(ws.get("backbone.layers.0.mixer.A_logg"), CheckpointError,
               "tensor 'backbone.layers.0.mixer.A_logg' not found in " + dir.path().string());
  EXPECT_ERROR(ws.get("backbone.layers.0.mixer.A_logg"), CheckpointError,
               "did you mean 'backbone.layers.0.mixer.A_log'?");
  EXPECT_ERROR(ws.info("layers.0.mixer.A_log"), CheckpointError, "did you mean 'backbone.layers.0.mixer.A_log'?");
  try {
    ws.get("completely_unrelated");
    ADD_FAILURE();
  } catch (const CheckpointError& e) {
    EXPECT_EQ(std::string(e.what()).find("did you mean"), std::string::npos) << e.what();
  }
  const WeightStore copy = ws;  // copies share the mapped files
  EXPECT_EQ(elem(copy.get("backbone.norm_f.weight"), 2), 1.0f);
}

// A 16-bit matmul weight big enough for several load tasks (~64k weights each): int8 quantizes it
// row by row exactly as ops::quantize_q8_row does, and a bad weight is reported at the first flat
// index whichever task meets it, for int8 and for the 16-bit paths alike.
TEST(IoWeights, SixteenBitWeightsQuantizeInTasksAndNameTheFirstBadWeight) {
  const int64_t rows = 600, cols = 256;  // 256 rows per task: three tasks
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 0.05f);
  std::vector<uint16_t> w(static_cast<size_t>(rows * cols));
  for (auto& h : w) h = f32_to_bf16_trunc(nd(rng));
  TempDir dir;
  const auto write = [&](const std::vector<uint16_t>& v, const char* dtype) {
    write_file(dir / "model.safetensors", build_file({{"m.weight", dtype, {rows, cols}, bytes_of(v)}}));
  };
  write(w, "BF16");
  {
    WeightStore ws = WeightStore::open(dir.path());
    ws.set_matmul_dtype("int8");
    const Tensor q = ws.get_matmul("m.weight", {rows, cols});
    ASSERT_EQ(q.dtype(), ScalarType::int8);
    const int64_t rb = ops::q8_row_bytes(cols);
    std::vector<float> row(static_cast<size_t>(cols));
    std::vector<uint8_t> want(static_cast<size_t>(rb));
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c) row[static_cast<size_t>(c)] = ops::bf16_to_f32(w[static_cast<size_t>(r * cols + c)]);
      ops::quantize_q8_row(row.data(), cols, want.data());
      ASSERT_EQ(std::memcmp(static_cast<const uint8_t*>(q.raw()) + r * rb, want.data(), static_cast<size_t>(rb)), 0)
          << "row " << r;
    }
  }
  const int64_t late = 590 * cols + 1, mid = 300 * cols + 5, early = 10;
  struct Case {
    const char* dtype;
    std::vector<std::pair<int64_t, uint16_t>> bad;
    int64_t first;
    const char* what;
  };
  const Case cases[] = {
      {"BF16", {{late, 0x7fc0}, {mid, 0x7f80}}, mid, "contains inf"},
      {"BF16", {{late, 0x7fc0}, {mid, 0x7f80}, {early, 0xdf80}}, early, "a weight of magnitude 1.84467e+19 at"},  // -2^64
      {"BF16", {{late, 0x7fc0}}, late, "contains NaN"},
      {"F16", {{late, 0xfc00}, {mid, 0x7e00}}, mid, "contains NaN"},
  };
  for (const Case& c : cases) {
    std::vector<uint16_t> v = w;
    if (std::string(c.dtype) == "F16")
      for (auto& h : v) h = 0x3c00;  // 1.0
    for (const auto& [i, h] : c.bad) v[static_cast<size_t>(i)] = h;
    write(v, c.dtype);
    for (const char* dtype : {"int8", "auto", "bfloat16", "float32"}) {
      WeightStore ws = WeightStore::open(dir.path());
      ws.set_matmul_dtype(dtype);
      EXPECT_ERROR(ws.get_matmul("m.weight", {rows, cols}), CheckpointError,
                   "at flat index " + std::to_string(c.first) + " ");
      WeightStore again = WeightStore::open(dir.path());
      again.set_matmul_dtype(dtype);
      EXPECT_ERROR(again.get_matmul("m.weight", {rows, cols}), CheckpointError, c.what);
    }
  }
  // 2^64 itself is refused and the largest bf16 below it is not.
  std::vector<uint16_t> edge = w;
  edge[static_cast<size_t>(mid)] = 0x5f7f;
  write(edge, "BF16");
  for (const char* dtype : {"int8", "auto"}) {
    WeightStore ws = WeightStore::open(dir.path());
    ws.set_matmul_dtype(dtype);
    EXPECT_NO_THROW((void)ws.get_matmul("m.weight", {rows, cols})) << dtype;
  }
}

TEST(IoWeights, ShardedIndex) {
  TempDir dir;
  write_store_shard(dir / "model-00001-of-00002.safetensors",
                    {{"a.weight", Tensor::from({2}, {1, 2})}, {"b.weight", Tensor::from({1}, {3})}});
  write_store_shard(dir / "model-00002-of-00002.safetensors", {{"c.weight", Tensor::from({1}, {4})}});
  write_file(dir / "model.safetensors.index.json", R"({
    "metadata": {"total_size": 16},
    "weight_map": {"a.weight": "model-00001-of-00002.safetensors",
                   "b.weight": "model-00001-of-00002.safetensors",
                   "c.weight": "model-00002-of-00002.safetensors"}})");
  const WeightStore ws = WeightStore::open(dir.path());
  EXPECT_EQ(ws.files().size(), 2u);
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"a.weight", "b.weight", "c.weight"}));
  EXPECT_EQ(elem(ws.get("c.weight"), 0), 4.0f);
  EXPECT_EQ(ws.info("c.weight").file, (dir / "model-00002-of-00002.safetensors").string());
}

TEST(IoWeights, FallbackToAllSafetensorsFiles) {
  TempDir dir;
  write_store_shard(dir / "part-b.safetensors", {{"b", Tensor({1}, 2.0f)}});
  write_store_shard(dir / "part-a.safetensors", {{"a", Tensor({1}, 1.0f)}});
  write_file(dir / "config.json", "{}");
  const WeightStore ws = WeightStore::open(dir.path());
  EXPECT_EQ(ws.names(), (std::vector<std::string>{"a", "b"}));
  EXPECT_EQ(elem(ws.get("b"), 0), 2.0f);

  write_store_shard(dir / "part-c.safetensors", {{"a", Tensor({1}, 3.0f)}});
  EXPECT_ERROR(WeightStore::open(dir.path()), CheckpointError, "tensor 'a' is in both");
}

TEST(IoWeights, FolderAndIndexErrors) {
  TempDir dir;
  EXPECT_ERROR(WeightStore::open(dir / "nope"), CheckpointError, "model folder '" + (dir / "nope").string() + "' does not exist");
  write_file(dir / "file.txt", "x");
  EXPECT_ERROR(WeightStore::open(dir / "file.txt"), CheckpointError, "is not a directory");
  fs::create_directories(dir / "empty");
  write_file(dir / "empty/config.json", "{}");
  EXPECT_ERROR(WeightStore::open(dir / "empty"), CheckpointError, "has no safetensors weights");

  const fs::path idx = dir / "sharded/model.safetensors.index.json";
  write_store_shard(dir / "sharded/s1.safetensors", {{"a", Tensor({1})}});
  write_file(idx, "{\n  \"weight_map\": {\n    \"a\": s1.safetensors}}");
  EXPECT_ERROR(WeightStore::open(dir / "sharded"), CheckpointError, "not valid JSON at line 3");
  write_file(idx, R"({"metadata": {}})");
  EXPECT_ERROR(WeightStore::open(dir / "sharded"), CheckpointError, "\"weight_map\"");
  write_file(idx, R"({"weight_map": {"a": "s1.safetensors", "b": "s2.safetensors"}})");
  EXPECT_ERROR(WeightStore::open(dir / "sharded"), CheckpointError, "shard 's2.safetensors' does not exist");
  write_file(idx, R"({"weight_map": {"a": "../s1.safetensors"}})");
  EXPECT_ERROR(WeightStore::open(dir / "sharded"), CheckpointError, "outside the folder");
  write_file(idx, R"({"weight_map": {"a": "s1.safetensors", "z": "s1.safetensors"}})");
  EXPECT_ERROR(WeightStore::open(dir / "sharded"), CheckpointError,
               "lists tensor 'z' in shard 's1.safetensors', but that shard does not hold it");
  write_file(idx, R"({"weight_map": {"a": 3}})");
  EXPECT_ERROR(WeightStore::open(dir / "sharded"), CheckpointError, "not a file name");

  // A corrupt shard reports the shard's own path.
  write_file(dir / "corrupt/model.safetensors", "garbage!");
  EXPECT_ERROR(WeightStore::open(dir / "corrupt"), CheckpointError, (dir / "corrupt/model.safetensors").string());
}

// ---------------------------------------------------------------------------------------------
// JSON and Config

TEST(IoJson, PythonNonFiniteTokens) {
  const auto j = parse_json_text(
      R"({"time_step_limit": [0.0, Infinity], "lo": -Infinity, "n": NaN,
          "s": "Infinity NaN -Infinity", "esc": "a\"NaN\\", "after": [NaN,Infinity]})",
      "test");
  EXPECT_EQ(j["time_step_limit"][0].get<double>(), 0.0);
  EXPECT_EQ(j["time_step_limit"][1].get<double>(), std::numeric_limits<double>::infinity());
  EXPECT_EQ(j["lo"].get<double>(), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(j["n"].get<double>()));
  EXPECT_EQ(j["s"].get<std::string>(), "Infinity NaN -Infinity");
  EXPECT_EQ(j["esc"].get<std::string>(), "a\"NaN\\");
  EXPECT_TRUE(std::isnan(j["after"][0].get<double>()));
  EXPECT_TRUE(std::isinf(j["after"][1].get<double>()));
  // Not tokens: identifiers that merely start with them stay invalid JSON.
  EXPECT_ERROR(parse_json_text("[NaNa]", "t"), ConfigError, "not valid JSON");
  EXPECT_ERROR(parse_json_text("[Infinityx]", "t"), ConfigError, "not valid JSON");
  EXPECT_ERROR(parse_json_text("[1e999]", "t"), ConfigError, "not valid JSON");
}

TEST(IoJson, ErrorsGiveOriginalLineAndColumnAndKind) {
  // The error is after an Infinity on the same line: the column must refer to the original text.
  const std::string text = "{\n  \"a\": 1,\n  \"b\": [Infinity, oops]\n}";
  EXPECT_ERROR(parse_json_text(text, "cfg"), ConfigError, "cfg: not valid JSON at line 3, column 19");
  EXPECT_ERROR(parse_json_text("{\"a\": }", "cfg"), ConfigError, "line 1, column 7");
  EXPECT_ERROR(parse_json_text("[Infinity, ]", "x", ErrorKind::Tokenizer), TokenizerError, "not valid JSON");
  try {  // the sentinel never leaks into messages
    parse_json_text("[Infinity x]", "x");
    ADD_FAILURE();
  } catch (const ConfigError& e) {
    EXPECT_EQ(std::string(e.what()).find("mixlens:"), std::string::npos) << e.what();
  }

  TempDir dir;
  EXPECT_ERROR(read_json_file(dir / "config.json", "config.json"), ConfigError,
               "config.json (" + (dir / "config.json").string() + ") does not exist");
  EXPECT_ERROR(read_json_file(dir / "tokenizer.json", "tokenizer.json", ErrorKind::Tokenizer),
               TokenizerError, "does not exist");
  EXPECT_ERROR(read_json_file(dir.path(), "config.json"), ConfigError, "is a directory");
  write_file(dir / "bad.json", "{\"a\": [1, 2,]}");
  EXPECT_ERROR(read_json_file(dir / "bad.json", "bad.json", ErrorKind::Checkpoint), CheckpointError,
               "bad.json (" + (dir / "bad.json").string() + "): not valid JSON at line 1");
}

TEST(IoConfig, TypedGetters) {
  TempDir dir;
  write_file(dir / "config.json", R"({
    "model_type": "mamba2", "hidden_size": 64, "num_heads": 4.0, "frac": 4.5,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": true, "time_step_limit": [0.0, Infinity],
    "time_step_floor": -Infinity, "bad_nan": NaN, "nullable": null, "big": 4294967296,
    "neg": -3, "names": ["a", "b"],
    "text_config": {"hidden_size": "64", "vocab_size": 100}
  })");
  const Config c = Config::load(dir.path());
  const std::string where = "config.json (" + (dir / "config.json").string() + "): ";
  EXPECT_EQ(c.path(), dir / "config.json");
  EXPECT_EQ(c.get<std::string>("model_type"), "mamba2");
  EXPECT_EQ(c.get<int64_t>("hidden_size"), 64);
  EXPECT_EQ(c.get<int>("num_heads"), 4);  // integral float accepted
  EXPECT_EQ(c.get<double>("hidden_size"), 64.0);
  EXPECT_FLOAT_EQ(c.get<float>("rms_norm_eps"), 1e-5f);
  EXPECT_TRUE(c.get<bool>("tie_word_embeddings"));
  const auto lim = c.get<std::vector<double>>("time_step_limit");
  ASSERT_EQ(lim.size(), 2u);
  EXPECT_EQ(lim[1], std::numeric_limits<double>::infinity());
  EXPECT_EQ(c.get_double("time_step_floor"), -std::numeric_limits<double>::infinity());
  EXPECT_TRUE(std::isnan(c.get_double("bad_nan")));
  EXPECT_EQ(c.get<int64_t>("big"), 4294967296);
  EXPECT_EQ(c.get<std::vector<std::string>>("names"), (std::vector<std::string>{"a", "b"}));
  EXPECT_TRUE(c.has("nullable"));
  EXPECT_TRUE(c.is_null("nullable"));
  EXPECT_FALSE(c.has("absent"));
  EXPECT_EQ(c.get_or<int64_t>("absent", 7), 7);
  EXPECT_EQ(c.get_or<int64_t>("nullable", 8), 8);
  EXPECT_EQ(c.get_or<int64_t>("hidden_size", 8), 64);
  EXPECT_EQ(c.get_double_or("absent", 0.5), 0.5);

  EXPECT_ERROR(c.get<int64_t>("absent"), ConfigError, where + "field 'absent' is missing");
  EXPECT_ERROR(c.get<int64_t>("model_type"), ConfigError,
               where + "field 'model_type' has type string, expected integer");
  EXPECT_ERROR(c.get<int64_t>("frac"), ConfigError, "field 'frac' has type float (4.5), expected integer");
  EXPECT_ERROR(c.get<int64_t>("time_step_floor"), ConfigError, "has type float (-Infinity), expected integer");
  EXPECT_ERROR(c.get<int32_t>("big"), ConfigError, "field 'big' = 4294967296 is out of range for integer");
  EXPECT_ERROR(c.get<uint32_t>("neg"), ConfigError, "field 'neg' = -3 is out of range");
  EXPECT_ERROR(c.get<int64_t>("nullable"), ConfigError, "field 'nullable' has type null, expected integer");
  EXPECT_ERROR(c.get<bool>("hidden_size"), ConfigError, "expected boolean");
  EXPECT_ERROR(c.get<double>("names"), ConfigError, "has type array, expected number");
  EXPECT_ERROR(c.get<std::vector<int64_t>>("names"), ConfigError, "field 'names[0]' has type string");
  EXPECT_ERROR(c.get_or<int64_t>("model_type", 1), ConfigError, "expected integer");

  const Config t = c.sub("text_config");
  EXPECT_EQ(t.get<int64_t>("vocab_size"), 100);
  EXPECT_ERROR(t.get<int64_t>("hidden_size"), ConfigError,
               where + "field 'text_config.hidden_size' has type string, expected integer");
  EXPECT_ERROR(t.get<int64_t>("nope"), ConfigError, "field 'text_config.nope' is missing");
  EXPECT_ERROR(c.sub("hidden_size"), ConfigError, "field 'hidden_size' has type integer, expected object");
  EXPECT_ERROR(c.sub("vision_config"), ConfigError, "field 'vision_config' is missing");
}

TEST(IoConfig, LoadErrors) {
  TempDir dir;
  EXPECT_ERROR(Config::load(dir.path()), ConfigError, "config.json (" + (dir / "config.json").string() + ") does not exist");
  write_file(dir / "config.json", "[1]");
  EXPECT_ERROR(Config::load(dir.path()), ConfigError, "top level has type array, expected object");
  write_file(dir / "config.json", "{\"a\": 1,,}");
  EXPECT_ERROR(Config::load(dir / "config.json"), ConfigError, "not valid JSON at line 1, column 9");
}

// ---------------------------------------------------------------------------------------------
// Hub cache

class IoHub : public ::testing::Test {
 protected:
  // A fake cache laid out like huggingface_hub's: blobs/ hold content, snapshots/<commit>/ hold
  // symlinks into blobs/, refs/<branch> hold the commit.
  void SetUp() override {
    repo_ = dir_ / "hub/models--state-spaces--mamba2-tiny";
    fs::create_directories(repo_ / "blobs");
    write_safetensors(repo_ / "blobs/b1", {{"backbone.norm_f.weight", Tensor({2}, 1.0f)}});
    write_file(repo_ / "blobs/c1", R"({"model_type": "mamba2", "time_step_limit": [0.0, Infinity]})");
    for (const char* commit : {kCommit1, kCommit2}) {
      fs::create_directories(repo_ / "snapshots" / commit);
      fs::create_symlink("../../blobs/b1", repo_ / "snapshots" / commit / "model.safetensors");
      fs::create_symlink("../../blobs/c1", repo_ / "snapshots" / commit / "config.json");
    }
    write_file(repo_ / "refs/main", kCommit1);
    write_file(repo_ / "refs/v2", std::string(kCommit2) + "\n");
  }
  static constexpr const char* kCommit1 = "0123456789abcdef0123456789abcdef01234567";
  static constexpr const char* kCommit2 = "fedcba9876543210fedcba9876543210fedcba98";
  TempDir dir_;
  fs::path repo_;
  EnvGuard cache_{"HF_HUB_CACHE", (dir_ / "hub").string()};
  EnvGuard legacy_{"HUGGINGFACE_HUB_CACHE", std::nullopt};
};

TEST_F(IoHub, ResolvesRefsAndRevisions) {
  const fs::path snap = resolve_model("state-spaces/mamba2-tiny");
  EXPECT_EQ(snap, repo_ / "snapshots" / kCommit1);
  // Files are symlinks into blobs/: the loaders follow them.
  const WeightStore ws = WeightStore::open(snap);
  EXPECT_EQ(elem(ws.get("backbone.norm_f.weight"), 1), 1.0f);
  EXPECT_EQ(Config::load(snap).get<std::vector<double>>("time_step_limit")[1],
            std::numeric_limits<double>::infinity());

  EXPECT_EQ(resolve_model("state-spaces/mamba2-tiny@v2"), repo_ / "snapshots" / kCommit2);
  EXPECT_EQ(resolve_model(std::string("state-spaces/mamba2-tiny@") + kCommit2), repo_ / "snapshots" / kCommit2);
  EXPECT_ERROR(resolve_model("state-spaces/mamba2-tiny@v9"), CheckpointError,
               "revision 'v9' is not in the local HuggingFace cache");

  // An existing folder wins over everything.
  EXPECT_EQ(resolve_model(dir_.path().string()), dir_.path());
}

TEST_F(IoHub, RefsMissing) {
  fs::remove(repo_ / "refs/main");
  EXPECT_ERROR(resolve_model("state-spaces/mamba2-tiny"), CheckpointError, "cached snapshots: ");
  fs::remove_all(repo_ / "snapshots" / kCommit2);
  EXPECT_EQ(resolve_model("state-spaces/mamba2-tiny"), repo_ / "snapshots" / kCommit1);  // the only one
  fs::remove_all(repo_ / "snapshots" / kCommit1);
  EXPECT_ERROR(resolve_model("state-spaces/mamba2-tiny"), CheckpointError, "has no snapshot");
}

TEST_F(IoHub, BrokenEntries) {
  write_file(repo_ / "refs/main", "1111111111111111111111111111111111111111");
  EXPECT_ERROR(resolve_model("state-spaces/mamba2-tiny"), CheckpointError, "is missing (incomplete download?)");
  write_file(repo_ / "refs/main", "../../../etc");
  EXPECT_ERROR(resolve_model("state-spaces/mamba2-tiny"), CheckpointError, "not a commit hash");
  // A dangling blob symlink (interrupted download) fails when opened, naming the file.
  write_file(repo_ / "refs/main", kCommit1);
  fs::remove(repo_ / "blobs/b1");
  EXPECT_ERROR(WeightStore::open(resolve_model("state-spaces/mamba2-tiny")), CheckpointError,
               "model.safetensors' does not exist");
}

TEST_F(IoHub, MissingModelsAndPaths) {
  EXPECT_ERROR(resolve_model("state-spaces/mamba2-huge"), CheckpointError,
               "hub id 'state-spaces/mamba2-huge' is not in the local HuggingFace cache (looked in " +
                   (dir_ / "hub").string());
  EXPECT_ERROR(resolve_model("state-spaces/mamba2-huge"), CheckpointError,
               "download it with huggingface-cli or pass a folder");
  EXPECT_ERROR(resolve_model("./no/such/folder"), CheckpointError, "model folder './no/such/folder' does not exist");
  // A missing relative folder that also reads as owner/name: both readings are reported.
  EXPECT_ERROR(resolve_model("models/mamba-x"), CheckpointError,
               "model folder 'models/mamba-x' does not exist (no directory " +
                   (fs::current_path() / "models/mamba-x").string() + "), and as a hub id 'models/mamba-x' is not in the "
                   "local HuggingFace cache");
  EXPECT_ERROR(resolve_model("mamba2-tiny"), CheckpointError, "model folder 'mamba2-tiny' does not exist");
  EXPECT_ERROR(resolve_model(""), CheckpointError, "does not exist");
  write_file(dir_ / "weights.safetensors", "x");
  EXPECT_ERROR(resolve_model((dir_ / "weights.safetensors").string()), CheckpointError, "is a file");
  // A bare legacy id resolves only when the cache has it.
  fs::create_directories(dir_ / "hub/models--gpt2/snapshots/abc");
  EXPECT_EQ(resolve_model("gpt2"), dir_ / "hub/models--gpt2/snapshots/abc");
}

TEST(IoHubEnv, CacheDirPrecedence) {
  EnvGuard a("HF_HUB_CACHE", std::nullopt), b("HUGGINGFACE_HUB_CACHE", std::nullopt),
      c("HF_HOME", std::nullopt), d("XDG_CACHE_HOME", std::nullopt), e("HOME", "/home/u");
  EXPECT_EQ(hub_cache_dir(), fs::path("/home/u/.cache/huggingface/hub"));
  {
    EnvGuard x("XDG_CACHE_HOME", "/xdg");
    EXPECT_EQ(hub_cache_dir(), fs::path("/xdg/huggingface/hub"));
    EnvGuard h("HF_HOME", "~/hf");
    EXPECT_EQ(hub_cache_dir(), fs::path("/home/u/hf/hub"));
    EnvGuard l("HUGGINGFACE_HUB_CACHE", "/legacy");
    EXPECT_EQ(hub_cache_dir(), fs::path("/legacy"));
    EnvGuard m("HF_HUB_CACHE", "/main");
    EXPECT_EQ(hub_cache_dir(), fs::path("/main"));
  }
}

TEST(IoHubEnv, LooksLikeHubId) {
  EXPECT_TRUE(looks_like_hub_id("state-spaces/mamba2-130m"));
  EXPECT_TRUE(looks_like_hub_id("Qwen/Qwen3.5-0.8B@main"));
  EXPECT_TRUE(looks_like_hub_id("a/b@refs/pr/1"));
  EXPECT_FALSE(looks_like_hub_id("gpt2"));
  EXPECT_FALSE(looks_like_hub_id("/abs/path"));
  EXPECT_FALSE(looks_like_hub_id("./rel/path"));
  EXPECT_FALSE(looks_like_hub_id("a/b/c"));
  EXPECT_FALSE(looks_like_hub_id("a/.."));
  EXPECT_FALSE(looks_like_hub_id("a/b@../../x"));
  EXPECT_FALSE(looks_like_hub_id("a/b@"));
}
