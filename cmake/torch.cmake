# The torch the extension is built against, found through the Python that
# imports it -- not through torch's own CMake package. TorchConfig.cmake pulls
# in Caffe2Config.cmake, which for a CUDA build of torch (PyPI's default)
# demands a CUDA toolkit, a GPU architecture to compile for and nvrtc, even
# when nothing of ours is CUDA. Like torch.utils.cpp_extension, this asks the
# interpreter for torch's package directory and takes the include and library
# directories under it.
#
# Which Python: Python3_EXECUTABLE when given (setup.py passes sys.executable).
# Otherwise, when CMAKE_PREFIX_PATH names a torch's CMake prefix
# (torch.utils.cmake_prefix_path, <torch>/share/cmake), the first of these
# that imports that very torch: the active virtualenv's or conda env's python,
# then a python3 in bin/ of a directory above the torch package. Failing
# those, FindPython's own search.
#
# Sets FSDP_EXT_EXTENSION_SKIPPED to why the extension cannot be built, or
# else defines the target fsdp_ext_torch (include directories, libraries and
# the compile definitions a torch.utils.cpp_extension.CppExtension gets) and
#   FSDP_EXT_TORCH_DIR        torch's package directory (real path)
#   FSDP_EXT_TORCH_VERSION    torch.__version__, e.g. 2.11.0+cu130
#   FSDP_EXT_TORCH_CUDA       torch.version.cuda, empty for a CPU build
#   FSDP_EXT_MODULE_SUFFIX    the interpreter's extension module suffix
#   FSDP_EXT_TORCH_CXX11_ABI  0 or 1: the libstdc++ ABI of torch's binaries

set(FSDP_EXT_EXTENSION_SKIPPED "")
set(FSDP_EXT_PYTHON_HINT "-DPython3_EXECUTABLE=$(command -v python)")

# Prints the real path of the torch package `python` would import, without
# importing it (a second per candidate instead of several).
set(FSDP_EXT_WHICH_TORCH
    "import importlib.util as u, os; s = u.find_spec('torch'); print(os.path.realpath(os.path.dirname(s.origin)) if s else '')")

if(NOT Python3_EXECUTABLE)
  set(prefix_torch_dir "")
  foreach(prefix IN LISTS CMAKE_PREFIX_PATH)
    if(EXISTS "${prefix}/Torch/TorchConfig.cmake")
      file(REAL_PATH "${prefix}/../.." prefix_torch_dir)
      break()
    endif()
  endforeach()
  if(prefix_torch_dir)
    set(candidates "")
    foreach(env VIRTUAL_ENV CONDA_PREFIX)
      if(DEFINED ENV{${env}})
        list(APPEND candidates "$ENV{${env}}/bin/python")
      endif()
    endforeach()
    set(dir "${prefix_torch_dir}")
    foreach(level RANGE 1 4)
      get_filename_component(dir "${dir}" DIRECTORY)
      list(APPEND candidates "${dir}/bin/python3")
    endforeach()
    foreach(candidate IN LISTS candidates)
      if(EXISTS "${candidate}")
        execute_process(COMMAND "${candidate}" -c "${FSDP_EXT_WHICH_TORCH}"
                        OUTPUT_VARIABLE candidate_torch OUTPUT_STRIP_TRAILING_WHITESPACE
                        ERROR_QUIET)
        if(candidate_torch STREQUAL prefix_torch_dir)
          set(Python3_EXECUTABLE "${candidate}" CACHE FILEPATH
              "Python interpreter whose torch the extension is built against")
          break()
        endif()
      endif()
    endforeach()
    if(NOT Python3_EXECUTABLE)
      set(FSDP_EXT_EXTENSION_SKIPPED
          "no python found that imports the torch in ${prefix_torch_dir} (from CMAKE_PREFIX_PATH); give it: ${FSDP_EXT_PYTHON_HINT}")
    endif()
  elseif(DEFINED ENV{VIRTUAL_ENV} AND EXISTS "$ENV{VIRTUAL_ENV}/bin/python")
    set(Python3_EXECUTABLE "$ENV{VIRTUAL_ENV}/bin/python" CACHE FILEPATH
        "Python interpreter whose torch the extension is built against")
  endif()
endif()

if(NOT FSDP_EXT_EXTENSION_SKIPPED)
  find_package(Python3 COMPONENTS Interpreter Development.Module)
  if(NOT Python3_FOUND)
    set(FSDP_EXT_EXTENSION_SKIPPED
        "Python 3 interpreter or headers not found; give the interpreter that has torch: ${FSDP_EXT_PYTHON_HINT}")
  endif()
