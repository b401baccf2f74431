# Compile options for wpub's own targets: warnings on, and IEEE arithmetic everywhere (the
# NVFP4 contract forbids contracting a multiply and an add into an FMA, and fast math).
function(wpub_target_options target)
  target_compile_options(${target} PRIVATE
    $<$<COMPILE_LANGUAGE:CXX>:-Wall -Wextra -ffp-contract=off -fno-fast-math>
    $<$<COMPILE_LANGUAGE:CUDA>:-fmad=false --expt-relaxed-constexpr -Xcompiler=-Wall,-Wextra,-ffp-contract=off>)
endfunction()

# Registers a GoogleTest binary with CTest, every discovered test carrying LABEL.
# SERIAL: the tests run alone (ctest RUN_SERIAL), for measurements other tests would disturb.
function(wpub_add_gtest name label)
  cmake_parse_arguments(ARG "SERIAL" "" "SOURCES;LIBS" ${ARGN})
  add_executable(${name} ${ARG_SOURCES})
  wpub_target_options(${name})
  target_link_libraries(${name} PRIVATE ${ARG_LIBS} GTest::gmock GTest::gtest_main)
  if(ARG_SERIAL)
    gtest_discover_tests(${name} PROPERTIES LABELS ${label} RUN_SERIAL TRUE DISCOVERY_TIMEOUT 60)
  else()
    gtest_discover_tests(${name} PROPERTIES LABELS ${label} DISCOVERY_TIMEOUT 60)
  endif()
endfunction()
