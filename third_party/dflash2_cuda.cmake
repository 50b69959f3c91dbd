# dflash2_cuda.cmake: decides whether the CUDA backend is built, and for which GPUs.
#
# Input (cache):
#   DFLASH2_CUDA        AUTO (default: on when a working nvcc is found), ON (required), OFF
#   DFLASH2_CUDA_ARCHS  ";"- or ","-separated list of real architectures, e.g. "90a;100a;103a".
#                       Each entry: <major><minor>[a|f], optionally written "sm_90a" or "90a-real".
#                       Only SASS is generated (no PTX), so each entry must be a GPU that runs it.
# Output (normal variables in the including scope):
#   DFLASH2_WITH_CUDA          ON / OFF
#   DFLASH2_CUDA_ARCHS_CLEAN   the normalised list ("90a;100a;103a")
#   DFLASH2_CUDA_ARCHS_CSV     the same joined with commas ("90a,100a,103a"), safe inside a -D define
#   DFLASH2_CUDA_ARCH_LIST     for CUDA_ARCHITECTURES: "90a-real;100a-real;103a-real"
#   DFLASH2_CUDA_SUMMARY       one line describing the result (also printed)
# plus the CUDA language enabled and the CUDA::* imported targets (find_package(CUDAToolkit)).
include_guard(GLOBAL)
include(CheckLanguage)

set(DFLASH2_WITH_CUDA OFF)
set(DFLASH2_CUDA_ARCHS_CLEAN "")
set(DFLASH2_CUDA_ARCH_LIST "")
set(DFLASH2_CUDA_ARCHS_CSV "")

# Oldest architecture we build for: the kernels use native bf16 (sm_80+).
set(_dflash2_min_arch 80)

# ------------------------------------------------------------------ mode
string(TOUPPER "${DFLASH2_CUDA}" _dflash2_mode)
if(_dflash2_mode MATCHES "^(ON|1|YES|TRUE|Y|REQUIRED)$")
  set(_dflash2_mode ON)
elseif(_dflash2_mode MATCHES "^(OFF|0|NO|FALSE|N)$")
  set(_dflash2_mode OFF)
elseif(_dflash2_mode STREQUAL "" OR _dflash2_mode STREQUAL "AUTO")
  set(_dflash2_mode AUTO)
else()
  message(FATAL_ERROR "dflash2: DFLASH2_CUDA='${DFLASH2_CUDA}' is not one of AUTO, ON, OFF")
endif()

if(_dflash2_mode STREQUAL "OFF")
  set(DFLASH2_CUDA_SUMMARY "CUDA backend OFF (DFLASH2_CUDA=OFF)")
  message(STATUS "dflash2: ${DFLASH2_CUDA_SUMMARY}")
  return()
endif()

# ------------------------------------------------------------------ find nvcc
# check_language() runs a small sub-project that finds the compiler from $CUDACXX or PATH.
# Unless the user chose one (CMAKE_CUDA_COMPILER / $CUDACXX), look for nvcc on PATH, then in
# the usual install locations, and hand the result to the check through $CUDACXX.
set(_dflash2_cudacxx_was_set FALSE)
if(NOT DEFINED CMAKE_CUDA_COMPILER AND NOT DEFINED ENV{CUDACXX})
  find_program(_dflash2_nvcc nvcc NO_CACHE
    NO_PACKAGE_ROOT_PATH NO_CMAKE_PATH NO_CMAKE_ENVIRONMENT_PATH NO_CMAKE_SYSTEM_PATH)  # PATH only
  if(NOT _dflash2_nvcc)
    set(_dflash2_nvcc_hints "")
    foreach(_v CUDAToolkit_ROOT CUDA_HOME CUDA_PATH)
      if(DEFINED ENV{${_v}})
        list(APPEND _dflash2_nvcc_hints "$ENV{${_v}}/bin")
      endif()
    endforeach()
    list(APPEND _dflash2_nvcc_hints /usr/local/cuda/bin /opt/cuda/bin)
    find_program(_dflash2_nvcc nvcc PATHS ${_dflash2_nvcc_hints} NO_DEFAULT_PATH NO_CACHE)
  endif()
  if(_dflash2_nvcc)
    set(ENV{CUDACXX} "${_dflash2_nvcc}")
    set(_dflash2_cudacxx_was_set TRUE)
  endif()