endif()

if(NOT FSDP_EXT_EXTENSION_SKIPPED)
  # What torch.utils.cpp_extension would use for this interpreter and torch,
  # one fact a line: the package directory, the version, the CUDA version
  # (empty for a CPU build), the extension module suffix, the libstdc++ ABI
  # of torch's binaries and -- for torch versions that still report them --
  # the pybind11 ABI macros, so our pybind11 types interoperate with torch's.
  # (Newer pybind11, as shipped since torch 2.11, derives these itself.)
  execute_process(
    COMMAND "${Python3_EXECUTABLE}" -c [[
import os, sysconfig, torch
print(os.path.realpath(os.path.dirname(torch.__file__)))
print(torch.__version__)
print(torch.version.cuda or "")
print(sysconfig.get_config_var("EXT_SUFFIX"))
print(int(torch._C._GLIBCXX_USE_CXX11_ABI))
for name in ("COMPILER_TYPE", "STDLIB", "BUILD_ABI"):
    value = getattr(torch._C, "_PYBIND11_" + name, None)
    if value is not None:
        print('PYBIND11_%s="%s"' % (name, value))
]]
    RESULT_VARIABLE result OUTPUT_VARIABLE facts ERROR_VARIABLE error
    OUTPUT_STRIP_TRAILING_WHITESPACE)
  string(STRIP "${error}" error)
  if(error)
    string(REGEX MATCH "[^\n]+$" error "${error}")  # the exception's last line
  endif()
  # One list element a line; an empty line (a CPU build's CUDA version) stays
  # an element of its own.
  string(REPLACE "\n" ";" facts "${facts}")
  list(LENGTH facts count)
  if(NOT result EQUAL 0 OR count LESS 5)
    set(FSDP_EXT_EXTENSION_SKIPPED
        "${Python3_EXECUTABLE} cannot import torch (${error}); give the interpreter that has it: ${FSDP_EXT_PYTHON_HINT}")
  else()
    list(POP_FRONT facts FSDP_EXT_TORCH_DIR FSDP_EXT_TORCH_VERSION FSDP_EXT_TORCH_CUDA
         FSDP_EXT_MODULE_SUFFIX FSDP_EXT_TORCH_CXX11_ABI)
    set(pybind11_definitions ${facts})
    if(prefix_torch_dir AND NOT prefix_torch_dir STREQUAL FSDP_EXT_TORCH_DIR)
      set(FSDP_EXT_EXTENSION_SKIPPED
          "${Python3_EXECUTABLE} imports the torch in ${FSDP_EXT_TORCH_DIR}, not the one CMAKE_PREFIX_PATH names (${prefix_torch_dir}); give the interpreter that has that torch (${FSDP_EXT_PYTHON_HINT}), in a fresh build directory")
    endif()
  endif()
endif()

if(NOT FSDP_EXT_EXTENSION_SKIPPED)
  # The libraries a CppExtension links. libtorch and libtorch_cpu are all a
  # CPU-only extension needs of a CUDA build too (libtorch_cuda is loaded by
  # `import torch`, which torch_fsdp_ext does before _C).
  set(torch_libraries "")
  foreach(name c10 torch torch_cpu torch_python)
    find_library(FSDP_EXT_LIB_${name} ${name} PATHS "${FSDP_EXT_TORCH_DIR}/lib"
                 NO_DEFAULT_PATH NO_CACHE)
    if(NOT FSDP_EXT_LIB_${name})
      set(FSDP_EXT_EXTENSION_SKIPPED "lib${name}.so not found in ${FSDP_EXT_TORCH_DIR}/lib")
      break()
    endif()
    list(APPEND torch_libraries "${FSDP_EXT_LIB_${name}}")
  endforeach()
endif()

if(NOT FSDP_EXT_EXTENSION_SKIPPED)
  add_library(fsdp_ext_torch INTERFACE)
  # As system directories: torch's headers' own warnings are not ours.
  target_include_directories(fsdp_ext_torch SYSTEM INTERFACE
    "${FSDP_EXT_TORCH_DIR}/include"
    "${FSDP_EXT_TORCH_DIR}/include/torch/csrc/api/include")
  # (_GLIBCXX_USE_CXX11_ABI goes on the comm core, whose objects the module
  # links too: CMakeLists.txt.)
  target_compile_definitions(fsdp_ext_torch INTERFACE
    TORCH_API_INCLUDE_EXTENSION_H ${pybind11_definitions})
  target_link_libraries(fsdp_ext_torch INTERFACE ${torch_libraries} Python3::Module)
endif()
