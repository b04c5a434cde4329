# Which UCX the comm core links: the system's (pkg-config's `ucx`, e.g.
# Debian's libucx-dev; it may have InfiniBand) or the one PyPI ships for
# Python packages, the libucx-cu13 / libucx-cu12 wheels RAPIDS publishes
# (package `libucx`: headers, libraries and a CMake package config under its
# directory; tcp, shared memory, cma and CUDA transports).
#
#   FSDP_EXT_UCX=AUTO    the system's when pkg-config finds it, else the wheel's
#   FSDP_EXT_UCX=SYSTEM  the system's, required
#   FSDP_EXT_UCX=WHEEL   the wheel's, required, even where the system has one
#
# The wheel's directory: FSDP_EXT_UCX_WHEEL_DIR when given (setup.py passes
# it), else that of the `libucx` module the Python imports (Python3_EXECUTABLE,
# else the first python3 on PATH).
#
# Defines the target fsdp_ext_ucx and
#   FSDP_EXT_UCX_SOURCE   "system" or "wheel"
#   FSDP_EXT_UCX_VERSION  e.g. 1.22.0
#   FSDP_EXT_UCX_LIBDIR   the directory of libucp.so
# A UCX from the wheel is not on the loader's path: a program that links it
# needs that directory in its RPATH (CMake's build-tree RPATH does this for the
# C++ tests) or the libraries loaded before it (torch_fsdp_ext/_native.py does this
# for _C, through libucx.load_library()).

set(FSDP_EXT_UCX AUTO CACHE STRING "Which UCX: AUTO (the system's, else PyPI's libucx wheel), SYSTEM, WHEEL")
set_property(CACHE FSDP_EXT_UCX PROPERTY STRINGS AUTO SYSTEM WHEEL)
set(FSDP_EXT_UCX_WHEEL_DIR "" CACHE PATH
    "Directory of the libucx Python package (include/, lib/cmake/ucx); default: the Python's libucx module")
string(TOUPPER "${FSDP_EXT_UCX}" ucx_choice)
if(NOT ucx_choice MATCHES "^(AUTO|SYSTEM|WHEEL)$")
  message(FATAL_ERROR "FSDP_EXT_UCX=${FSDP_EXT_UCX}: expected AUTO, SYSTEM or WHEEL")
endif()

add_library(fsdp_ext_ucx INTERFACE)
set(FSDP_EXT_UCX_SOURCE "")

if(NOT ucx_choice STREQUAL "WHEEL")
  find_package(PkgConfig)
  if(PKG_CONFIG_FOUND)
    pkg_check_modules(UCX IMPORTED_TARGET ucx)
  endif()
  if(UCX_FOUND)
    set(FSDP_EXT_UCX_SOURCE system)
    set(FSDP_EXT_UCX_VERSION "${UCX_VERSION}")
    set(FSDP_EXT_UCX_LIBDIR "${UCX_LIBDIR}")
    target_link_libraries(fsdp_ext_ucx INTERFACE PkgConfig::UCX)
  elseif(ucx_choice STREQUAL "SYSTEM")
    message(FATAL_ERROR "FSDP_EXT_UCX=SYSTEM but pkg-config finds no `ucx` (Debian: apt-get install libucx-dev; or FSDP_EXT_UCX=WHEEL with pip install libucx-cu13)")
  endif()
endif()

if(NOT FSDP_EXT_UCX_SOURCE)
  set(wheel_dir "${FSDP_EXT_UCX_WHEEL_DIR}")
  if(NOT wheel_dir)
    set(python "${Python3_EXECUTABLE}")
    if(NOT python)
      find_program(python NAMES python3 python)
    endif()
    if(python)
      execute_process(
        COMMAND "${python}" -c "import os, libucx; print(os.path.dirname(os.path.realpath(libucx.__file__)))"
        OUTPUT_VARIABLE wheel_dir OUTPUT_STRIP_TRAILING_WHITESPACE ERROR_QUIET)
    endif()
  endif()
  if(NOT wheel_dir OR NOT EXISTS "${wheel_dir}/lib/cmake/ucx/ucx-config.cmake")
    message(FATAL_ERROR
      "No UCX found: pkg-config has no `ucx` and no libucx wheel is given or importable"
      " (FSDP_EXT_UCX_WHEEL_DIR='${FSDP_EXT_UCX_WHEEL_DIR}', python '${python}').\n"
      "Install one: `pip install libucx-cu13` (setup.py does this by itself), or Debian's libucx-dev.")
  endif()
  find_package(ucx CONFIG REQUIRED PATHS "${wheel_dir}/lib/cmake/ucx" NO_DEFAULT_PATH)
  set(FSDP_EXT_UCX_SOURCE wheel)
  set(FSDP_EXT_UCX_VERSION "${ucx_VERSION}")
  set(FSDP_EXT_UCX_LIBDIR "${wheel_dir}/lib")
  target_link_libraries(fsdp_ext_ucx INTERFACE ucx::ucp ucx::uct ucx::ucs)
endif()

target_compile_definitions(fsdp_ext_ucx INTERFACE
  FSDP_EXT_UCX_SOURCE="${FSDP_EXT_UCX_SOURCE}")
message(STATUS "UCX ${FSDP_EXT_UCX_VERSION} (${FSDP_EXT_UCX_SOURCE}) in ${FSDP_EXT_UCX_LIBDIR}")