endif()

check_language(CUDA)
if(_dflash2_cudacxx_was_set)
  unset(ENV{CUDACXX})
endif()

if(NOT CMAKE_CUDA_COMPILER)
  set(_dflash2_why "no working CUDA compiler: looked for nvcc on PATH, in $CUDACXX, $CUDA_HOME/bin, "
                   "$CUDA_PATH/bin, /usr/local/cuda/bin and /opt/cuda/bin (details in CMakeFiles/CMakeConfigureLog.yaml)")
  string(CONCAT _dflash2_why ${_dflash2_why})
  if(_dflash2_mode STREQUAL "ON")
    message(FATAL_ERROR
      "dflash2: DFLASH2_CUDA=ON but ${_dflash2_why}.\n"
      "Install the CUDA toolkit, or pass -DCMAKE_CUDA_COMPILER=/path/to/nvcc, "
      "or configure with -DDFLASH2_CUDA=AUTO/OFF to build the CPU backend only.\n"
      "(If a previous configure cached CMAKE_CUDA_COMPILER-NOTFOUND, remove it: -UCMAKE_CUDA_COMPILER.)")
  endif()
  set(DFLASH2_CUDA_SUMMARY "CUDA backend OFF (DFLASH2_CUDA=AUTO: ${_dflash2_why})")
  message(STATUS "dflash2: ${DFLASH2_CUDA_SUMMARY}")
  return()
endif()

# nvcc's version, for messages (CMAKE_CUDA_COMPILER_VERSION is known only after enable_language)
set(_dflash2_nvcc_version "")
execute_process(COMMAND "${CMAKE_CUDA_COMPILER}" --version OUTPUT_VARIABLE _dflash2_out ERROR_QUIET RESULT_VARIABLE _rc)
if(_rc EQUAL 0 AND _dflash2_out MATCHES "V([0-9]+\\.[0-9]+\\.[0-9]+)")
  set(_dflash2_nvcc_version "${CMAKE_MATCH_1}")
endif()

# ------------------------------------------------------------------ validate the archs
string(REPLACE "," ";" _dflash2_archs_in "${DFLASH2_CUDA_ARCHS}")
string(REPLACE " " ";" _dflash2_archs_in "${_dflash2_archs_in}")
list(REMOVE_ITEM _dflash2_archs_in "")
if(NOT _dflash2_archs_in)
  message(FATAL_ERROR "dflash2: DFLASH2_CUDA_ARCHS is empty; give e.g. -DDFLASH2_CUDA_ARCHS=\"90a;100a;103a\"")
endif()

# A file for nvcc --dryrun, which rejects architectures this nvcc does not know without compiling.
set(_dflash2_probe "${CMAKE_CURRENT_BINARY_DIR}/CMakeFiles/dflash2_arch_probe.cu")
if(NOT EXISTS "${_dflash2_probe}")
  file(WRITE "${_dflash2_probe}" "__global__ void dflash2_arch_probe() {}\n")
endif()

