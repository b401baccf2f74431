# Instrumented builds for finding memory and undefined-behaviour bugs on the CPU path. Both
# options instrument every wpub target (and the generated protobuf code), not the Debian
# libraries. The CUDA kernels are not instrumented, so a sanitizer build is a CPU build.
#  - WPUB_SANITIZE: -fsanitize=address,undefined with every UBSan check fatal (gcc or clang).
#  - WPUB_FUZZ: clang only; the same sanitizers plus libFuzzer's coverage instrumentation, and
#    tests/fuzz links its targets as libFuzzer binaries (fuzz_<target>).
if(WPUB_FUZZ)
  if(NOT CMAKE_CXX_COMPILER_ID STREQUAL "Clang")
    message(FATAL_ERROR "WPUB_FUZZ needs clang (libFuzzer): configure with "
                        "-DCMAKE_C_COMPILER=clang -DCMAKE_CXX_COMPILER=clang++")
  endif()
  set(WPUB_SANITIZE ON)
endif()
if(WPUB_SANITIZE)
  if(WPUB_HAVE_CUDA)
    message(FATAL_ERROR "WPUB_SANITIZE/WPUB_FUZZ are CPU builds: add -DWPUB_ENABLE_CUDA=OFF")
  endif()
  set(WPUB_SANITIZER_FLAGS -fsanitize=address,undefined -fno-sanitize-recover=all
                           -fno-omit-frame-pointer)
  if(WPUB_FUZZ)
    list(APPEND WPUB_SANITIZER_FLAGS -fsanitize=fuzzer-no-link)
  endif()
  add_compile_options("$<$<COMPILE_LANGUAGE:C,CXX>:${WPUB_SANITIZER_FLAGS}>")
  add_link_options("$<$<LINK_LANGUAGE:C,CXX>:-fsanitize=address,undefined>")
  message(STATUS "wpub: sanitizers on (${WPUB_SANITIZER_FLAGS})")
endif()
