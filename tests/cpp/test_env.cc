// Knob parsing (csrc/core/env.h): the one boolean rule and XIRANG_DEBUG's levels.
#include <catch2/catch.hpp>

#include <cctype>
#include <cstdlib>
#include <stdexcept>
#include <string>

#include "core/env.h"

namespace env = xirang::env;

namespace {

// Sets a knob for the scope of one check, restoring what was there.
struct ScopedEnv {
  const char* name;
  std::string old;
  bool had;
  ScopedEnv(const char* n, const char* v) : name(n), had(std::getenv(n) != nullptr) {
    if (had) old = std::getenv(n);
    setenv(n, v, 1);
  }
  ~ScopedEnv() {
    if (had) setenv(name, old.c_str(), 1);
    else unsetenv(name);
  }
};

std::string errorOf(void (*fn)()) {
  try {
    fn();
  } catch (const std::invalid_argument& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("env: booleans take 1/0, true/false, yes/no, on/off in any case and nothing else", "[env]") {
  for (const char* v : {"1", "true", "TRUE", "Yes", "on", "ON"}) {
    ScopedEnv e("XIRANG_ELASTIC", v);
    INFO(v);
    CHECK(env::getBool("XIRANG_ELASTIC"));
  }
  for (const char* v : {"0", "false", "False", "NO", "off", ""}) {  // "": unset, the default (0)
    ScopedEnv e("XIRANG_ELASTIC", v);
    INFO(v);
    CHECK_FALSE(env::getBool("XIRANG_ELASTIC"));
  }
  {
    ScopedEnv e("XIRANG_STATS", "");  // unset: the default, 1
    CHECK(env::getBool("XIRANG_STATS"));
  }
  for (const char* v : {"2", "maybe", " 1", "y", "-1"}) {
    ScopedEnv e("XIRANG_ELASTIC", v);
    const std::string what = errorOf([] { env::getBool("XIRANG_ELASTIC"); });
    CAPTURE(v, what);
    CHECK(what.find(std::string("XIRANG_ELASTIC='") + v + "' is not a boolean") != std::string::npos);
    CHECK(what.find("1, true, yes, on and 0, false, no, off") != std::string::npos);
  }
}

TEST_CASE("env: XIRANG_DEBUG is WARN, INFO or TRACE in any case", "[env]") {
  {
    ScopedEnv e("XIRANG_DEBUG", "");
    CHECK(env::parseLogLevel() == env::Level::Warn);
  }
  {
    ScopedEnv e("XIRANG_DEBUG", "info");
    CHECK(env::parseLogLevel() == env::Level::Info);
  }
  {
    ScopedEnv e("XIRANG_DEBUG", "Trace");
    CHECK(env::parseLogLevel() == env::Level::Trace);
  }
  for (const char* v : {"LOUD", "DEBUG", "1"}) {
    ScopedEnv e("XIRANG_DEBUG", v);
    const std::string what = errorOf([] { env::parseLogLevel(); });
    CAPTURE(v, what);
    CHECK(what.find(std::string("XIRANG_DEBUG='") + v + "' is not a log level") != std::string::npos);
    CHECK(what.find("WARN, INFO, TRACE") != std::string::npos);
    CHECK_NOTHROW(env::logLevel());  // logging itself never throws
  }
}

TEST_CASE("env: a knob is read only through the getter of its declared type", "[env]") {
  CHECK(env::knob("XIRANG_STATS").type == env::Type::Bool);
  CHECK(env::getBool("XIRANG_STATS"));
  const std::string what = errorOf([] { env::getInt("XIRANG_STATS"); });
  CHECK(what.find("XIRANG_STATS is declared as bool, not int") != std::string::npos);
  CHECK_FALSE(errorOf([] { env::getDouble("XIRANG_SEGMENT_BYTES"); }).empty());
  CHECK_FALSE(errorOf([] { env::getBool("XIRANG_HEARTBEAT_S"); }).empty());
  CHECK(env::getInt("XIRANG_SEGMENT_BYTES") > 0);
  CHECK_FALSE(errorOf([] { env::knob("XIRANG_NO_SUCH_KNOB"); }).empty());
}

TEST_CASE("env: every knob declares a type, when it is read and a doc line without issue numbers", "[env]") {
  for (const auto& k : env::knobs()) {
    INFO(k.name);
    CHECK(std::string(env::typeName(k.type)) != "?");
    CHECK(std::string(env::readName(k.read)) != "?");
    const std::string help = k.help;
    CHECK_FALSE(help.empty());
    for (size_t i = help.find('#'); i != std::string::npos; i = help.find('#', i + 1))
      CHECK_FALSE((i + 1 < help.size() && std::isdigit(static_cast<unsigned char>(help[i + 1]))));
    // The default parses with the knob's own getter (unset defaults read as empty / 0 / false).
    ScopedEnv unset(k.name, "");
    if (k.type == env::Type::Int) CHECK_NOTHROW(env::getInt(k.name));
    if (k.type == env::Type::Float) CHECK_NOTHROW(env::getDouble(k.name));
    if (k.type == env::Type::Bool) CHECK_NOTHROW(env::getBool(k.name));
  }
}
