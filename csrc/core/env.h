// Every XIRANG_* environment knob, declared once with its default (NCCL's param table style).
// README.md mirrors this table; `python -m xirang.env` prints it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace xirang::env {

struct Knob {
  const char* name;           // e.g. "XIRANG_SEGMENT_BYTES"
  const char* default_value;  // as a string; "" means unset
  const char* help;           // one line: meaning and unit
};

// The table, in a stable order.
const std::vector<Knob>& knobs();

// Value of a declared knob: the environment's if set and non-empty, else the default.
// Throws std::invalid_argument for a name not in the table (a typo is a bug, not a default).
std::string get(const char* name);
// get() parsed as an integer (accepts a K/M/G suffix, powers of 1024). Throws
// std::invalid_argument naming the knob and the bad value.
int64_t getInt(const char* name);
double getDouble(const char* name);
// 1/true/yes/on vs 0/false/no/off (case-insensitive; unset: the default). Anything else throws
// std::invalid_argument naming the knob and the accepted values. The one boolean rule: Python
// reads its boolean knobs through this too (xirang._C.env_bool).
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
