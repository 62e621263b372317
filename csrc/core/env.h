// Every XIRANG_* environment knob, declared once: name, default, type, when it is read and the
// doc line (NCCL's param table style). C++ reads knobs only through get*() below, Python through
// the xirang._C bindings of the same functions; README.md's table is generated from knobs()
// (`python -m xirang.env --markdown`, and a test checks that they agree).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace xirang::env {

// How a knob's value is parsed: the getter that may read it.
enum class Type : int {
  String,  // get()
  Int,     // getInt(): an integer with an optional K/M/G suffix (powers of 1024)
  Float,   // getDouble()
  Bool,    // getBool(): 1/true/yes/on or 0/false/no/off
};
// When a knob is read, so when changing it takes effect.
enum class Read : int {
  Process,  // at first use in the process, then cached
  Group,    // at every process group's creation
  Op,       // at every operation that uses it
  Call,     // at every call of the function its doc line names
};

struct Knob {
  const char* name;           // e.g. "XIRANG_SEGMENT_BYTES"
  const char* default_value;  // as a string; "" means unset
  const char* help;           // one line: meaning and unit
  Type type;
  Read read;
};

// The table, in a stable order.
const std::vector<Knob>& knobs();
// A declared knob's entry. Throws std::invalid_argument for a name not in the table.
const Knob& knob(const char* name);
// "string", "int", "float", "bool" / "process", "group", "op", "call".
const char* typeName(Type t);
const char* readName(Read r);

// Value of a declared knob: the environment's if set and non-empty, else the default.
// Throws std::invalid_argument for a name not in the table (a typo is a bug, not a default).
std::string get(const char* name);
// get() parsed as an integer (accepts a K/M/G suffix, powers of 1024). Throws
// std::invalid_argument naming the knob and the bad value, or if the knob is not of Type::Int.
int64_t getInt(const char* name);
// get() parsed as a number; std::invalid_argument as getInt (the knob must be Type::Float).
double getDouble(const char* name);
// 1/true/yes/on vs 0/false/no/off (case-insensitive; unset: the default). Anything else throws
// std::invalid_argument naming the knob and the accepted values (as does a knob that is not
// Type::Bool). The one boolean rule: Python reads its boolean knobs through this too
// (xirang._C.env_bool).
bool getBool(const char* name);

// Log levels of XIRANG_DEBUG (like NCCL_DEBUG): WARN (default), INFO, TRACE.
enum class Level : int { Warn = 0, Info = 1, Trace = 2 };
// XIRANG_DEBUG now (case-insensitive); any other value throws std::invalid_argument naming the
// accepted values. Group creation calls it, so a bad value is an error there.
Level parseLogLevel();
// parseLogLevel() as first read, cached. Never throws: a bad value logs as WARN here.
Level logLevel();
// Writes "xirang <host>:<pid> [rank] LEVEL msg" to stderr when level <= logLevel().
void log(Level level, int rank, const std::string& msg);

}  // namespace xirang::env
