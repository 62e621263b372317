// Knob parsing (csrc/core/env.h): the one boolean rule and XIRANG_DEBUG's levels.
#include <catch2/catch.hpp>

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
