// RecordReader: the strict reader of the store's small text records. Fields
// are separated by exactly one ' ' or '\n'; a number is whole decimal digits
// (a '-' only where the range allows negatives) inside its range; a word has
// a bounded length; at most one separator may follow the last field. Every
// malformation is a kInternal Error that names the record and the field.
#include "core/record.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "errors.h"

namespace mctest {
namespace {

using mooncake::ErrorKind;
using mooncake::RecordReader;

constexpr const char* kWhat = "test record under 'k/1'";

// The error a malformed record must raise: kInternal, naming the record.
testing::AssertionResult malformed(const std::function<void()>& fn, const std::string& field) {
  auto r = throws_error(ErrorKind::kInternal, fn,
                        std::string("malformed ") + kWhat + " in the store: " + field);
  return r;
}

TEST(RecordReader, ReadsNumbersAndWordsSeparatedBySpacesOrNewlines) {
  RecordReader in("12 -3\nhost.example 18446744073709551615\n0", kWhat);
  EXPECT_EQ(in.number<int>("a"), 12);
  EXPECT_TRUE(in.more());
  EXPECT_EQ(in.number<int>("b", -5, 5), -3);
  EXPECT_EQ(in.word("c", 12), "host.example");
  EXPECT_EQ(in.number<uint64_t>("d"), std::numeric_limits<uint64_t>::max());
  EXPECT_TRUE(in.more());
  EXPECT_EQ(in.number<uint32_t>("e", 0, 0), 0u);
  EXPECT_FALSE(in.more());
  in.end();
}

TEST(RecordReader, OneTrailingSeparatorIsAllowed) {
  for (const char* text : {"7 8", "7 8 ", "7 8\n", "7\n8\n"}) {
    RecordReader in(text, kWhat);
    EXPECT_EQ(in.number<int>("a"), 7) << text;
    EXPECT_TRUE(in.more()) << text;
    EXPECT_EQ(in.number<int>("b"), 8) << text;
    EXPECT_FALSE(in.more()) << text;
    EXPECT_NO_THROW(in.end()) << text;
  }
}

TEST(RecordReader, TheLimitsOfEachTypeAreReadExactly) {
  RecordReader in("-9223372036854775808 9223372036854775807 4294967295 -2147483648 0 -0", kWhat);
  EXPECT_EQ(in.number<int64_t>("a"), std::numeric_limits<int64_t>::min());
  EXPECT_EQ(in.number<int64_t>("b"), std::numeric_limits<int64_t>::max());
  EXPECT_EQ(in.number<uint32_t>("c"), std::numeric_limits<uint32_t>::max());
  EXPECT_EQ(in.number<int>("d"), std::numeric_limits<int>::min());
  EXPECT_EQ(in.number<uint64_t>("e"), 0u);
  EXPECT_EQ(in.number<int>("f", -1, 1), 0);  // "-0" where negatives are allowed
  in.end();
}

TEST(RecordReader, TheBoundsOfARangeAreInsideIt) {
  RecordReader in("1 5 128", kWhat);
  EXPECT_EQ(in.number<int>("lo", 1, 5), 1);
  EXPECT_EQ(in.number<int>("hi", 1, 5), 5);
  EXPECT_EQ(in.number<uint64_t>("bytes", 128), 128u);
  in.end();
}

TEST(RecordReader, AnEmptyRecordHasNoFields) {
  RecordReader empty("", kWhat);
  EXPECT_FALSE(empty.more());
  EXPECT_NO_THROW(empty.end());
  EXPECT_TRUE(malformed([] { RecordReader("", kWhat).number<int>("count"); }, "count is missing"));
  EXPECT_TRUE(malformed([] { RecordReader("", kWhat).word("name", 8); }, "name is missing"));
}

TEST(RecordReader, AMissingFieldIsNamed) {
  EXPECT_TRUE(malformed(
      [] {
        RecordReader in("1 2", kWhat);
        in.number<int>("a");
        in.number<int>("b");
        in.number<int>("third");
      },
      "third is missing"));
  // A separator with nothing after it.
  EXPECT_TRUE(malformed(
      [] {
        RecordReader in("1 ", kWhat);
        in.number<int>("a");
        in.number<int>("second");
      },
      "second is missing"));
}

TEST(RecordReader, TwoSeparatorsInARowAreAMissingField) {
  for (const char* text : {"1  2", "1\n\n2", "1 \n2", "1\n 2"}) {
    EXPECT_TRUE(malformed(
        [&] {
          RecordReader in(text, kWhat);
          in.number<int>("a");
          in.number<int>("b");
        },
        "b is missing"))
        << text;
  }
}

TEST(RecordReader, ALeadingSeparatorIsAMissingField) {
  for (const char* text : {" 1", "\n1"})
    EXPECT_TRUE(malformed([&] { RecordReader(text, kWhat).number<int>("a"); }, "a is missing"))
        << text;
}

TEST(RecordReader, TrailingBytesAreAnError) {
  for (const char* text : {"1 2 3", "1 2  ", "1 2\n\n", "1 2 \n", "1 2\nx", "1 2  3"}) {
    EXPECT_TRUE(malformed(
        [&] {
          RecordReader in(text, kWhat);
          in.number<int>("a");
          in.number<int>("b");
          in.end();
        },
        "the record has"))
        << text;
  }
  EXPECT_TRUE(malformed(
      [] {
        RecordReader in("1 2 3", kWhat);
        in.number<int>("a");
        in.end();
      },
      "the record has 4 unexpected bytes at its end"));
}

TEST(RecordReader, ANumberMustBeWholeDecimalDigits) {
  for (const char* text :
       {"+1", "1x", "x1", "0x10", "1e3", "1.0", "1,0", "--1", "-", "+", "\t1", "1\t", "1\r"}) {
    EXPECT_TRUE(
        malformed([&] { RecordReader(text, kWhat).number<int>("n", -100, 100); }, "n is not a"))
        << '\'' << text << '\'';
  }
  // A NUL inside the field.
  const std::string nul(
      "1\0"
      "2",
      3);
  EXPECT_TRUE(malformed([&] { RecordReader(nul, kWhat).number<int>("n"); }, "n is not a"));
}

TEST(RecordReader, AMinusSignIsRefusedWhereTheRangeHasNoNegatives) {
  for (const char* text : {"-1", "-0", "-18446744073709551615"}) {
    EXPECT_TRUE(malformed([&] { RecordReader(text, kWhat).number<uint64_t>("u"); },
                          "u is not a non-negative integer"))
        << text;
    EXPECT_TRUE(malformed([&] { RecordReader(text, kWhat).number<uint32_t>("u"); },
                          "u is not a non-negative integer"))
        << text;
    // A signed type whose range starts at 0 refuses it alike.
    EXPECT_TRUE(malformed([&] { RecordReader(text, kWhat).number<int>("s", 0, 10); },
                          "s is not a non-negative integer"))
        << text;
    EXPECT_TRUE(malformed([&] { RecordReader(text, kWhat).number<int64_t>("s", 1); },
                          "s is not a non-negative integer"))
        << text;
  }
}

TEST(RecordReader, ANumberPastItsTypeIsAnError) {
  struct Case {
    const char* text;
    std::function<void(RecordReader&)> read;
  };
  const std::vector<Case> cases = {
      {"18446744073709551616", [](RecordReader& in) { in.number<uint64_t>("n"); }},
      {"99999999999999999999999", [](RecordReader& in) { in.number<uint64_t>("n"); }},
      {"9223372036854775808", [](RecordReader& in) { in.number<int64_t>("n"); }},
      {"-9223372036854775809", [](RecordReader& in) { in.number<int64_t>("n"); }},
      {"4294967296", [](RecordReader& in) { in.number<uint32_t>("n"); }},
      {"2147483648", [](RecordReader& in) { in.number<int>("n"); }},
      {"-2147483649", [](RecordReader& in) { in.number<int>("n"); }},
  };
  for (const Case& c : cases) {
    EXPECT_TRUE(malformed(
        [&] {
          RecordReader in(c.text, kWhat);
          c.read(in);
        },
        std::string("n is not a")))
        << c.text;
  }
}

TEST(RecordReader, ANumberOutsideItsRangeIsNamedWithTheRange) {
  EXPECT_TRUE(malformed([] { RecordReader("6", kWhat).number<int>("active", 0, 5); },
                        "active is 6, outside [0, 5]"));
  EXPECT_TRUE(malformed([] { RecordReader("0", kWhat).number<int>("capacity", 1, 1 << 20); },
                        "capacity is 0, outside [1, 1048576]"));
  EXPECT_TRUE(malformed([] { RecordReader("-6", kWhat).number<int>("fd", -1, 5); },
                        "fd is -6, outside [-1, 5]"));
  EXPECT_TRUE(malformed([] { RecordReader("127", kWhat).number<uint64_t>("bytes", 128); },
                        "bytes is 127, outside [128, 18446744073709551615]"));
  EXPECT_TRUE(malformed([] { RecordReader("65536", kWhat).number<int>("port", 1, 65535); },
                        "port is 65536, outside [1, 65535]"));
}

TEST(RecordReader, AWordLongerThanItsLimitIsAnError) {
  EXPECT_EQ(RecordReader("abcde", kWhat).word("w", 5), "abcde");
  EXPECT_TRUE(
      malformed([] { RecordReader("abcdef", kWhat).word("w", 5); }, "w is longer than 5 bytes"));
  // A word ends at a separator, not at its limit.
  EXPECT_TRUE(malformed(
      [] {
        RecordReader in("abc def", kWhat);
        in.word("w", 3);
        in.end();
      },
      "the record has"));
}

TEST(RecordReader, MoreSaysWhetherAnotherFieldFollows) {
  RecordReader in("a b\n", kWhat);
  EXPECT_TRUE(in.more());
  in.word("x", 1);
  EXPECT_TRUE(in.more());
  in.word("y", 1);
  EXPECT_FALSE(in.more());  // only the final separator is left
  RecordReader two("a\n\n", kWhat);
  two.word("x", 1);
  EXPECT_TRUE(two.more());  // two separators: a (missing) field follows
  EXPECT_TRUE(malformed([&] { two.word("y", 1); }, "y is missing"));
}

TEST(RecordReader, TheMessageNamesTheRecordAndTheField) {
  try {
    RecordReader in("1 x", "group view under 'g/admitted/3/1'");
    in.number<int>("epoch");
    in.number<int>("seq");
    FAIL() << "no error";
  } catch (const mooncake::Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInternal);
    const std::string what = e.what();
    EXPECT_EQ(what.rfind("malformed group view under 'g/admitted/3/1' in the store: seq ", 0), 0u)
        << what;
    EXPECT_NE(what.find("'x'"), std::string::npos) << what;  // the offending text
  }
  EXPECT_TRUE(throws_error(
      ErrorKind::kInternal,
      [] { RecordReader("1 2", "peer address under 'ep/addr/1/0'").fail("rank", " names 2"); },
      "malformed peer address under 'ep/addr/1/0' in the store: rank names 2"));
}

}  // namespace
}  // namespace mctest
