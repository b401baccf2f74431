# Every dependency comes from a Debian 12 package (deploy/install_deps.sh installs them) and is
# consumed through an imported target.
find_package(Threads REQUIRED)
find_package(absl CONFIG REQUIRED)
find_package(Protobuf REQUIRED)
find_package(gRPC CONFIG REQUIRED)
find_package(spdlog CONFIG REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(simdjson CONFIG REQUIRED)
find_package(PkgConfig REQUIRED)
# RE2 and cpp-httplib ship only pkg-config files in Debian 12.
pkg_check_modules(RE2 REQUIRED IMPORTED_TARGET re2)
pkg_check_modules(HTTPLIB REQUIRED IMPORTED_TARGET cpp-httplib)
# sd_notify for systemd Type=notify units (wpubd).
pkg_check_modules(SYSTEMD REQUIRED IMPORTED_TARGET libsystemd)
if(WPUB_BUILD_TESTS)
  find_package(GTest CONFIG REQUIRED)
endif()
if(WPUB_BUILD_BENCH)
  find_package(benchmark CONFIG REQUIRED)
endif()
