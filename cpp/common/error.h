// Errors of the kvcmas core. Every failure that a caller can cause (bad file, bad argument, out of memory budget)
// is thrown as kvcmas::Error with a message that names the object and the problem; the bindings turn it into a
// Python exception (ValueError for kvcmas::Error, MemoryError for std::bad_alloc).
#pragma once

#include <cstdarg>
#include <stdexcept>
#include <string>

namespace kvcmas {

class Error : public std::runtime_error {
  public:
    explicit Error(const std::string & what) : std::runtime_error(what) {}
};

// printf-style message builder.
std::string format(const char * fmt, ...) __attribute__((format(printf, 1, 2)));

// Throws kvcmas::Error(format(fmt, ...)).
[[noreturn]] void fail(const char * fmt, ...) __attribute__((format(printf, 1, 2)));

}  // namespace kvcmas

// Checks a condition that input data or arguments can break; throws kvcmas::Error with the formatted message.
#define KC_CHECK(cond, ...)             \
    do {                                \
        if (!(cond)) {                  \
            ::kvcmas::fail(__VA_ARGS__); \
        }                               \
    } while (0)
