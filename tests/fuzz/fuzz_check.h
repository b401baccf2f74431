// FUZZ_CHECK: a property a fuzz target asserts about what it just ran (a round trip, a
// server that must still answer). A violation prints the condition and aborts, which both
// libFuzzer and the bounded driver of the normal build report as a crash with the input kept.
#pragma once

#include <cstdio>
#include <cstdlib>
#include <string>

#define FUZZ_CHECK(cond, what)                                                              \
  do {                                                                                      \
    if (!(cond)) {                                                                          \
      std::fprintf(stderr, "%s:%d: FUZZ_CHECK(%s) failed: %s\n", __FILE__, __LINE__, #cond, \
                   std::string(what).c_str());                                              \
      std::abort();                                                                         \
    }                                                                                       \
  } while (0)
