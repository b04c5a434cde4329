# The CUDA parts of the extension (csrc/device, csrc/backend/cuda): built when
# the torch that builds us is a CUDA build and CMake finds a CUDA compiler.
#
#   FSDP_EXT_CUDA=AUTO  both found: build them; else say why not and build
#                       the CPU-only extension (CUDA tensors are then refused
#                       with a clear error)
#   FSDP_EXT_CUDA=ON    required: a CUDA torch and a CUDA compiler
#   FSDP_EXT_CUDA=OFF   never (a CPU-only extension from a CUDA torch)
#
# The GPU architectures: CMAKE_CUDA_ARCHITECTURES (or CMake's CUDAARCHS
# environment variable) when given, else 90 (the H100 / H200 we test on) --
# set before the language is enabled, which would otherwise pick the
# compiler's oldest default.
#
# Sets FSDP_EXT_WITH_CUDA (ON/OFF) and, when ON, FSDP_EXT_CUDA_LIBRARIES (torch's
# CUDA libraries and the CUDA runtime) for the extension.

set(FSDP_EXT_CUDA AUTO CACHE STRING "Build the CUDA parts: AUTO, ON, OFF")
set_property(CACHE FSDP_EXT_CUDA PROPERTY STRINGS AUTO ON OFF)
string(TOUPPER "${FSDP_EXT_CUDA}" cuda_choice)
if(NOT cuda_choice MATCHES "^(AUTO|ON|OFF)$")
  message(FATAL_ERROR "FSDP_EXT_CUDA=${FSDP_EXT_CUDA}: expected AUTO, ON or OFF")
endif()

set(FSDP_EXT_WITH_CUDA OFF)
set(why_not_cuda "")
if(cuda_choice STREQUAL "OFF")
  set(why_not_cuda "FSDP_EXT_CUDA=OFF")
elseif(NOT FSDP_EXT_TORCH_CUDA)
  set(why_not_cuda "torch ${FSDP_EXT_TORCH_VERSION} is a CPU build")
else()
  include(CheckLanguage)
  check_language(CUDA)
  if(NOT CMAKE_CUDA_COMPILER)
    set(why_not_cuda "no CUDA compiler found (set CUDACXX, or put nvcc on PATH)")
  endif()
endif()

if(why_not_cuda)
  if(cuda_choice STREQUAL "ON")
    message(FATAL_ERROR "FSDP_EXT_CUDA=ON but ${why_not_cuda}")
  endif()
  message(STATUS "torch_fsdp_ext._C without CUDA: ${why_not_cuda}")
  return()
endif()

if(NOT CMAKE_CUDA_ARCHITECTURES AND NOT DEFINED ENV{CUDAARCHS})
  set(CMAKE_CUDA_ARCHITECTURES 90)
endif()
enable_language(CUDA)
set(CMAKE_CUDA_STANDARD 17)
set(CMAKE_CUDA_STANDARD_REQUIRED ON)
find_package(CUDAToolkit REQUIRED)

set(FSDP_EXT_CUDA_LIBRARIES "")
foreach(name c10_cuda torch_cuda)
  find_library(FSDP_EXT_LIB_${name} ${name} PATHS "${FSDP_EXT_TORCH_DIR}/lib"
               NO_DEFAULT_PATH NO_CACHE)
  if(NOT FSDP_EXT_LIB_${name})
    message(FATAL_ERROR "torch ${FSDP_EXT_TORCH_VERSION} has CUDA but no lib${name}.so in ${FSDP_EXT_TORCH_DIR}/lib")
  endif()
  list(APPEND FSDP_EXT_CUDA_LIBRARIES "${FSDP_EXT_LIB_${name}}")
endforeach()
# The CUDA runtime the extension links by its soname (libcudart.so.13):
# `import torch` has loaded the one torch came with (PyPI's nvidia-cuda-runtime).
list(APPEND FSDP_EXT_CUDA_LIBRARIES CUDA::cudart)

if(NOT CUDAToolkit_VERSION_MAJOR STREQUAL "")
  string(REGEX MATCH "^[0-9]+" torch_cuda_major "${FSDP_EXT_TORCH_CUDA}")
  if(NOT torch_cuda_major STREQUAL CUDAToolkit_VERSION_MAJOR)
    message(WARNING "CUDA compiler ${CUDAToolkit_VERSION} but torch was built with CUDA ${FSDP_EXT_TORCH_CUDA}: the extension may not load (FSDP_EXT_CUDA=OFF builds it without CUDA)")
  endif()
endif()
set(FSDP_EXT_WITH_CUDA ON)
message(STATUS "torch_fsdp_ext._C with CUDA ${CUDAToolkit_VERSION} for sm ${CMAKE_CUDA_ARCHITECTURES}")