foreach(_a IN LISTS _dflash2_archs_in)
  string(STRIP "${_a}" _a)
  string(TOLOWER "${_a}" _n)
  string(REGEX REPLACE "^sm_" "" _n "${_n}")
  string(REGEX REPLACE "-real$" "" _n "${_n}")
  if(_n MATCHES "-virtual$" OR _a MATCHES "^compute_")
    message(FATAL_ERROR "dflash2: DFLASH2_CUDA_ARCHS entry '${_a}' asks for PTX; dflash2 builds SASS only "
                        "(one real architecture per target GPU, e.g. 90a, 100a, 103a)")
  endif()
  if(_n MATCHES "^(native|all|all-major)$")
    message(FATAL_ERROR "dflash2: DFLASH2_CUDA_ARCHS entry '${_a}' is not supported; list the real "
                        "architectures explicitly, e.g. -DDFLASH2_CUDA_ARCHS=\"90a;100a;103a\"")
  endif()
  if(NOT _n MATCHES "^([0-9]+)([af]?)$")
    message(FATAL_ERROR "dflash2: DFLASH2_CUDA_ARCHS entry '${_a}' is not a CUDA architecture; expected "
                        "<major><minor>[a|f] such as 80, 90, 90a, 100a, 103a")
  endif()
  set(_num "${CMAKE_MATCH_1}")
  set(_suffix "${CMAKE_MATCH_2}")
  if(_num LESS _dflash2_min_arch)
    message(FATAL_ERROR "dflash2: DFLASH2_CUDA_ARCHS entry '${_a}': sm_${_num} is too old; dflash2 needs "
                        "sm_${_dflash2_min_arch} or newer (native bf16)")
  endif()
  execute_process(
    COMMAND "${CMAKE_CUDA_COMPILER}" --dryrun -c "${_dflash2_probe}" -o dflash2_arch_probe.o
            "--generate-code=arch=compute_${_n},code=sm_${_n}"
    RESULT_VARIABLE _rc OUTPUT_QUIET ERROR_VARIABLE _err)
  if(NOT _rc EQUAL 0)
    string(REGEX MATCH "[^\n]*(Unsupported|unsupported|not defined|Value)[^\n]*" _msg "${_err}")
    if(NOT _msg)
      set(_msg "${_err}")
    endif()
    string(STRIP "${_msg}" _msg)
    message(FATAL_ERROR "dflash2: DFLASH2_CUDA_ARCHS entry '${_a}' (sm_${_n}) is not supported by "
                        "${CMAKE_CUDA_COMPILER} (CUDA ${_dflash2_nvcc_version}): ${_msg}")
  endif()
  if(NOT _n IN_LIST DFLASH2_CUDA_ARCHS_CLEAN)
    list(APPEND DFLASH2_CUDA_ARCHS_CLEAN "${_n}")
    list(APPEND DFLASH2_CUDA_ARCH_LIST "${_n}-real")
  endif()
endforeach()

# ------------------------------------------------------------------ enable CUDA
# Set before enable_language so that CMake's own compiler checks use these archs rather than
# probing for a default (there may be no GPU on the build machine).
if(NOT DEFINED CMAKE_CUDA_ARCHITECTURES)
  set(CMAKE_CUDA_ARCHITECTURES "${DFLASH2_CUDA_ARCH_LIST}")
endif()
# nvcc uses the same host compiler as the C++ code (ABI, OpenMP, flags).
if(NOT CMAKE_CUDA_HOST_COMPILER AND NOT DEFINED ENV{CUDAHOSTCXX}
   AND CMAKE_CXX_COMPILER_ID MATCHES "GNU|Clang")
  set(CMAKE_CUDA_HOST_COMPILER "${CMAKE_CXX_COMPILER}")
endif()
enable_language(CUDA)
find_package(CUDAToolkit REQUIRED)

if(NOT TARGET CUDA::cudart_static)
  message(FATAL_ERROR "dflash2: the CUDA toolkit at ${CUDAToolkit_LIBRARY_DIR} has no static runtime "
                      "(libcudart_static); dflash2 links it so that a machine without a GPU can still load "
                      "the library")
endif()

set(DFLASH2_WITH_CUDA ON)
list(JOIN DFLASH2_CUDA_ARCHS_CLEAN "," DFLASH2_CUDA_ARCHS_CSV)
set(_dflash2_sass "")
foreach(_n IN LISTS DFLASH2_CUDA_ARCHS_CLEAN)
  list(APPEND _dflash2_sass "sm_${_n}")
endforeach()
list(JOIN _dflash2_sass " " _dflash2_sass)
set(_dflash2_host "${CMAKE_CUDA_HOST_COMPILER}")
if(NOT _dflash2_host)
  set(_dflash2_host "nvcc default")
endif()
set(DFLASH2_CUDA_SUMMARY
    "CUDA backend ON (DFLASH2_CUDA=${_dflash2_mode}): toolkit ${CUDAToolkit_VERSION}, nvcc ${CMAKE_CUDA_COMPILER}, "
    "host compiler ${_dflash2_host}, SASS for ${_dflash2_sass} (no PTX)")
string(CONCAT DFLASH2_CUDA_SUMMARY ${DFLASH2_CUDA_SUMMARY})
message(STATUS "dflash2: ${DFLASH2_CUDA_SUMMARY}")
